"""Right numbers at every magnitude: statistics and metrics against independent exact references.

The references here use Python's exact rationals (``fractions.Fraction``) and ``math.fsum``,
never torch reductions; the bounds are those stated in docs/reliability.md, "Numbers".
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tdinspect.numerics import onepass
from tdinspect.numerics.stats import STAT_NAMES, capture_stats, stats_to_dict, tensor_stats

EPS = 2.0**-52
BOUND = 64 * EPS  # statistics: see reference_stats
# statistics recorded at capture (float32 sums of CPU floats up to 32 bits): GUIDE section 11
CAPTURE_BOUND = 1e-6


def _values(t: torch.Tensor) -> list:
    """The exact values a statistic describes (complex: magnitudes, via math.hypot)."""
    flat = t.detach().reshape(-1)
    if t.is_complex():
        return [math.hypot(float(z.real), float(z.imag)) for z in flat.tolist()]
    if t.dtype == torch.bool or not t.is_floating_point():
        return [int(v) for v in flat.tolist()]
    return [float(v) for v in flat.double().tolist()]


def reference_stats(t: torch.Tensor) -> dict[str, float]:
    """Statistics computed exactly (rationals), then rounded once."""
    values = _values(t)
    finite = [v for v in values if not isinstance(v, float) or math.isfinite(v)]
    out = {
        "numel": float(len(values)),
        "nan": float(sum(1 for v in values if v != v)),
        "inf": float(sum(1 for v in values if isinstance(v, float) and math.isinf(v))),
    }
    if not finite:
        return {**out, **{k: math.nan for k in ("min", "max", "mean", "std", "absmax", "l2")}}
    exact = [Fraction(v) for v in finite]
    n = len(exact)
    mean = sum(exact) / n
    var = sum((v - mean) ** 2 for v in exact) / n
    sq = sum(v * v for v in exact)
    return {
        **out,
        "min": float(min(exact)),
        "max": float(max(exact)),
        "mean": _float(mean),
        "std": _sqrt(var),
        "absmax": float(max(abs(v) for v in exact)),
        "l2": _sqrt(sq),
        "mean_abs": _float(sum(abs(v) for v in exact) / n),
        "rounded": t.is_complex(),
    }  # magnitudes: hypot is within an ulp, not exact


def _float(q: Fraction) -> float:
    try:
        return float(q)
    except OverflowError:
        return math.inf if q > 0 else -math.inf


def _sqrt(q: Fraction) -> float:
    """sqrt of a non-negative rational, correctly scaled even beyond float range."""
    if q == 0:
        return 0.0
    shift = (q.numerator.bit_length() - q.denominator.bit_length()) // 2 * 2
    scaled = q / Fraction(2) ** shift if shift >= 0 else q * Fraction(2) ** -shift
    try:
        return math.ldexp(math.sqrt(float(scaled)), shift // 2)
    except OverflowError:
        return math.inf


def assert_stats_close(got: dict, ref: dict, what=""):
    """Counts, min, max, absmax exact (complex: within 2 ulps); mean within BOUND·mean(|x|); std within
    BOUND·(std + mean(|x|)); l2 within BOUND·l2 (``got["bound"]`` where the path states its own:
    capture's, :data:`CAPTURE_BOUND`)."""
    bound = got.get("bound", BOUND)
    for k in ("numel", "nan", "inf"):
        assert got[k] == ref[k], (what, k, got[k], ref[k])
    if math.isnan(ref["mean"]):
        assert all(math.isnan(got[k]) for k in ("min", "max", "mean", "std", "absmax", "l2")), what
        return
    for k in ("min", "max", "absmax"):
        ulps = 2 * EPS * abs(ref[k]) if ref.get("rounded") else 0.0
        assert abs(got[k] - ref[k]) <= ulps, (what, k, got[k], ref[k])
    scale = ref["mean_abs"]
    assert abs(got["mean"] - ref["mean"]) <= bound * scale, (what, "mean", got["mean"], ref["mean"])
    assert abs(got["std"] - ref["std"]) <= bound * (ref["std"] + scale), (what, "std", got, ref)
    if math.isinf(ref["l2"]):
        assert got["l2"] == math.inf, what
    else:
        assert abs(got["l2"] - ref["l2"]) <= bound * ref["l2"], (what, "l2", got["l2"], ref["l2"])


def all_paths(t):
    """The CPU paths (torch's reductions; the compiled one-read loop of tdinspect.numerics.onepass,
    forced whatever the size), the sync-free (accelerator) path, and capture's (float32 sums,
    held to :data:`CAPTURE_BOUND`), as dicts."""
    with mock.patch.object(onepass, "MIN_ELEMENTS", 0):
        compiled = stats_to_dict(tensor_stats(t, sync_free=False))
    with mock.patch.dict(os.environ, {"TDINSPECT_ONEPASS": "0"}):
        plain = stats_to_dict(tensor_stats(t, sync_free=False))
    captured = {**stats_to_dict(capture_stats(t)), "bound": CAPTURE_BOUND}
    return [plain, compiled, stats_to_dict(tensor_stats(t, sync_free=True)), captured]


# -- statistics -------------------------------------------------------------------------------


def test_large_float32_tensor_with_large_mean_and_tiny_std():
    """Issue 13: 1e7 float32 elements, mean 1e4, std 1e-3 gave std 738.5 (true 0.00104)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(10_000_000, generator=gen, dtype=torch.float64) * 1e-3 + 1e4).float()
    a = x.double().numpy()
    mean = math.fsum(a) / a.size
    std = math.sqrt(math.fsum(np.square(a - mean)) / a.size)
    l2 = math.sqrt(math.fsum(np.square(a)))
    for got in all_paths(x):
        precise = "bound" not in got  # capture's float32 sums: to CAPTURE_BOUND (of std, not mean)
        assert got["mean"] == pytest.approx(mean, rel=1e-15 if precise else CAPTURE_BOUND, abs=0)
        assert got["std"] == pytest.approx(std, rel=1e-13 if precise else CAPTURE_BOUND, abs=0)
        assert got["l2"] == pytest.approx(l2, rel=1e-14 if precise else CAPTURE_BOUND, abs=0)


def _fsum_stats(a: np.ndarray) -> dict[str, float]:
    """Reference statistics of finite float64 values by math.fsum (for tensors too big for
    rationals: each centred square is rounded once, far below the bounds)."""
    mean = math.fsum(a) / a.size
    return {
        "mean": mean,
        "std": math.sqrt(math.fsum(np.square(a - mean)) / a.size),
        "l2": math.sqrt(math.fsum(np.square(a))),
        "mean_abs": math.fsum(np.abs(a)) / a.size,
        "min": float(a.min()),
        "max": float(a.max()),
        "absmax": float(np.abs(a).max()),
    }


@pytest.mark.parametrize("offset", [0.0, 3e-4, -50.0])  # Σx² - n·mean² and the centred pass
def test_compiled_loop_on_several_blocks_with_nonfinite_elements(offset):
    """The one-read loop (tdinspect.numerics.onepass) over several of its blocks and a tail: the
    bounds hold in both of its ways to get M2, and NaN/Inf elements are counted and left
    out as on the other paths."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3 * (1 << 16) + 5, generator=gen) * 1e-3 + offset
    assert onepass.enabled(x)
    y = x.clone()
    y[[7, 70_000, 150_001]] = torch.tensor([math.nan, math.inf, -math.inf])
    for t, bad in ((x, (0, 0)), (y, (1, 2))):
        a = t.double().numpy()
        ref = {
            **_fsum_stats(a[np.isfinite(a)]),
            "numel": float(t.numel()),
            "nan": float(bad[0]),
            "inf": float(bad[1]),
        }
        for got in all_paths(t):
            assert_stats_close(got, ref, (offset, bad))


def test_a_numba_that_fails_to_load_leaves_torch_serving(monkeypatch):
    """Where numba is present but does not load, the statistics of a tensor the one-read loop
    would take come from torch's float64 reductions and a warning says so once."""
    import sys

    import tdinspect.numerics
    from tdinspect.numerics import lazy_numba

    x = torch.randn(2 * onepass.MIN_ELEMENTS + 5, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(lazy_numba, "_loaded", {})  # as in a fresh process
    monkeypatch.delattr(tdinspect.numerics, "onepass_loops", raising=False)
    monkeypatch.setitem(sys.modules, "tdinspect.numerics.onepass_loops", None)  # importing it fails
    with pytest.warns(RuntimeWarning, match="numba failed to load.*statistics use torch's reductions"):
        assert tensor_stats(x).tolist() == tensor_stats(x, compiled=False).tolist()
    assert not onepass.enabled(x)
    assert tensor_stats(x).tolist() == tensor_stats(x, compiled=False).tolist()


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([3.0e38, 3.1e38, -2.0e38, 3.3e38], torch.float32),  # squares overflow float32
        ([1e300, 1.5e300, -1e-300, 1.7e308], torch.float64),  # squares overflow float64
        ([1e-300, 1.5e-300, -1e-310, 4e-320], torch.float64),  # squares underflow float64
        ([2**62, 2**62 + 1, -(2**62), 5], torch.int64),
        ([65504.0, -65504.0, 6e-8, 1.0], torch.float16),
        ([3e38, 1e-38, -3e38], torch.bfloat16),
    ],
)
def test_extreme_magnitudes(values, dtype):
    t = torch.tensor(values, dtype=dtype)
    for got in all_paths(t):
        assert_stats_close(got, reference_stats(t), (values, dtype))


