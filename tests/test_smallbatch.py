"""A pass's small pairs compared in one batch: the same bits as each pair compared alone."""

from __future__ import annotations

import math
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tdinspect import DumpSet
from tdinspect.compare import smallpairs
from tdinspect.numerics import kernels, metrics, metrics_batch
from tdinspect.numerics.metrics import TENSOR_METRICS, compare_tensors
from tdinspect.store.rawpass import layout, read_raw
from tdinspect.store.rawspans import element_starts

from .recorded import capture_llama, record_dump
from .test_rawpass import BAD_LAYOUTS

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def bits(v: float) -> bytes:
    return struct.pack("<d", v)


def same_numbers(got: dict, want: dict) -> None:
    for k in TENSOR_METRICS:
        assert bits(got[k]) == bits(want[k]), (k, got[k], want[k])


def values_of(rng, n: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    """``n`` values of ``dtype``: normal at several magnitudes, with zeros, NaN, Inf, huge
    or tiny magnitudes (float64 squares beyond its range: rescaled), far norms."""
    v = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)
    if kind == "zeros":
        v[rng.random(n) < 0.4] = 0.0
    elif kind == "nonfinite":
        v[rng.integers(0, n)] = rng.choice([math.nan, math.inf, -math.inf])
    elif kind == "huge" and dtype == torch.float64:
        v *= 1e200
    elif kind == "tiny" and dtype == torch.float64:
        v *= 1e-200
    elif kind == "allzero":
        v[:] = 0.0
    return torch.from_numpy(v).to(dtype)


def partner(rng, y: torch.Tensor, how: str) -> torch.Tensor:
    if how == "same":
        return y.clone()
    if how == "lastbits":
        return (y.double() * torch.from_numpy(1 + 1e-7 * rng.standard_normal(y.numel()))).to(y.dtype)
    if how == "far":  # norms orders of magnitude apart: Σxy summed directly
        return (y.double() * 1e-4 + torch.from_numpy(rng.standard_normal(y.numel()))).to(y.dtype)
    if how == "negzero":
        x = y.clone()
        x[y == 0] = -0.0
        return x
    # noise at 1% of the values' own scale (an absolute 1e-2 on values of 1e-3 makes the
    # norms far apart, where Σxy is summed directly and the batch rightly leaves the pair)
    scale = float(y.double().abs().max()) or 1.0
    return (y.double() + 1e-2 * scale * torch.from_numpy(rng.standard_normal(y.numel()))).to(y.dtype)


PAIR = st.tuples(
    st.integers(1, 600),
    st.sampled_from(["normal", "zeros", "nonfinite", "huge", "tiny", "allzero"]),
    st.sampled_from(["same", "lastbits", "far", "negzero", "noise"]),
)


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES), pairs=st.lists(PAIR, min_size=1, max_size=12), seed=st.integers(0, 2**16)
)
def test_a_batch_gives_each_pair_the_bits_it_gets_alone(dtype, pairs, seed):
    rng = np.random.default_rng(seed)
    ys = [values_of(rng, n, dtype, kind) for n, kind, _ in pairs]
    xs = [partner(rng, y, how) for y, (_, _, how) in zip(ys, pairs)]
    np_dtype = metrics_batch.BATCHED[dtype][0]
    flat = [(x.view(torch.uint16) if x.element_size() == 2 else x).numpy() for x in xs]
    ref = [(y.view(torch.uint16) if y.element_size() == 2 else y).numpy() for y in ys]
    starts = np.cumsum([0] + [a.shape[0] for a in flat[:-1]])
    values, settled = metrics_batch.compare_segments(
        np.concatenate(flat).astype(np_dtype), np.concatenate(ref).astype(np_dtype), starts, dtype
    )
    for j, (x, y) in enumerate(zip(xs, ys)):
        alone = compare_tensors(x, y)
        if not settled[j]:  # the caller computes it alone: only where compare_tensors masks
            # NaN/Inf, rescales float64 sums or sums Σxy directly
            _, kind, how = pairs[j]
            assert kind in ("nonfinite", "huge", "tiny") or how == "far", pairs[j]
            continue
        same_numbers({k: float(values[k][j]) for k in TENSOR_METRICS}, alone)
    plain = [
        j
        for j, (_, kind, how) in enumerate(pairs)
        if kind in ("normal", "zeros") and how in ("same", "lastbits", "noise")
    ]
    assert settled[plain].all()  # the usual pairs never fall back


