"""The fused metric kernel: both backends against a float64 oracle, and through a real Diff."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tdinspect import DumpSet
from tdinspect.numerics import kernels
from tdinspect.numerics.metrics import compare_tensors

from .test_dumpset_diff import write_dump

pytest.importorskip("numba")


def oracle(x: np.ndarray, y: np.ndarray, rtol: float, atol: float, eps: float = kernels.EPS) -> dict:
    """The definitions, straight, in float64."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    d, ay = np.abs(x64 - y64), np.abs(y64)
    return {
        "sxx": float(x64 @ x64),
        "syy": float(y64 @ y64),
        "sdd": float(d @ d),
        "sabs": float(d.sum()),
        "max_abs": float(d.max(initial=0.0)),
        "max_rel": float((d / np.maximum(ay, eps)).max(initial=0.0)),
        "mismatch": int((d > atol + rtol * ay).sum()),
    }


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 3000),
    dtype=st.sampled_from([np.float32, np.float64]),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]),
    noise=st.sampled_from([0.0, 1e-6, 1e-2, 1.0]),
    zeros=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_backends_agree_with_each_other_and_the_definitions(n, dtype, scale, noise, zeros, seed):
    rng = np.random.default_rng(seed)
    y = (rng.standard_normal(n) * scale).astype(dtype)
    if zeros and n:
        y[rng.integers(0, n, size=max(1, n // 7))] = 0  # max_rel's eps floor
    x = (y + noise * scale * rng.standard_normal(n)).astype(dtype)
    rtol, atol = (1.3e-6, 1e-5) if dtype == np.float32 else (1e-7, 1e-7)
    fused = kernels.pair_sums(x, y, rtol=rtol, atol=atol, backend="numba", min_numba=0)
    chunked = kernels.pair_sums(x, y, rtol=rtol, atol=atol, backend="numpy")
    ref = oracle(x, y, rtol, atol)
    for s in (fused, chunked):
        assert s.n == n
        for name in ("sxx", "syy", "sdd", "sabs"):  # float64 throughout: only the order differs
            assert getattr(s, name) == pytest.approx(ref[name], rel=1e-12, abs=1e-300), name
        # the elementwise parts are the definitions' own float64 operations: identical
        assert (s.max_abs, s.max_rel, s.mismatch) == (ref["max_abs"], ref["max_rel"], ref["mismatch"])


def test_pair_sums_rejects_mismatched_arrays_and_backends():
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="1-D arrays of one dtype"):
        kernels.pair_sums(a, a.astype(np.float64), rtol=0, atol=0)
    with pytest.raises(ValueError, match="backend='cuda'"):
        kernels.pair_sums(a, a, rtol=0, atol=0, backend="cuda")


def test_kernel_choice_from_the_environment(monkeypatch):
    monkeypatch.setenv("TDINSPECT_KERNEL", "numpy")
    assert kernels.default_backend() == "numpy"
    monkeypatch.setenv("TDINSPECT_KERNEL", "numba")
    assert kernels.default_backend() == "numba"
    monkeypatch.setenv("TDINSPECT_KERNEL", "fortran")
    with pytest.raises(ValueError, match="TDINSPECT_KERNEL='fortran'"):
        kernels.default_backend()


@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16)],
)
def test_compare_tensors_same_metrics_on_either_backend(monkeypatch, dtypes):
    big = kernels.NUMBA_MIN_BYTES * 3 + 5  # past the numba threshold, with a tail
    g = torch.Generator().manual_seed(0)
    y = torch.randn(big, generator=g).to(dtypes[1])
    x = (y.float() + 1e-2 * torch.randn(big, generator=g)).to(dtypes[0])
    results = {}
    for backend in ("numba", "numpy"):
        monkeypatch.setattr(kernels, "_BACKEND", backend)
        results[backend] = compare_tensors(x, y, chunk=1 << 17)
    a, b = results["numba"], results["numpy"]
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-5, nan_ok=True), k
    assert a["mismatch"] == b["mismatch"] and a["max_rel"] == b["max_rel"]