def test_complex_statistics_are_of_magnitudes_in_float64():
    t = torch.tensor([3e38 + 3e38j, 1 - 1j, 0j], dtype=torch.complex64)
    for got in all_paths(t):
        assert_stats_close(got, reference_stats(t))


def test_strided_and_multi_chunk_tensors(monkeypatch):
    from tdinspect.numerics import stats

    monkeypatch.setattr(stats, "CHUNK", 7)  # many pieces, rows split, every path of _pieces
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, 4, generator=gen) * 1e3 + 1e6
    for t in (base, base.transpose(0, 2), base[:, 1:, ::2], base.permute(1, 2, 0)[2:]):
        got = stats_to_dict(tensor_stats(t, sync_free=False))
        assert_stats_close(got, reference_stats(t), t.shape)


_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


@st.composite
def tensors(draw, allow_nonfinite=True):
    """Random shapes, dtypes and magnitudes (float64 near 1e±300, int64 near 2**62)."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
    n = math.prod(shape)
    seed = draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        centre = draw(st.sampled_from([0, info.max // 2, info.max, info.min]))
        spread = draw(st.sampled_from([1, 100, 2**20]))
        lo, hi = max(info.min, centre - spread), min(info.max, centre + spread)
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)
    real = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
    exp_range = 300 if real == torch.float64 else 30
    scale = 10.0 ** draw(st.integers(-exp_range, exp_range))
    offset = draw(st.sampled_from([0.0, 1.0, 1e4, -1e6])) * scale
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale + offset
    if dtype.is_complex:
        y = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
        return torch.complex(x, y).to(dtype)
    info = torch.finfo(dtype)
    x = x.clamp(-info.max, info.max).to(dtype)
    if allow_nonfinite and n and draw(st.booleans()):
        flat = x.reshape(-1)
        flat[draw(st.integers(0, n - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return x


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=tensors())
def test_statistics_property_against_exact_reference(t):
    ref = reference_stats(t)
    for got in all_paths(t):
        assert_stats_close(got, ref, (t.dtype, list(t.shape)))
    assert list(stats_to_dict(tensor_stats(t))) == list(STAT_NAMES)


# -- metrics ----------------------------------------------------------------------------------
from tdinspect.numerics.metrics import TENSOR_METRICS, compare_tensors, tolerances  # noqa: E402


def _pairs(x: torch.Tensor, y: torch.Tensor) -> list[tuple[Fraction, Fraction]]:
    """Exact element pairs; complex as (real, imag) components, a real side as imag 0."""

    def parts(t):
        flat = t.detach().reshape(-1)
        if t.is_complex():
            return [c for z in flat.tolist() for c in (z.real, z.imag)]
        vals = [v for v in (flat.tolist() if not t.is_floating_point() else flat.double().tolist())]
        return [c for v in vals for c in (v, 0.0)] if (x.is_complex() or y.is_complex()) else vals

    return [(Fraction(a), Fraction(b)) for a, b in zip(parts(x), parts(y))]


def reference_metrics(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The module table's definitions in exact rational arithmetic, rounded once."""
    pairs = _pairs(x, y)
    n = len(pairs)
    sxx = sum(a * a for a, _ in pairs)
    syy = sum(b * b for _, b in pairs)
    sxy = sum(a * b for a, b in pairs)
    d = [abs(a - b) for a, b in pairs]
    sdd = sum(v * v for v in d)
    out = {
        "rel_diff": _float(sdd / (sxx + syy)) if sxx + syy else 0.0,
        "max_abs": _float(max(d, default=Fraction(0))),
        "mean_abs": _float(sum(d) / n) if n else 0.0,
        "max_rel": _float(
            max((v / max(abs(b), Fraction(1e-12)) for v, (_, b) in zip(d, pairs)), default=Fraction(0))
        ),
    }
    if sxx == 0 and syy == 0:
        out["cosine"] = 1.0
    elif sxx == 0 or syy == 0:
        out["cosine"] = 0.0
    else:
        out["cosine"] = _sqrt(sxy * sxy / (sxx * syy)) * (1 if sxy >= 0 else -1)
    out["sqnr_db"] = (
        math.inf
        if sdd == 0
        else (
            10
            * (
                math.log10(syy.numerator)
                - math.log10(syy.denominator)
                - math.log10(sdd.numerator)
                + math.log10(sdd.denominator)
            )
            if syy
            else -math.inf
        )
    )
    rtol, atol = tolerances(x.dtype, y.dtype)
    tol = [Fraction(atol) + Fraction(rtol) * abs(b) for _, b in pairs]
    out["mismatch"] = sum(1 for v, t in zip(d, tol) if v > t) / n if n else 0.0
    out["equal"] = float(x.dtype == y.dtype and _raw(x) == _raw(y))
    return out


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    size = t.element_size()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.view(view).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()