def test_the_single_path_sums_in_the_batch_order():
    """pair_sums of a small pair is segment_sums with one segment, wherever the pair lies."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal(1000), rng.standard_normal(1000)
    alone = kernels.pair_sums(x[300:700], y[300:700], rtol=1e-3, atol=1e-5)
    batch = kernels.segment_sums(x, y, np.array([0, 300, 700]), 1e-3, 1e-5)[:, 1]
    got = [alone.sxx, alone.syy, alone.sdd, alone.sabs, alone.max_abs, alone.max_rel, alone.mismatch]
    assert [bits(v) for v in got] == [bits(v) for v in batch.tolist()]
    # and the sums are the definitions to rounding (pairwise order)
    d = x[300:700] - y[300:700]
    assert alone.sdd == pytest.approx(math.fsum(d * d), rel=1e-14)
    assert alone.sabs == pytest.approx(math.fsum(abs(d)), rel=1e-14)


def _batch(seed: int, codes: str | None):
    """A batch of 64K-odd elements (a pass's group) of random pairs: ``(x, y, starts)``, as
    stored (float32 values, or bfloat16 raw bits)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 40, size=3000)
    y = torch.from_numpy(rng.standard_normal(int(lens.sum())) * (seed + 1))
    x = y + 1e-3 * torch.from_numpy(rng.standard_normal(y.shape[0]))
    if codes == "bfloat16":
        x, y = (v.bfloat16().view(torch.uint16).numpy() for v in (x, y))
    else:
        x, y = x.float().numpy(), y.float().numpy()
    return x, y, np.cumsum(np.r_[0, lens[:-1]]), codes


def test_segment_sums_on_threads_at_once_each_get_their_own_answer():
    """The float64 temporaries are this thread's own: two threads summing other data at
    the same time (other sizes, other dtypes) each get the bits they get alone."""
    batches = [_batch(0, None), _batch(1, "bfloat16")]
    want = [kernels.segment_sums(x, y, s, 1e-3, 1e-5, codes) for x, y, s, codes in batches]
    for (x, y, starts, codes), w in zip(batches, want):  # and those are the definitions
        x64, y64 = (kernels.decoded(v, codes) for v in (x, y))
        d = x64 - y64
        np.testing.assert_allclose(w[2], np.add.reduceat(d * d, starts), rtol=1e-13)
        np.testing.assert_array_equal(w[4], np.maximum.reduceat(np.abs(d), starts))
    barrier = threading.Barrier(2)

    def run(i: int) -> list:
        x, y, st, codes = batches[i]
        got = []
        for _ in range(30):
            barrier.wait()
            got.append(kernels.segment_sums(x, y, st, 1e-3, 1e-5, codes))
        return got

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(2)))
    for w, got in zip(want, results):
        for g in got:
            assert g.tobytes() == w.tobytes()


def test_a_result_is_not_overwritten_by_a_later_call():
    x, y, st, codes = _batch(2, None)
    first = kernels.segment_sums(x, y, st, 1e-3, 1e-5, codes)
    kept = first.copy()
    for seed, codes in ((3, None), (4, "bfloat16")):
        a, b, s, c = _batch(seed, codes)
        kernels.segment_sums(a, b, s, 1e-3, 1e-5, c)
    assert first.tobytes() == kept.tobytes()