def test_diff_of_big_tensors_on_dask_threads_matches_the_numpy_backend(tmp_path, monkeypatch):
    """Pass pairs compared on several threads at once through the GIL-free kernel."""
    g = torch.Generator().manual_seed(1)
    n = kernels.NUMBA_MIN_BYTES * 2
    passes = [{f"model.layers.{i}.out": torch.randn(n, generator=g) for i in range(3)} for _ in range(4)]
    write_dump(tmp_path / "a", passes)
    other = [
        {
            k: v + (1e-3 * torch.randn(n, generator=g) if p == 2 and k.endswith("1.out") else 0)
            for k, v in entries.items()
        }
        for p, entries in enumerate(passes)
    ]
    write_dump(tmp_path / "b", other)
    tables = {}
    for backend in ("numba", "numpy"):
        monkeypatch.setattr(kernels, "_BACKEND", backend)
        diff = DumpSet.open(tmp_path / "a").diff(tmp_path / "b", passes_in_flight=4)
        tables[backend] = diff.table(progress=False).set_index("key_b")
        div = diff.first_divergence(threshold=0.0, metric="max_abs")
        assert (div.op, div.pass_) == ("model.layers.1.out", 2)
    fused, chunked = tables["numba"], tables["numpy"]
    assert (fused["equal"] == chunked["equal"]).all() and fused["equal"].sum() == 11
    for col in ("rel_diff", "max_abs", "max_rel", "mismatch", "cosine"):
        np.testing.assert_allclose(fused[col].to_numpy(float), chunked[col].to_numpy(float), rtol=1e-6)


def test_pair_sums_add_up_over_chunks():
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal(1000), rng.standard_normal(1000)
    whole = kernels.pair_sums(x, y, rtol=1e-3, atol=1e-3, backend="numpy")
    parts = kernels.pair_sums(x[:300], y[:300], rtol=1e-3, atol=1e-3) + kernels.pair_sums(
        x[300:], y[300:], rtol=1e-3, atol=1e-3
    )
    for f in dataclasses.fields(whole):
        assert getattr(parts, f.name) == pytest.approx(getattr(whole, f.name), rel=1e-12), f.name


def test_kernel_compiles_without_a_writable_cache(monkeypatch):
    """A read-only install with no writable home: numba cannot cache, the kernel still runs."""
    numba = pytest.importorskip("numba")
    caching = pytest.importorskip("numba.core.caching")
    impl = getattr(caching, "CacheImpl", None)
    if impl is None or not hasattr(impl, "_locator_classes"):
        pytest.skip("numba's cache locators moved")
    monkeypatch.setattr(impl, "_locator_classes", [])

    def identity(v):
        return v

    with pytest.raises(RuntimeError, match="no locator"):  # what cache=True does then
        numba.njit(cache=True)(identity)
    kernel = kernels._define_numba_kernels()["value"]
    x = np.arange(32.0)
    assert kernel(x, x - 1, 0.0, 0.5, kernels.EPS, None)[-1] == 32  # every |d| = 1 > atol


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_nan_and_inf_are_found_and_masked_in_big_tensors(monkeypatch, backend):
    """One read for finite tensors; a NaN/Inf shows in the sums and sends the pair to masking."""
    monkeypatch.setattr(kernels, "_BACKEND", backend)
    n = kernels.NUMBA_MIN_BYTES * 2 + 3
    g = torch.Generator().manual_seed(2)
    y = torch.randn(n, generator=g)
    x = y + 1e-3 * torch.randn(n, generator=g)
    y[10], x[10] = float("nan"), float("nan")  # NaN on both sides: agreed, not a mismatch
    x[20] = float("inf")  # Inf against a number
    y[30] = -float("inf")  # the other way round
    x[40], y[40] = float("inf"), float("inf")  # the same Inf on both: agreed
    got = compare_tensors(x, y)
    assert got["nonfinite_mismatch"] == 2
    keep = torch.isfinite(x) & torch.isfinite(y)
    want = compare_tensors(x[keep], y[keep])
    for k in ("rel_diff", "max_abs", "mean_abs", "max_rel", "cosine", "sqnr_db", "mismatch"):
        assert math.isfinite(got[k]) and got[k] == pytest.approx(want[k], rel=1e-9), k


NARROW = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
# decoded by the table in the compiled loop (the others by bit arithmetic)
TABLED = [getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)]
BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.int32, 8: torch.int64}
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float8_e5m2: 2, torch.float32: 23, torch.float64: 52}