METRIC_BOUNDS = """rel_diff, mean_abs: relative 1e-12; max_abs, max_rel: relative 4·eps; cosine: absolute
1e-12; sqnr_db: absolute 1e-9 dB; mismatch: within one element (ties at the tolerance edge
round either way); equal: exact"""


def assert_metrics_close(got: dict, ref: dict, what=""):
    for k in ("rel_diff", "mean_abs"):
        assert abs(got[k] - ref[k]) <= 1e-12 * abs(ref[k]) or got[k] == ref[k], (what, k, got[k], ref[k])
    for k in ("max_abs", "max_rel"):
        assert abs(got[k] - ref[k]) <= 4 * EPS * abs(ref[k]) or got[k] == ref[k], (what, k, got[k], ref[k])
    assert abs(got["cosine"] - ref["cosine"]) <= 1e-12, (what, "cosine", got["cosine"], ref["cosine"])
    if math.isinf(ref["sqnr_db"]):
        assert got["sqnr_db"] == ref["sqnr_db"], (what, "sqnr_db", got["sqnr_db"])
    else:
        assert abs(got["sqnr_db"] - ref["sqnr_db"]) <= 1e-9, (what, "sqnr_db", got, ref)
    assert got["equal"] == ref["equal"], (what, "equal")


@pytest.mark.parametrize(
    "x, y",
    [
        (torch.tensor([1e200], dtype=torch.float64), torch.tensor([2e200], dtype=torch.float64)),
        (torch.tensor([1e-200], dtype=torch.float64), torch.tensor([2e-200], dtype=torch.float64)),
        (
            torch.tensor([1.7e308, -1e308], dtype=torch.float64),
            torch.tensor([1e308, 1e300], dtype=torch.float64),
        ),
        (torch.tensor([5e-324, 0.0], dtype=torch.float64), torch.tensor([1e-323, 0.0], dtype=torch.float64)),
        (torch.tensor([1e-14]), torch.tensor([-1e-14])),
        (torch.tensor([2**60]), torch.tensor([2**60 + 1])),
        (torch.tensor([2**62, -(2**62)]), torch.tensor([-(2**62), 2**62])),
        (torch.tensor([1e10, 0.0]), torch.tensor([1e-3, 1.0])),
        (torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64), torch.tensor([1.0, 3.0])),
        (torch.tensor([1.0, 3.0]), torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)),
    ],
)
def test_metrics_exact_in_meaning_at_every_magnitude(x, y):
    """Issue 13's cases: 1e200 vs 2e200 gave NaN, 1e-200 vs 2e-200 gave 0, 1e-14 vs -1e-14 cosine 1,
    2**60 vs 2**60+1 max_abs 0, complex vs real raised, [1e10, 0] vs [1e-3, 1] cosine off by 6e-4."""
    got = compare_tensors(x, y)
    ref = reference_metrics(x, y)
    assert_metrics_close(got, ref, (x, y))
    assert all(not math.isnan(got[k]) for k in ("rel_diff", "max_abs", "cosine", "sqnr_db"))