def _mixed_passes(seed: int, wrong: bool):
    """Entries of every kind a batch must take or leave: float dtypes, integers, NaN and
    Inf, huge and tiny float64, far norms, identical, empty, non-contiguous, big."""
    g = torch.Generator().manual_seed(0)
    h = torch.Generator().manual_seed(seed)
    passes = []
    for p in range(2):
        e = {}
        for i, dt in enumerate(DTYPES):
            base = torch.randn(3, 5, generator=g)
            e[f"m.f{i}"] = (base + (1e-3 * torch.randn(3, 5, generator=h) if wrong else 0)).to(dt)
        e["m.same"] = torch.randn(8, generator=g)
        e["m.int"] = torch.arange(6) + (1 if wrong and p else 0)
        nan = torch.randn(7, generator=g)
        if wrong:
            nan[2] = math.nan
        e["m.nan"] = nan
        e["m.inf"] = torch.tensor([1.0, math.inf, 2.0]) * (1.5 if wrong else 1.0)
        e["m.huge"] = torch.tensor([1e200, -3e199], dtype=torch.float64) * (2 if wrong else 1)
        e["m.tiny"] = torch.tensor([1e-200, 3e-201], dtype=torch.float64) * (2 if wrong else 1)
        e["m.far"] = torch.tensor([1e10, 0.0]) if not wrong else torch.tensor([1e-3, 1.0])
        e["m.zero"] = torch.zeros(4) if not wrong else torch.tensor([0.0, -0.0, 0.0, 1e-30])
        e["m.empty"] = torch.zeros(0)
        e["m.strided"] = torch.randn(4, 6, generator=g).t()
        e["m.big"] = torch.randn(1 << 15, generator=g) * (1.001 if wrong else 1.0)
        e["m.shape"] = torch.randn(2, 3 if not wrong else 2, generator=g)
        e["m.dtype"] = torch.randn(5, generator=g).to(torch.float16 if wrong else torch.float32)
        passes.append(e)
    return passes


def _tables(a, b, monkeypatch):
    """The diff table batched, and pair by pair (no pair qualifies), with the batch's pair count."""
    seen = []
    real = metrics_batch.compare_segments

    def spy(x, y, starts, dtype):
        seen.append(len(starts))
        return real(x, y, starts, dtype)

    monkeypatch.setattr(smallpairs, "compare_segments", spy)
    batched = DumpSet.open(a).diff(b).table(progress=False)
    with monkeypatch.context() as m:
        m.setattr("tdinspect.compare.passes.small_plain", lambda pi, plain=None: [None] * len(pi.keys))
        m.setattr("tdinspect.compare.passes.plain_dtypes", lambda pi: [None] * len(pi.keys))
        single = DumpSet.open(a).diff(b).table(progress=False)
    return batched, single, sum(seen)