def _nan_with_payload(dtype: torch.dtype, rng: np.random.Generator) -> int:
    """The bits of a NaN of ``dtype``: random sign and payload (e4m3fn has one NaN a sign)."""
    if dtype == torch.float8_e4m3fn:
        return int(rng.choice([0x7F, 0xFF]))
    size = dtype.itemsize * 8
    man = MANTISSA[dtype]
    sign = int(rng.integers(0, 2)) << (size - 1)
    exponent = ((1 << (size - 1 - man)) - 1) << man
    return sign | exponent | int(rng.integers(1, 1 << man))


def _put_bits(t: torch.Tensor, i: int, bits: int) -> None:
    view = t.view(BITS[t.element_size()])
    if view.dtype == torch.uint8 or view.dtype == torch.uint16:
        view[i] = bits
    else:  # signed views of 32/64-bit floats
        view[i] = bits - (1 << (8 * t.element_size())) if bits >> (8 * t.element_size() - 1) else bits


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 2000),
    dtype=st.sampled_from([torch.float32, torch.float64, *NARROW, *TABLED]),
    scale=st.sampled_from([1e-3, 1.0, 1e2]),
    noise=st.sampled_from([0.0, 1e-2, 1.0]),
    specials=st.booleans(),
    nonfinite=st.sampled_from(["", "x", "y", "xy"]),
    seed=st.integers(0, 2**16),
)
def test_every_dtype_decoded_in_the_loop_agrees_with_the_definitions(
    n, dtype, scale, noise, specials, nonfinite, seed
):
    """float32/float64 as values, narrow floats as raw bits decoded inside both backends: the
    same sums as the float64 definitions of torch's own decoding, subnormals and signed zeros
    included; a NaN (any payload) or Inf on a side makes that side's sum of squares non-finite."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    fi = torch.finfo(dtype)
    big = min(fi.max / 2, 1e30)  # no overflow to NaN (the fnuz formats)
    y = (torch.randn(n, generator=g, dtype=torch.float64) * scale).clamp(-big, big).to(dtype)
    x = y.double() + noise * scale * torch.randn(n, generator=g, dtype=torch.float64)
    x = x.clamp(-big, big).to(dtype)
    if specials and n:  # subnormals, zeros of both signs and the format's extremes
        tiny = fi.smallest_normal * fi.eps * 2  # a subnormal (e4m3fnuz/e5m2fnuz too)
        y[0], x[min(1, n - 1)] = tiny if tiny > 0 else fi.tiny, -tiny
        x[n // 2], y[n // 3] = -0.0, 0.0
        if dtype != torch.float64:  # float64's extremes overflow the definitions themselves
            y[n - 1], x[n - 1] = fi.max, fi.min
    narrow = dtype.itemsize <= 2
    bits = BITS[dtype.itemsize]
    xb = x.view(bits).numpy() if narrow else x.numpy()
    yb = y.view(bits).numpy() if narrow else y.numpy()
    codes = str(dtype).removeprefix("torch.") if narrow else None
    rtol, atol = 1.6e-2, 1e-5
    ref = oracle(x.double().numpy(), y.double().numpy(), rtol, atol)  # torch's own decoding
    for backend in ("numba", "numpy"):
        s = kernels.pair_sums(xb, yb, rtol=rtol, atol=atol, backend=backend, min_numba=0, codes=codes)
        assert s.n == n
        for name in ("sxx", "syy", "sdd", "sabs"):
            assert getattr(s, name) == pytest.approx(ref[name], rel=1e-12, abs=1e-300), name
        assert (s.max_abs, s.max_rel, s.mismatch) == (ref["max_abs"], ref["max_rel"], ref["mismatch"])
    if not (nonfinite and n):
        return
    for side, t in (("x", x), ("y", y)):  # a NaN with a payload, or an Inf where there is one
        if side in nonfinite:
            at = int(rng.integers(0, n))
            if dtype in (torch.float8_e4m3fn, *TABLED) or rng.integers(0, 2):
                _put_bits(t, at, _nan_with_payload(dtype, rng) if dtype not in TABLED else 0x80)
            else:
                t[at] = float("inf") * (1 if rng.integers(0, 2) else -1)
    x_finite, y_finite = (bool(torch.isfinite(t.double()).all()) for t in (x, y))
    assert not (x_finite and y_finite)
    xb = x.view(bits).numpy() if narrow else x.numpy()
    yb = y.view(bits).numpy() if narrow else y.numpy()
    for backend in ("numba", "numpy"):
        s = kernels.pair_sums(xb, yb, rtol=rtol, atol=atol, backend=backend, min_numba=0, codes=codes)
        assert (math.isfinite(s.sxx), math.isfinite(s.syy)) == (x_finite, y_finite), backend


def _decoded_one_by_one(kernel, codes: np.ndarray, n: int = 16, first: int = 0) -> np.ndarray:
    """Each code's value as a compiled kernel decodes it, read back from the sums of k copies
    at every other element from ``first`` (zeros between) against k copies of its absolute
    value: Σx² = k·v² (magnitude), Σ(x-y)² = 4k·v² for a negative v and 0 for a positive
    one (sign). 16 elements take the loop's tail, a block its vectorised body (bfloat16 two
    elements a 32-bit word: ``first`` 0 and 1 decode each half)."""
    out = np.empty(codes.shape[0])
    top = codes.dtype.type(1 << (8 * codes.dtype.itemsize - 1))
    x, y = np.zeros(n, codes.dtype), np.zeros(n, codes.dtype)
    k = x[first::2].shape[0]
    for i, c in enumerate(codes):
        x[first::2], y[first::2] = c, c & ~top
        sxx, _, sdd = kernel(x, y, 0.0, 0.0, 1e-12, None)[:3]
        v = math.sqrt(sxx / k)
        out[i] = -v if sdd > 0 else v  # -inf - inf = -inf; inf - inf = NaN
    return out


@pytest.mark.parametrize("dtype", NARROW)
def test_every_bit_pattern_decodes_as_torch_reads_it(dtype):
    """Exhaustive: every code of every narrow float, through the compiled bit arithmetic (float16
    and e5m2 both ways: by the CPU's conversion where it has one, and portably) and through the
    numpy fallback's chunk decoder, against torch's own conversion to float64."""
    from tdinspect.numerics import fused_loop

    bits = BITS[dtype.itemsize]
    codes = torch.arange(1 << (8 * dtype.itemsize), dtype=torch.int32).to(bits)
    want = codes.view(dtype).double().numpy()
    codes = codes.numpy()
    name = str(dtype).removeprefix("torch.")
    decoders = {False: fused_loop.compile_kernels(cache=False, f16c=False)[name]}
    if dtype in (torch.float16, torch.float8_e5m2) and fused_loop.has_f16c():
        decoders[True] = fused_loop.compile_kernels(cache=False, f16c=True)[name]
    places = ((16, 0), (fused_loop.BLOCK, 0), (fused_loop.BLOCK, 1))  # tail, body's halves
    for (f16c, kernel), (n, first) in itertools.product(decoders.items(), places):
        got = _decoded_one_by_one(kernel, codes, n, first)
        nan = np.isnan(want)
        assert (np.isnan(got) == nan).all(), (f16c, n, first)
        # values and infinities exactly (zero's sign does not reach any sum)
        wrong = codes[~nan][got[~nan] != want[~nan]][:5]
        assert (got[~nan] == want[~nan]).all(), (f16c, n, first, wrong)
    chunk = np.empty(codes.shape[0])
    with np.errstate(invalid="ignore"):  # signalling NaNs quieted by the cast
        kernels._numpy_decoder(name)(codes, chunk, np.empty(codes.shape[0], np.uint32))
    np.testing.assert_array_equal(chunk, want)  # bitwise: NaN where NaN, -0.0 where -0.0
    assert (np.signbit(chunk) == np.signbit(want)).all()


def test_float16_by_the_cpu_only_for_the_host_cpu(monkeypatch):
    """A portable build (NUMBA_CPU_NAME) decodes float16 by bit arithmetic: LLVM turned the
    half conversion for a 'generic' CPU into a helper call that crashed the process."""
    from numba.core import config

    from tdinspect.numerics import fused_loop

    monkeypatch.setattr(config, "CPU_NAME", "generic")
    assert not fused_loop.has_f16c()
    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(config, "CPU_FEATURES", "+sse2,-f16c")
    assert not fused_loop.has_f16c()
    monkeypatch.setattr(config, "CPU_FEATURES", "+sse2,+f16c")
    assert fused_loop.has_f16c()


@pytest.mark.parametrize("dtype", NARROW)
def test_compare_tensors_decodes_narrow_floats_without_a_float32_copy(monkeypatch, dtype):
    """The same metrics as through a float32 conversion, and the pair reaches the kernel as
    its raw bits (the table path), NaN masking included."""
    n = kernels.NUMBA_MIN_BYTES + 7
    g = torch.Generator().manual_seed(4)
    y = torch.randn(n, generator=g).to(dtype)
    x = (y.float() + 1e-2 * torch.randn(n, generator=g)).to(dtype)
    x[3] = float("nan")  # e4m3fn has no Inf; NaN everywhere
    seen = []
    real = kernels.pair_sums

    def spy(a, b, **kw):
        seen.append((a.dtype, kw.get("codes") == str(dtype).removeprefix("torch.")))
        return real(a, b, **kw)

    monkeypatch.setattr("tdinspect.numerics.metrics.pair_sums", spy)
    got = compare_tensors(x, y)
    assert seen and all(dt.kind == "u" and coded for dt, coded in seen)
    monkeypatch.setattr("tdinspect.numerics.metrics._CODED", {})  # the float32 conversion it replaced
    want = compare_tensors(x, y)
    assert got["nonfinite_mismatch"] == want["nonfinite_mismatch"] == 1
    for k in ("rel_diff", "max_abs", "mean_abs", "max_rel", "cosine", "sqnr_db", "mismatch"):
        assert got[k] == pytest.approx(want[k], rel=1e-12), k


def test_codes_must_fit_the_arrays():
    with pytest.raises(ValueError, match="codes='float8_e5m2' needs uint8 arrays"):
        kernels.pair_sums(np.zeros(4, np.uint16), np.zeros(4, np.uint16), rtol=0, atol=0, codes="float8_e5m2")
    with pytest.raises(ValueError, match="codes='float32': expected a 1- or 2-byte torch float"):
        kernels.pair_sums(np.zeros(4, np.uint32), np.zeros(4, np.uint32), rtol=0, atol=0, codes="float32")
    with pytest.raises(ValueError, match="codes='bogus'"):
        kernels.pair_sums(np.zeros(4, np.uint8), np.zeros(4, np.uint8), rtol=0, atol=0, codes="bogus")


def _max_rel_cases() -> dict:
    """Pairs that a looser max_rel filter (see ``fused_loop._loop``) would get wrong."""
    from tdinspect.numerics.fused_loop import BLOCK

    n = 3 * BLOCK + 5
    edge_x, edge_y = np.zeros(n), np.zeros(n)
    # lane 0, block 0: |x-y|/|y| = 3.928458807474303 exactly; lane 0, block 1: y = 0 (the eps
    # floor) and |x-y| = fl(that ratio · eps), rounded up, whose quotient is one ulp larger.
    # An unfused filter ``ad > fl(r·m)`` skips it (equal), a division does not.
    edge_x[0], edge_y[0] = 0.3660573509342879, -0.125
    edge_x[BLOCK] = 3.928458807474303e-12
    rng = np.random.default_rng(7)
    rising_y = np.ones(n)  # every element raises its lane's maximum: every block divided
    rising_x = 1 + np.linspace(1e-6, 1.0, n)
    ties_y = rng.choice([1.0, 3.0, 0.1, 1e-13, 0.0], n)  # quotients one ulp apart, and eps
    ties_x = ties_y * (1 + 1e-3 * (1 + rng.integers(0, 4, n) * 2.0**-50)) + (ties_y == 0) * 1e-9
    tiny_y = rng.standard_normal(n) * 1e-300  # ratios below 2^-1020/eps: filter threshold 0
    tiny_x = tiny_y + rng.standard_normal(n) * 1e-302
    return {
        "edge": (edge_x, edge_y),
        "rising": (rising_x, rising_y),
        "ties": (ties_x, ties_y),
        "tiny": (tiny_x, tiny_y),
        "ties_f32": (ties_x.astype(np.float32), ties_y.astype(np.float32)),
    }


def test_max_rel_divides_only_where_a_quotient_may_win_and_stays_exact():
    """max_rel is found without a division per element; it must still be exactly the largest
    of every element's float64 quotient (cases built so that a filter without its margin
    would miss one), as must max_abs and the mismatch count."""
    for name, (x, y) in _max_rel_cases().items():
        s = kernels.pair_sums(x, y, rtol=1e-3, atol=1e-12, backend="numba", min_numba=0)
        ref = oracle(x, y, 1e-3, 1e-12)
        assert (s.max_abs, s.max_rel, s.mismatch) == (ref["max_abs"], ref["max_rel"], ref["mismatch"]), name
    edge = _max_rel_cases()["edge"]
    assert oracle(*edge, 0, 0)["max_rel"] == 3.9284588074743034 > 3.928458807474303  # the case bites


def _word_halves_case() -> tuple[np.ndarray, np.ndarray, list[int]]:
    """float32 values, exact in bfloat16, whose largest quotient moves from one half of a
    bfloat16 word to the other and back, block after block (one lane passes the filter each
    time: both elements of its words divided one at a time); and the ends of prefixes each
    of whose largest quotient is a later one of these."""
    from tdinspect.numerics.fused_loop import BLOCK

    n = 12 * BLOCK + 37
    x, y = np.ones(n, np.float32), np.ones(n, np.float32)  # quotient 0: no lane passes
    ends = []

    def put(block, at, xv, yv=1.0):
        x[block * BLOCK + at], y[block * BLOCK + at] = xv, yv
        ends.append((block + 1) * BLOCK + 5)

    # each quotient at most 1.34 times the one before: a filter off by a factor 1.34 misses
    put(0, 3, 1 + 2.0**-6)  # 0.0156, a word's second element
    put(2, 11, 1.5 + 2.0**-5, 1.5)  # 0.0208, second
    put(3, 18, 1 + 3 * 2.0**-7)  # 0.0234, first
    put(6, 40, 1.5 + 5 * 2.0**-7, 1.5)  # 0.0260, first
    put(10, 77, 1 + 4 * 2.0**-7)  # 0.0312, second
    put(11, 100, 1.5 + 8 * 2.0**-7, 1.5)  # 0.0417, first
    return x, y, ends


def test_bfloat16_read_a_word_at_a_time_keeps_max_rel_exact():
    """bfloat16 is read two elements a 32-bit word, a lane holding neighbours: each planted
    quotient, the largest of its prefix, must be found in either half of a word (bit for bit
    a division per element); a strided pair gives what its contiguous copy does."""
    x, y, ends = _word_halves_case()
    xb, yb = (torch.from_numpy(t).to(torch.bfloat16) for t in (x, y))
    assert (xb.float().numpy() == x).all() and (yb.float().numpy() == y).all()
    xb, yb = xb.view(torch.uint16).numpy(), yb.view(torch.uint16).numpy()
    found = []
    for end in [*ends, x.shape[0]]:
        ref = oracle(x[:end], y[:end], 1e-3, 1e-12)
        found.append(ref["max_rel"])
        for codes, a, b in ((None, x, y), ("bfloat16", xb, yb)):
            s = kernels.pair_sums(
                a[:end], b[:end], rtol=1e-3, atol=1e-12, backend="numba", min_numba=0, codes=codes
            )
            want = (ref["max_abs"], ref["max_rel"], ref["mismatch"])
            assert (s.max_abs, s.max_rel, s.mismatch) == want, (codes, end)
    assert found[:-1] == sorted(set(found[:-1])) and found[-1] == found[-2] == 8 * 2.0**-7 / 1.5
    for first in (0, 1):  # every other element: the words' first halves, then their second
        ref = oracle(x[first::2], y[first::2], 1e-3, 1e-12)
        s = kernels.pair_sums(
            xb[first::2], yb[first::2], rtol=1e-3, atol=1e-12, backend="numba", min_numba=0, codes="bfloat16"
        )
        assert (s.max_abs, s.max_rel, s.mismatch) == (ref["max_abs"], ref["max_rel"], ref["mismatch"])
        assert ref["mismatch"] == 3


def test_max_rel_filter_exact_without_fused_multiply_add(tmp_path):
    """For a CPU without FMA (``NUMBA_CPU_NAME=generic``) the filter's product is rounded:
    its margin must still keep every winning quotient (a fresh process, compiled for it;
    float16 there decoded by bit arithmetic)."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, numpy as np, torch; from tdinspect.numerics import fused_loop, kernels; "
        "from tests.test_kernels import _word_halves_case, _max_rel_cases; "
        "ks = fused_loop.compile_kernels(cache=False); k = ks['value']; "
        "got = {n: [float(v) for v in k(x, y, 1e-3, 1e-12, kernels.EPS, None)[4:]] "
        "for n, (x, y) in _max_rel_cases().items() if x.dtype == np.float64}; "
        "b = [torch.from_numpy(t).to(torch.bfloat16).view(torch.uint16).numpy() "
        "for t in _word_halves_case()[:2]]; "
        "got['bfloat16'] = [float(v) for v in ks['bfloat16'](*b, 1e-3, 1e-12, kernels.EPS, None)[4:]]; "
        "from tests.test_kernels import _float16_rounding_case; "
        "h = [torch.from_numpy(t).half().view(torch.uint16).numpy() for t in _float16_rounding_case()]; "
        "got['float16'] = [float(v) for v in ks['float16'](*h, 1e-3, 1e-12, kernels.EPS, None)[4:]]; "
        "print(json.dumps(got))"
    )
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    for name, (x, y) in _max_rel_cases().items():
        if x.dtype == np.float64:
            ref = oracle(x, y, 1e-3, 1e-12)
            assert got[name] == [ref["max_abs"], ref["max_rel"], ref["mismatch"]], name
    ref = oracle(*_word_halves_case()[:2], 1e-3, 1e-12)  # bfloat16 words, portably
    assert got["bfloat16"] == [ref["max_abs"], ref["max_rel"], ref["mismatch"]]
    ref = oracle(*_float16_rounding_case(), 1e-3, 1e-12)  # float16, unfused
    assert got["float16"] == [ref["max_abs"], ref["max_rel"], ref["mismatch"]]