def test_named_cases_have_the_right_values():
    f64 = torch.float64
    assert compare_tensors(torch.tensor([1e200], dtype=f64), torch.tensor([2e200], dtype=f64))[
        "rel_diff"
    ] == pytest.approx(0.2)
    assert compare_tensors(torch.tensor([1e-200], dtype=f64), torch.tensor([2e-200], dtype=f64))[
        "rel_diff"
    ] == pytest.approx(0.2)
    assert compare_tensors(torch.tensor([1e-14]), torch.tensor([-1e-14]))["cosine"] == -1.0
    ints = compare_tensors(torch.tensor([2**60]), torch.tensor([2**60 + 1]))
    assert ints["max_abs"] == 1.0 and ints["equal"] == 0.0 and ints["mismatch"] == 1.0


def test_equal_means_the_same_bits():
    nan = torch.tensor([1.0, float("nan")])
    assert compare_tensors(nan.clone(), nan)["equal"] == 1.0
    m = compare_tensors(torch.tensor([-0.0]), torch.tensor([0.0]))
    assert m["equal"] == 0.0 and m["max_abs"] == 0.0  # numerically equal, not the same bits
    other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert compare_tensors(other_nan, torch.tensor([float("nan")]))["equal"] == 0.0
    assert compare_tensors(torch.ones(2, dtype=torch.bfloat16), torch.ones(2))["equal"] == 0.0