def _assert_bitwise_equal(batched: pd.DataFrame, single: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(batched, single, check_exact=True)
    for col in TENSOR_METRICS:  # and the bits (-0.0, NaN payloads)
        assert batched[col].to_numpy(float).tobytes() == single[col].to_numpy(float).tobytes(), col


def test_rows_of_a_recorded_dump_are_the_pair_by_pair_rows(tmp_path, monkeypatch):
    a = record_dump(tmp_path / "a", _mixed_passes(1, wrong=False))
    b = record_dump(tmp_path / "b", _mixed_passes(2, wrong=True))
    read = []
    real = smallpairs.element_starts
    monkeypatch.setattr(smallpairs, "element_starts", lambda *args: read.append(real(*args)) or read[-1])
    batched, single, count = _tables(a, b, monkeypatch)
    assert read and all(r is not None for r in read)  # the records, straight from the files
    assert count >= 2 * 8  # the float entries and more went through the batch ...
    _assert_bitwise_equal(batched, single)  # ... with the rows compare_pair fills
    with monkeypatch.context() as m:  # the pairs left out read the records the batch checked
        m.setattr("tdinspect.compare.passes._open", lambda pi: pytest.fail("pass file read twice"))
        _assert_bitwise_equal(DumpSet.open(a).diff(b).table(progress=False), single)
    rows = batched.set_index(["pass", "key"])
    assert rows.loc[(0, "m.nan"), "reason"] == "NaN/Inf on one side (1 elements)"
    assert rows.loc[(0, "m.shape"), "structural"] and rows.loc[(0, "m.same"), "equal"] == 1.0
    for key in ("m.huge", "m.tiny"):  # B = 2·A: Σ(x-y)² / (Σx² + Σy²) = 1/5, rescaled
        assert rows.loc[(0, key), "rel_diff"] == pytest.approx(0.2, rel=1e-15)


def test_tiny_model_dumps_diff_the_same_batched(tmp_path, monkeypatch):
    """A tiny HF Llama captured in float32 (reference), with one weight changed, and in
    bfloat16: every row as pair by pair, and the first divergence at the changed weight."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))

    def run(name, change=None, dtype=torch.float32, **live):
        return capture_llama(config, ids, name and tmp_path / name, change, dtype, **live)

    ref, bf16 = run("ref"), run("bf16", dtype=torch.bfloat16)
    norm = "model.layers.1.post_attention_layernorm.weight"
    cases = [
        (ref, run("wrong", norm)),
        (bf16, run("bf16_wrong", norm, torch.bfloat16)),
        (ref, bf16),
    ]  # the last: two dtypes, nothing batched
    for (a, b), batched_at_least in zip(cases, (40, 40, 0)):
        batched, single, count = _tables(a, b, monkeypatch)
        assert count >= batched_at_least
        _assert_bitwise_equal(batched, single)
    div = DumpSet.open(ref).diff(tmp_path / "wrong").first_divergence()
    assert div.key == "model.model.layers.1.post_attention_layernorm"
    # live comparison (one pair at a time, while the model runs) gets the batch's bits
    live = run(None, norm, compare_to=ref, on_divergence="record").set_index(["pass", "key"])
    offline = (
        DumpSet.open(ref)
        .diff(tmp_path / "wrong")
        .table(progress=False)
        .set_index(["pass", "key"])
        .loc[live.index]
    )
    assert len(live) > 40
    for col in TENSOR_METRICS:
        assert live[col].to_numpy(float).tobytes() == offline[col].to_numpy(float).tobytes(), col


@pytest.mark.parametrize("bad", BAD_LAYOUTS)
def test_element_starts_refuses_what_read_raw_refuses(tmp_path, bad):
    path = tmp_path / "pass00000.pt"
    torch.save({"a": torch.arange(4.0)}, path)
    assert read_raw(path, ["a"], [bad]) is None and element_starts(path, ["a"], [bad]) is None
    assert element_starts(path, ["renamed"], layout({"a": torch.arange(4.0)})) is None


def test_element_starts_finds_the_bytes_read_raw_views(tmp_path):
    base = torch.arange(20.0)
    tensors = {
        "a": torch.ones(3, dtype=torch.bfloat16),
        "view": base[5:9],
        "b": torch.zeros(2, 1),
        "base": base,
        "again": base.view(4, 5)[1:, ::2],
        "row": base.view(4, 5)[2:3],
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "pass00000.pt"
    torch.save(tensors, path)
    keys, raw = list(tensors), layout(tensors)
    spans = element_starts(path, keys, raw)
    data, starts, made = spans.data, spans.starts, spans.tensors()
    views = read_raw(path, keys, raw)
    assert list(made) == keys
    for key in keys:  # the tensors made from the spans are read_raw's views
        t, m = views[key], made[key]
        assert (m.dtype, m.shape, m.stride()) == (t.dtype, t.shape, t.stride())
        assert torch.equal(m, t) or (m.dtype == torch.bfloat16 and torch.equal(m.float(), t.float()))
    for key, where in zip(keys, starts):
        t = views[key]
        if key == "again":  # strided: left to read_raw
            assert where is None
            continue
        first, count, dtype = where
        assert (count, dtype) == (t.numel(), str(t.dtype))
        assert (
            bytes(data[first : first + count * t.element_size()])
            == t.contiguous().view(torch.uint8).numpy().tobytes()
        ), key
    before = path.read_bytes()
    made["base"].add_(1)  # copy-on-write: a write never reaches the file
    assert path.read_bytes() == before


def test_a_pass_whose_layout_is_refused_is_batched_from_its_tensors(tmp_path, monkeypatch):
    """A sidecar layout that does not check out: the batch reads the loaded tensors (torch.load)
    and the rows are the same."""
    a = record_dump(tmp_path / "a", _mixed_passes(1, wrong=False))
    b = record_dump(tmp_path / "b", _mixed_passes(2, wrong=True))
    want, _, _ = _tables(a, b, monkeypatch)
    refused = []
    real = smallpairs.element_starts

    def refuse(path, keys, raw, index=None):
        found = real(path, keys, [["0", 10**12, [1], [1], "torch.float32"]] * len(raw), index)
        refused.append(found)
        return found

    monkeypatch.setattr(smallpairs, "element_starts", refuse)
    got, single, count = _tables(a, b, monkeypatch)
    assert refused and all(r is None for r in refused) and count >= 16
    _assert_bitwise_equal(got, want)
    _assert_bitwise_equal(got, single)


def test_dumps_of_another_tool_are_batched_the_same(tmp_path, monkeypatch):
    """No sidecar (a plain torch.save per pass): the tensors the open loaded are batched."""
    from .test_dumpset_diff import write_dump

    passes = [_mixed_passes(1, wrong=False), _mixed_passes(2, wrong=True)]
    a, b = (
        write_dump(tmp_path / n, [{k: v.clone() for k, v in e.items()} for e in p])
        for n, p in zip("ab", passes)
    )
    batched, single, count = _tables(a, b, monkeypatch)
    assert count >= 16
    _assert_bitwise_equal(batched, single)


def test_an_inf_on_the_compared_side_only_is_reported_not_a_crash(tmp_path, monkeypatch):
    """Another tool's plain ``torch.save`` dumps where the compared run overflowed to Inf in
    small entries the reference holds finite (a bfloat16 engine's usual failure), and float64
    values whose differences square past its range: Σ(x-y)² is infinite, Σy² finite, and the
    batch's sqnr_db took math.log10(0) (``ValueError: math domain error``: the diff, and the
    CLI with exit 2, failed on the whole dump)."""
    g = torch.Generator().manual_seed(0)
    ref = {
        "m.ok": torch.randn(6, generator=g),
        "m.f32": torch.randn(5, generator=g),
        "m.bf16": torch.randn(4, generator=g).bfloat16(),
        "m.f64": torch.tensor([1e-200, 2e-200], dtype=torch.float64),
    }
    run = {
        "m.ok": ref["m.ok"].clone(),
        "m.f32": ref["m.f32"].clone(),
        "m.bf16": ref["m.bf16"].clone(),
        "m.f64": torch.tensor([1e200, 2e-200], dtype=torch.float64),
    }
    run["m.f32"][1] = math.inf
    run["m.bf16"][3] = -math.inf
    for side, entries in (("a", ref), ("b", run)):
        (tmp_path / side / "rank0_pid1").mkdir(parents=True)
        torch.save(entries, tmp_path / side / "rank0_pid1" / "pass00000.pt")
    batched, single, count = _tables(tmp_path / "a", tmp_path / "b", monkeypatch)
    assert count >= 4  # every entry went through the batch, none was refused up front
    _assert_bitwise_equal(batched, single)
    rows = batched.set_index("key")
    assert rows.loc["m.f32", "reason"] == rows.loc["m.bf16", "reason"] == "NaN/Inf on one side (1 elements)"
    assert rows.loc["m.f64", "rel_diff"] == pytest.approx(1.0, rel=1e-12)  # rescaled, not Inf
    assert rows.loc["m.ok", "equal"] == 1.0
    div = DumpSet.open(tmp_path / "a").diff(tmp_path / "b").first_divergence()
    assert div.key == "m.f32" and "NaN/Inf on one side" in div.reason
    from tdinspect.cli import main

    assert main(["first-divergence", str(tmp_path / "a"), str(tmp_path / "b")]) == 1


@pytest.mark.parametrize(
    "x, y, want",
    [
        # Σy²/Σ(x-y)² underflows: math.log10(0) raised out of compare_tensors
        ([1e150, 0.0], [1e-150, 1e-150], 10 * (math.log10(2e-300) - math.log10(1e300 + 1e-300))),
        # it overflows: the sqnr was reported as inf (as for identical tensors)
        ([1e150, 2e-150], [1e150, 1e-150], 10 * (math.log10(1e300 + 1e-300) - math.log10(1e-300))),
    ],
)
def test_an_sqnr_beyond_float64s_range_is_its_finite_value_alone_and_batched(x, y, want):
    x, y = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    alone = compare_tensors(x, y)
    assert math.isfinite(alone["sqnr_db"]) and alone["sqnr_db"] == pytest.approx(want, rel=1e-12)
    values, settled = metrics_batch.compare_segments(x.numpy(), y.numpy(), np.array([0]), torch.float64)
    if settled[0]:  # the batch gives the same bits where it settles the pair
        same_numbers({k: float(values[k][0]) for k in TENSOR_METRICS}, alone)


def test_an_sqnr_whose_quotient_is_subnormal_keeps_its_digits():
    """Σy²/Σ(x-y)² of 1e-320 is subnormal: log10 of it was off by 5e-5 dB."""
    assert metrics.sqnr_of_ratio(1e-300, 1e20) == pytest.approx(-3200.0, rel=1e-13)