HALF_CODES = ["float16", "float8_e5m2"]  # decoded by the CPU (F16C) or by bit arithmetic


def _half_codes(values: np.ndarray, codes: str) -> np.ndarray:
    t = torch.from_numpy(np.asarray(values, np.float64)).to(getattr(torch, codes))
    assert (t.double().numpy() == values).all(), "not exact in the format"
    return t.view(BITS[t.element_size()]).numpy()


@functools.cache
def _kernels_decoding(f16c: bool) -> dict:
    """The kernels, float16 decoded by the CPU (``f16c``) or by bit arithmetic; each compiled
    on its first call, once per test session."""
    from tdinspect.numerics import fused_loop

    return fused_loop.compile_kernels(cache=False, f16c=f16c)


def _check_half(
    xv: np.ndarray, yv: np.ndarray, codes: str, rtol: float, atol: float, eps: float = kernels.EPS
) -> None:
    """The compiled loop (each way this CPU decodes float16) against the float64 definitions,
    exact."""
    from tdinspect.numerics import fused_loop

    x, y = _half_codes(xv, codes), _half_codes(yv, codes)
    ref = oracle(xv, yv, rtol, atol, eps)
    want = (ref["max_abs"], ref["max_rel"], ref["mismatch"])
    for f16c in [False, True] if fused_loop.has_f16c() else [False]:
        k = _kernels_decoding(f16c)[codes]
        got = k(x, y, float(rtol), float(atol), eps, None)
        assert (float(got[4]), float(got[5]), int(got[6])) == want, (codes, f16c, rtol, atol, eps)