def test_a_metric_that_cannot_be_computed_is_a_divergence(tmp_path, monkeypatch):
    """Never a silent pass: a NaN metric value diverges, with its reason."""
    from tdinspect import DumpSet
    from tdinspect.compare import passes, rule
    from tdinspect.numerics.metrics import metric

    from .test_dumpset_diff import write_dump

    t = torch.arange(6.0)
    a = write_dump(tmp_path / "a", [{"x": t, "y": t * 2}])
    b = write_dump(tmp_path / "b", [{"x": t + 1e-9, "y": t * 2 + 1e-9}])
    real = rule.compare_tensors

    def nan_for_y(x, y, **kw):
        out = real(x, y, **kw)
        if x.shape and float(x.reshape(-1)[-1]) > 9:  # the "y" entry
            out["rel_diff"] = math.nan
        return out

    monkeypatch.setattr(rule, "compare_tensors", nan_for_y)
    # pair by pair (small pairs are otherwise compared in one batch, plain ones straight from
    # the files' bytes: not by compare_tensors)
    monkeypatch.setattr(passes, "small_plain", lambda pi, plain=None: [None] * len(pi.keys))
    monkeypatch.setattr(passes, "plain_dtypes", lambda pi: [None] * len(pi.keys))
    div = DumpSet.open(a).diff(DumpSet.open(b)).first_divergence(threshold=1e-3)
    assert div is not None and div.key == "y" and div.reason == "rel_diff could not be computed"
    assert metric("rel_diff").diverges(math.nan, 1e-3)


