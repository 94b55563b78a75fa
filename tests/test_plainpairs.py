"""Plain pairs of 64 KB and more compared straight from the pass files' bytes (and
``compare_tensors``' short road for them): the bits of the pair-by-pair path."""

from __future__ import annotations

import io
import math
import struct
import zipfile
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tdinspect import DumpSet
from tdinspect.compare import plainpairs, smallpairs
from tdinspect.numerics import kernels, metrics
from tdinspect.numerics.metrics import STORED, TENSOR_METRICS, compare_tensors

from .recorded import capture_llama, record_dump
from .test_dumpset_diff import write_dump
from .test_smallbatch import _assert_bitwise_equal, partner, values_of

N = kernels.NUMBA_MIN_BYTES // 4 + 40  # float32 elements of a pair just past the small ones
FLOAT8 = [dt for dt in STORED if dt.itemsize == 1]


def _big(g, n: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)


def _passes(seed: int, wrong: bool) -> list[dict]:
    """Pairs of every kind the plain road must take or leave, each of 64 KB or more a side
    (bar the non-float and mismatched ones): every stored dtype, identical, NaN on one side
    and on both, huge float64 (rescaled), far norms (Σxy summed directly), -0.0 against 0.0,
    non-contiguous, another shape, another dtype, integers."""
    passes = []
    for p in range(2):
        g, h = torch.Generator().manual_seed(p), torch.Generator().manual_seed(seed + p)
        e = {}
        for dt in STORED:
            n = N * 4 // dt.itemsize
            base = _big(g, n)
            e[f"m.{str(dt)[6:]}"] = (base + (1e-2 * _big(h, n) if wrong else 0)).to(dt)
        e["m.same"] = _big(g, N)
        both = _big(g, N) + (1e-3 * _big(h, N) if wrong else 0)
        both[7] = math.nan
        e["m.nan_both"] = both
        one = _big(g, N)
        if wrong:
            one[N // 2] = math.inf
        e["m.inf_one"] = one
        e["m.huge"] = _big(g, N, torch.float64, 1e200) * (2 if wrong else 1)
        e["m.far"] = _big(g, N) * (1e-4 if wrong else 1)
        e["m.negzero"] = torch.zeros(N) * (-1 if wrong else 1)
        e["m.strided"] = _big(g, 4 * N).reshape(4, N).t()
        e["m.shape"] = _big(g, N + (8 if wrong else 0))
        e["m.dtype"] = _big(g, N).to(torch.float16 if wrong else torch.float32)
        e["m.int"] = torch.arange(N) + (1 if wrong else 0)
        passes.append(e)
    return passes


def _tables(a, b):
    """The diff table, the pairs compared on the plain road, and the table pair by pair."""
    seen = []
    real = plainpairs.stored_metrics

    def spy(x, y, dtype):
        seen.append(dtype)
        return real(x, y, dtype)

    with mock.patch.object(plainpairs, "stored_metrics", spy):
        plain = DumpSet.open(a).diff(b).table(progress=False)
    with (
        mock.patch("tdinspect.compare.passes.small_plain", lambda pi, plain=None: [None] * len(pi.keys)),
        mock.patch("tdinspect.compare.passes.plain_dtypes", lambda pi: [None] * len(pi.keys)),
    ):
        single = DumpSet.open(a).diff(b).table(progress=False)
    return plain, seen, single


def test_plain_pairs_of_a_recorded_dump_have_the_pair_by_pair_rows(tmp_path, monkeypatch):
    a = record_dump(tmp_path / "a", _passes(1, wrong=False))
    b = record_dump(tmp_path / "b", _passes(2, wrong=True))
    plain, seen, single = _tables(a, b)
    # every stored dtype, same, NaN on both, Inf on one, huge, far, negzero, strided (the
    # recorder stores it contiguous; shape, dtype, int: not plain), in each of 2 passes
    assert len(seen) == 2 * (len(STORED) + 7) and set(seen) == set(STORED)
    _assert_bitwise_equal(plain, single)
    rows = plain.set_index(["pass", "key"])
    assert rows.loc[(0, "m.inf_one"), "reason"] == "NaN/Inf on one side (1 elements)"
    assert not rows.loc[(0, "m.nan_both"), "structural"] and rows.loc[(0, "m.nan_both"), "max_abs"] > 0
    assert rows.loc[(0, "m.huge"), "rel_diff"] == pytest.approx(0.2, rel=1e-14)  # rescaled
    assert rows.loc[(1, "m.same"), "equal"] == 1.0 and rows.loc[(1, "m.negzero"), "equal"] == 0.0
    assert rows.loc[(0, "m.bfloat16"), "max_abs"] > 0 and rows.loc[(0, "m.shape"), "structural"]
    with monkeypatch.context() as m:  # the pairs left over read the records the road checked
        m.setattr("tdinspect.compare.passes._open", lambda pi: pytest.fail("pass file read twice"))
        _assert_bitwise_equal(DumpSet.open(a).diff(b).table(progress=False), single)


def test_plain_pairs_without_sidecars_have_the_pair_by_pair_rows(tmp_path):
    """Another tool's ``torch.save`` files: the tensors the open loaded, as numpy views."""
    a = write_dump(tmp_path / "a", _passes(1, wrong=False))
    b = write_dump(tmp_path / "b", _passes(2, wrong=True))
    plain, seen, single = _tables(a, b)
    assert len(seen) == 2 * (len(STORED) + 6)  # strided as saved: compare_pair's
    _assert_bitwise_equal(plain, single)


def test_a_refused_layout_sends_plain_pairs_to_the_loaded_tensors(tmp_path, monkeypatch):
    """A sidecar layout that does not check out against the archive: nothing is read from
    its claims; the tensors are loaded and the rows are the same."""
    a = record_dump(tmp_path / "a", _passes(1, wrong=False))
    b = record_dump(tmp_path / "b", _passes(2, wrong=True))
    want, _, _ = _tables(a, b)
    refused = []
    real = smallpairs.element_starts

    def refuse(path, keys, raw, index=None):
        refused.append(real(path, keys, [["0", 10**12, [1], [1], "torch.float32"]] * len(raw), index))
        return refused[-1]

    monkeypatch.setattr(smallpairs, "element_starts", refuse)
    got, seen, single = _tables(a, b)
    assert refused and all(r is None for r in refused) and set(seen) == set(STORED)
    _assert_bitwise_equal(got, want)
    _assert_bitwise_equal(got, single)


def _bits(out: dict) -> list[bytes]:
    return [struct.pack("<d", out[k]) for k in (*TENSOR_METRICS, "nonfinite_mismatch")]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(STORED)),
    size=st.sampled_from([1, 300, N]),
    kind=st.sampled_from(["normal", "zeros", "nonfinite", "huge", "tiny", "allzero"]),
    how=st.sampled_from(["same", "lastbits", "far", "negzero", "noise"]),
    seed=st.integers(0, 2**16),
)
def test_compare_tensors_short_road_gives_the_general_roads_bits(dtype, size, kind, how, seed):
    """One dtype, contiguous: the stored bytes go to the kernel in a few calls; the metrics
    are the general road's, bit for bit, the special roads (NaN/Inf masked, float64 rescaled,
    Σxy summed directly) included."""
    rng = np.random.default_rng(seed)
    n = max(1, size * 4 // dtype.itemsize)
    y = values_of(rng, n, dtype, kind)
    x = (
        partner(rng, y, how) if dtype.itemsize > 1 else partner(rng, y.float(), how).to(dtype)
    )  # torch has no float8 arithmetic
    calls = []
    real = metrics.stored_metrics

    def spy(*args):
        calls.append(args[2])
        return real(*args)

    with mock.patch.object(metrics, "stored_metrics", spy):
        short = compare_tensors(x, y)
    assert calls == [dtype]
    with mock.patch.object(metrics, "_stored_pair", lambda x, y: None):
        general = compare_tensors(x, y)
    assert _bits(short) == _bits(general)
    x2d = x.reshape(-1, 1).expand(-1, 2)  # not contiguous: the general road alone
    with mock.patch.object(metrics, "stored_metrics", spy):
        compare_tensors(x2d, y.reshape(-1, 1).expand(-1, 2))
    assert calls == [dtype]


def test_big_entries_compared_live_have_the_offline_bits(tmp_path):
    """A tiny HF Llama whose logits pass 64 KB: live comparison (compare_tensors,
    one pair at a time) and the offline diff (the plain road) give the same bits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    ids = torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(0))

    def run(name, change=None, **live):
        return capture_llama(config, ids, name and tmp_path / name, change, torch.bfloat16, **live)

    norm = "model.layers.0.post_attention_layernorm.weight"
    ref, wrong = run("ref"), run("wrong", norm)
    seen = []
    real = plainpairs.stored_metrics
    with mock.patch.object(plainpairs, "stored_metrics", lambda *a: seen.append(a) or real(*a)):
        offline = DumpSet.open(ref).diff(wrong).table(progress=False).set_index(["pass", "key"])
    assert any(x.nbytes >= kernels.NUMBA_MIN_BYTES for x, _, _ in seen)
    live = run(None, norm, compare_to=ref, on_divergence="record").set_index(["pass", "key"])
    offline = offline.loc[live.index]
    assert len(live) > 10 and (offline["max_abs"] > 0).any()
    for col in TENSOR_METRICS:
        assert live[col].to_numpy(float).tobytes() == offline[col].to_numpy(float).tobytes(), col


def _saved_at(folder, tensors: dict, residue: int) -> None:
    """``torch.save(tensors)`` rewritten by zipfile into ``folder`` with its first record's data
    at a file offset (so a mapped address: maps start on a page) ``residue`` mod 4, shifted
    by a padding record before it."""
    buf = io.BytesIO()
    torch.save(tensors, buf)
    archive = zipfile.ZipFile(buf)
    folder.mkdir(parents=True, exist_ok=True)
    for pad in range(1, 5):
        with zipfile.ZipFile(folder / "pass00000.pt", "w") as out:
            for info in archive.infolist():
                if "/data/" in info.filename:
                    out.writestr("archive/" + "x" * pad, b"")  # shifts the records after it
                out.writestr(info.filename, archive.read(info))
        info = zipfile.ZipFile(folder / "pass00000.pt").getinfo("archive/data/0")
        start = info.header_offset + 30 + len(info.filename) + len(info.extra)
        if start % 4 == residue:
            return
    raise AssertionError("no padding gave the residue")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn]
)
def test_differing_records_at_any_byte_offset_compare_as_torch_load_reads_them(tmp_path, dtype):
    """Records another zip writer left at odd addresses (torch.save aligns them to 64 bytes),
    compared on the plain road (bfloat16 read two elements a 32-bit load): the rows of
    compare_tensors on torch.load's copies. A dump diffed against itself never reaches the
    loops (its bytes are equal), so the two sides differ here: one side's records at an odd
    address, the other's between two 32-bit words."""
    n = 12 * N // dtype.itemsize + 1  # 3 * N float32 and more, odd: blocks and a tail run
    roots, records = [], []
    for seed in (1, 2):
        base = _big(torch.Generator().manual_seed(seed), n + 7).to(dtype)
        folder = tmp_path / f"d{seed}" / "rank0_pid1"
        _saved_at(folder, {"m.whole": base, "m.offset": base[7:]}, seed)  # one record, 2 views
        roots.append(folder.parent)
        records.append(torch.load(folder / "pass00000.pt", weights_only=True))
    seen = []
    real = plainpairs.stored_metrics

    def spy(x, y, dtype):
        seen.append((x.ctypes.data % 4, y.ctypes.data % 4))
        return real(x, y, dtype)

    with mock.patch.object(plainpairs, "stored_metrics", spy):
        plain = DumpSet.open(roots[0]).diff(roots[1]).table(progress=False)
    skip = 7 * dtype.itemsize  # m.offset starts 7 elements in
    assert seen == [(2, 1), ((2 + skip) % 4, (1 + skip) % 4)]  # the records where they lie
    for key, row in plain.set_index("key").iterrows():
        want = compare_tensors(records[1][key], records[0][key])
        assert [struct.pack("<d", row[k]) for k in TENSOR_METRICS] == [
            struct.pack("<d", want[k]) for k in TENSOR_METRICS
        ], key
        assert 0 < row["max_abs"] < math.inf and not row["structural"]