@pytest.mark.parametrize("codes", HALF_CODES)
@pytest.mark.parametrize(
    "rtol, atol",
    [  # (rtol·|y|, atol) in units of the planted |x - y|
        (0.0, 1 - 2.0**-27),  # |x-y| a hair above the threshold: a mismatch
        (0.0, 1 + 2.0**-27),  # a hair below: none
        (0.0, 1.0),  # a tie: none
        (1 - 2.0**-40, 0.0),
        (1 + 2.0**-40, 0.0),
        (1.0, 0.0),
        (1e-3, 1e-5),
        (0.0, 0.0),
        (1e-120, 0.0),
        (0.0, 1e-300),
        (-1e-3, 0.2),
        (2.0**105, 0.0),
    ],
)
def test_half_codes_count_mismatches_exactly_at_the_threshold(codes, rtol, atol):
    """float16 and e5m2 mismatches counted as float64's definition counts them, at the
    threshold (a hair above, below, ties, through atol and through rtol) and with tolerances
    far from 1: |x - y| = u (0.125 in float16, 0.5 in e5m2) for many of 5 blocks' elements,
    |y| = 2."""
    from tdinspect.numerics.fused_loop import BLOCK

    n = 5 * BLOCK + 17
    u = 0.125 if codes == "float16" else 0.5
    rng = np.random.default_rng(3)
    yv = np.where(rng.random(n) < 0.5, 2.0, -2.0)
    step = rng.choice([0.0, u, -u, 2 * u], n)
    _check_half(yv + step, yv, codes, rtol * u / 2, atol * u)