def test_huge_float64_dumps_diverge_in_the_cli(tmp_path, capsys):
    from tdinspect.cli import main

    from .test_dumpset_diff import write_dump

    a = write_dump(tmp_path / "a", [{"x": torch.full((4,), 1e200, dtype=torch.float64)}])
    b = write_dump(tmp_path / "b", [{"x": torch.full((4,), 2e200, dtype=torch.float64)}])
    assert main(["first-divergence", str(a), str(b), "--threshold", "1e-3"]) == 1
    assert "rel_diff 0.2" in capsys.readouterr().out


_PAIR_DTYPES = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.int64, torch.int64),
    (torch.int32, torch.int64),
    (torch.complex64, torch.complex64),
    (torch.complex64, torch.float32),
    (torch.float64, torch.complex128),
]


@st.composite
def tensor_pairs(draw):
    """Two finite tensors of one shape: random dtypes, magnitudes (float64 near 1e±300,
    int64 near 2**62) and differences (none, last bits, 1%, unrelated)."""
    dx, dy = draw(st.sampled_from(_PAIR_DTYPES))
    if draw(st.booleans()):
        dx, dy = dy, dx
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    noise = draw(st.sampled_from([0.0, 1e-15, 1e-7, 1e-2, 1.0, 1e6]))
    if not (dx.is_floating_point or dx.is_complex):
        base = draw(st.sampled_from([0, 2**30, 2**62, -(2**62)]))
        hi = torch.iinfo(dx).max // 2
        base = max(-hi, min(hi, base))
        y = base + torch.randint(-1000, 1000, shape, generator=gen)
        x = y + (torch.randint(-3, 4, shape, generator=gen) * (noise > 0)).long()
        return x.to(dx), y.to(dy)
    wide = torch.float64 in (dx, dy) or torch.complex128 in (dx, dy)
    k = draw(st.integers(-300, 300) if wide else st.integers(-30, 30))
    scale = 10.0**k

    def draw_real():
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    y = draw_real()
    x = y * (1 + noise * torch.randn(shape, generator=gen, dtype=torch.float64))
    if dx.is_complex or dy.is_complex:
        yi, xi = draw_real(), draw_real()
        y = torch.complex(y, yi) if dy.is_complex else y
        x = torch.complex(x, xi) if dx.is_complex else x

    def cast(t, dt):
        if dt.is_complex:
            return t.to(dt)
        info = torch.finfo(dt)
        return (
            t.real.clamp(-info.max, info.max).to(dt)
            if t.is_complex()
            else t.clamp(-info.max, info.max).to(dt)
        )

    return cast(x, dx), cast(y, dy)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=tensor_pairs())
def test_metrics_property_against_exact_reference(pair):
    x, y = pair
    got = compare_tensors(x, y)
    ref = reference_metrics(x, y)
    assert_metrics_close(got, ref, (x.dtype, y.dtype, list(x.shape)))
    n = max(1, x.numel() * (2 if (x.is_complex() or y.is_complex()) else 1))
    assert abs(got["mismatch"] - ref["mismatch"]) <= 1 / n
    if x.dtype != y.dtype and x.is_floating_point() and y.is_floating_point():
        narrow = min((x.dtype, y.dtype), key=lambda d: torch.finfo(d).bits)
        cast = reference_metrics(x.to(narrow), y.to(narrow))
        assert (
            abs(got["rel_diff_cast"] - cast["rel_diff"]) <= 1e-12 * cast["rel_diff"]
            or got["rel_diff_cast"] == cast["rel_diff"]
        )
        assert got["max_abs_cast"] == pytest.approx(cast["max_abs"], rel=4 * EPS, abs=0)
    else:
        assert (got["rel_diff_cast"], got["max_abs_cast"]) == (got["rel_diff"], got["max_abs"])
    assert set(TENSOR_METRICS) <= set(got)


# -- every shown column is a metric ------------------------------------------------------------


def test_stats_rel_on_tensor_dumps_compares_statistics(runs, tmp_path, capsys):
    """Issue 13: --metric stats_rel on tensor dumps that clearly differ said no divergence."""
    from tdinspect import DumpSet
    from tdinspect.cli import main

    from .test_dumpset_diff import write_dump

    div = DumpSet.open(runs["ref"]).diff(DumpSet.open(runs["wrong"])).first_divergence(metric="stats_rel")
    assert div is not None and div.key == "model.layers.2.mlp.down" and div.value > 1e-3
    # without sidecars: statistics computed from the tensors
    t = torch.linspace(-1, 1, 50)
    a = write_dump(tmp_path / "a", [{"x": t, "y": t}])
    b = write_dump(tmp_path / "b", [{"x": t, "y": t * 1.5}])
    assert main(["first-divergence", str(a), str(b), "--metric", "stats_rel"]) == 1
    assert "first divergence: y" in capsys.readouterr().out
    assert main(["first-divergence", str(a), str(a), "--metric", "stats_rel"]) == 0


@pytest.mark.parametrize("name", ["rel_diff_cast", "max_abs_cast"])
def test_cast_columns_are_metrics_everywhere(runs, capsys, name):
    from tdinspect import DumpSet
    from tdinspect.cli import main
    from tdinspect.numerics.metrics import METRICS

    m = METRICS[name]
    assert m.higher_is_worse and m.default_threshold == 1e-3
    d = DumpSet.open(runs["ref"]).diff(DumpSet.open(runs["bf16"]))
    div = d.first_divergence(threshold=0.0, metric=name)
    assert div is not None and div.metric == name and div.value > 0
    assert len(d.divergences(threshold=0.0, metric=name, progress=False))
    assert main(["diff", str(runs["ref"]), str(runs["wrong"]), "--metric", name]) == 1
    assert name in capsys.readouterr().out


def test_statistics_of_subnormal_float64_values_are_exact_and_never_raise(tmp_path, capsys):
    """A float64 tensor whose largest value is subnormal (1e-310) asked power_of_two_scale for
    2^1029 (OverflowError): in capture's hook, and in 'tdinspect stats' of a dump without
    sidecars, which named no file."""
    from tdinspect.cli import main
    from tdinspect.numerics.stats import STAT_NAMES, tensor_stats

    t = torch.tensor([1e-310, -3e-310, 0.0], dtype=torch.float64)
    for compiled in (True, False):
        row = dict(zip(STAT_NAMES, tensor_stats(t, compiled=compiled).tolist()))
        assert row["min"] == -3e-310 and row["max"] == 1e-310 and row["absmax"] == 3e-310
    (tmp_path / "d").mkdir()
    torch.save({"model.a": t}, tmp_path / "d" / "pass00000.pt")
    assert main(["stats", str(tmp_path / "d")]) == 0
    assert "model.a" in capsys.readouterr().out