def _float16_rounding_case() -> tuple[np.ndarray, np.ndarray]:
    """float16 values whose quotients 2^29 - 1 (block 0) and 2^29 + 1 (block 1) are close
    (|x - y| = 32768 - 2^-14 and 32768 + 2^-14): a filter too loose or too tight misses one."""
    from tdinspect.numerics.fused_loop import BLOCK

    xv, yv = np.zeros(3 * BLOCK + 5), np.zeros(3 * BLOCK + 5)
    xv[0], yv[0] = 32768.0, 2.0**-14
    xv[BLOCK + 9], yv[BLOCK + 9] = 32768.0, -(2.0**-14)
    return xv, yv


@pytest.mark.parametrize("codes", HALF_CODES)
def test_half_codes_keep_max_rel_exact(codes):
    """max_rel of float16 and e5m2 as the definition's: quotients 2^29 - 1 (block 0) and
    2^29 + 1 (block 1), then random pairs over the format's whole range (subnormals, its
    largest values), both decoders."""
    from tdinspect.numerics.fused_loop import BLOCK

    if codes == "float16":
        xv, yv = _float16_rounding_case()
        assert oracle(xv, yv, 0, 0)["max_rel"] == 2.0**29 + 1
        _check_half(xv, yv, codes, 1e-3, 1e-5)
    g = torch.Generator().manual_seed(11)
    dtype = getattr(torch, codes)
    bits = BITS[dtype.itemsize]
    codes_x = torch.randint(0, 1 << (8 * dtype.itemsize), (6 * BLOCK,), generator=g)
    codes_y = torch.randint(0, 1 << (8 * dtype.itemsize), (6 * BLOCK,), generator=g)
    xv, yv = (c.to(torch.int32).to(bits).view(dtype).double().numpy() for c in (codes_x, codes_y))
    keep = np.isfinite(xv) & np.isfinite(yv)
    near = yv.copy()  # half the pairs close: quotients near the running maximum
    near[::2] = xv[::2]
    for rtol, atol in ((1e-3, 1e-5), (2.0**-3, 0.0)):
        _check_half(xv[keep], yv[keep], codes, rtol, atol)
        _check_half(xv[keep], near[keep], codes, rtol, atol)


def test_a_numba_that_fails_to_load_leaves_numpy_serving(monkeypatch):
    """Where numba is installed but does not load, the metrics go on with numpy's kernels (the
    same numbers) and say so once, as the statistics do (tdinspect.numerics.lazy_numba)."""
    import sys
    import warnings

    import tdinspect.numerics
    from tdinspect.numerics import lazy_numba

    x = np.random.default_rng(0).standard_normal(kernels.NUMBA_MIN_BYTES)  # 8x past the threshold
    y = x + 1e-3
    want = kernels.pair_sums(x, y, rtol=1e-3, atol=1e-5, backend="numpy")
    monkeypatch.setattr(lazy_numba, "_loaded", {})  # as in a fresh process
    monkeypatch.setattr(kernels, "_NUMBA_KERNELS", None)
    monkeypatch.delattr(tdinspect.numerics, "fused_loop", raising=False)
    monkeypatch.setitem(sys.modules, "tdinspect.numerics.fused_loop", None)  # importing it fails
    with pytest.warns(RuntimeWarning, match="numba failed to load.*numpy's kernels"):
        assert kernels.pair_sums(x, y, rtol=1e-3, atol=1e-5, backend="numba") == want
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert kernels.pair_sums(x, y, rtol=1e-3, atol=1e-5, backend="numba") == want
