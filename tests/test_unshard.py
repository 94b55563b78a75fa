"""Sharded runs: the dims grammar, parallel coordinates, unshard, and a real 2-process TP run."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

import tdinspect
from tdinspect.align.dims import DimsRules, parse_dims, zigzag_chunks
from tdinspect.dumper.recorder import Recorder
from tdinspect.errors import DimsError

from .conftest import ROOT
from .tp_block import run


# -- the dims grammar ---------------------------------------------------------------------
def test_dims_parse_reads_axes_and_flags():
    spec = parse_dims("b s(cp,zigzag) h(tp) d")
    assert spec.names == ("b", "s", "h", "d")
    assert spec.sharded() == [("s", 1, "cp", "cat", True), ("h", 2, "tp", "cat", False)]
    assert parse_dims("b s h(tp,partial)").sharded() == [("h", 2, "tp", "sum", False)]
    assert parse_dims("e(ep) t h(sp)").index("h") == 2


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", "expected space-separated"),
        ("b s h(xp)", "unknown modifier 'xp'"),
        ("b h h", "dim 'h' appears twice"),
        ("b s(tp) h(tp)", "axis 'tp' shards both 's' and 'h'"),
        ("b h(partial)", "partial over no axis"),
        ("b s(tp,zigzag)", "zigzag in 's(tp,zigzag)' needs cp"),
        ("b s(cp,cp)", "repeated modifier"),
        ("b h(tp,)", "empty modifier"),
        ("b h(tp", "cannot read 'h(tp'"),
        # fused segments (tests/test_fused_tp.py)
        ("b h(tp,fused=q:32)", "names one segment"),
        ("b h(tp,fused=q:32,q:16)", "segment 'q' appears twice"),
        ("b h(fused=q:32,k:16)", "needs exactly one axis"),
        ("b h(tp,partial,fused=q:32,k:16)", "neither partial nor zigzag"),
        ("b h(tp,fused=q32,k:16)", "cannot read segment 'q32'"),
        ("b h(tp,fsued=q:32,k:16)", "unknown modifier 'fsued'"),
        ("b h(tp,fused=q:32,k:0)", "segment 'k'"),
        ("b h(tp,fused=q:1,k:1,fused_per_rank=v:1,w:1)", "fused twice"),
        ("b h(tp, k:16)", "unknown modifier 'k:16'"),
    ],
)
def test_dims_errors_name_the_spec(spec, words):
    with pytest.raises(DimsError) as err:
        parse_dims(spec)
    assert words in str(err.value)
    if spec:
        assert repr(spec) in str(err.value)


def test_dims_rules_name_the_rule():
    assert DimsRules({r"q$": "b s h(tp)"}).lookup("layers.0.q") == "b s h(tp)"
    with pytest.raises(DimsError, match=r"rule 'q\$'.*unknown modifier"):
        DimsRules({r"q$": "b s h(tq)"})
    with pytest.raises(DimsError, match="invalid regex"):
        DimsRules({"(": "b"})


def test_capture_rejects_bad_dims_and_coordinates(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(DimsError, match="b s h\\(tpp\\)"):
        tdinspect.capture(model, tmp_path / "a", dims={"0": "b s h(tpp)"})
    with pytest.raises(ValueError, match="0 <= rank < size"):
        tdinspect.capture(model, tmp_path / "b", parallel={"tp": (2, 2)})
    with pytest.raises(DimsError):
        tdinspect.capture_ops(tmp_path / "c", dims={"0": "x(zigzag)"})


def test_capture_ops_records_coordinates_and_dims(tmp_path):
    lin = torch.nn.Linear(4, 6)
    with (
        torch.no_grad(),
        tdinspect.capture_ops(
            tmp_path, model=lin, parallel={"cp": (0, 1)}, dims={r"aten\.(addmm|mm)": "s h(tp)"}
        ) as dump,
    ):
        lin(torch.randn(3, 4))
        dump.step()
    pi = tdinspect.DumpSet.open(tmp_path).get_pass(0)
    assert pi.parallel == {"cp": [0, 1]}
    specs = {k: d for k, d in zip(pi.keys, pi.dims) if d}
    assert specs and all("addmm" in k or "/aten.mm" in k for k in specs)
    assert set(specs.values()) == {"s h(tp)"}


# -- assembling shards --------------------------------------------------------------------
def _write_rank(root, rank: int, coords: dict, entries: dict, dims: dict, checksum=False):
    os.environ["RANK"] = str(rank)
    try:
        rec = Recorder(
            root, level="module", parallel=coords, dims=dims, background_write=False, checksum=checksum
        )
    finally:
        del os.environ["RANK"]
    for key, t in entries.items():
        rec.record(key, t, module_type="Linear")
    rec.step()
    rec.close()


def test_coordinates_and_dims_are_in_the_sidecar(tmp_path):
    _write_rank(tmp_path, 1, {"tp": (1, 2), "cp": (0, 1)}, {"m.q": torch.ones(2, 3)}, {r"\.q$": "s h(tp)"})
    (sidecar,) = tmp_path.glob("rank1_*/pass00000.json")
    doc = json.loads(sidecar.read_text())
    assert doc["parallel"] == {"tp": [1, 2], "cp": [0, 1]}
    assert doc["entries"]["dims"] == ["s h(tp)"]


def test_zigzag_partial_and_tp_reassemble_exactly(tmp_path):
    """cp=2 zigzag along s, tp=2 along h, a partial-sum entry and a replicated one, 4 ranks."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(1, 8, 6, generator=gen)  # s = 8: 4 chunks of 2
    parts = [torch.randn(1, 8, 6, generator=gen) for _ in range(2)]
    rep = torch.randn(3, generator=gen)
    chunks = full.chunk(4, 1)
    for rank in range(4):
        cp, tp = divmod(rank, 2)
        a, b = zigzag_chunks(cp, 2)
        mine = torch.cat([chunks[a], chunks[b]], 1).chunk(2, 2)[tp]
        _write_rank(
            tmp_path,
            rank,
            {"cp": (cp, 2), "tp": (tp, 2)},
            {"x.zz": mine, "x.partial": parts[tp], "x.rep": rep},
            {r"\.zz$": "b s(cp,zigzag) h(tp)", r"\.partial$": "b s h(tp,partial)"},
        )
    u = tdinspect.DumpSet.open(tmp_path).unshard()
    assert u.ranks == [0]
    assert torch.equal(u.tensor("x.zz"), full)
    assert torch.equal(u.tensor("x.partial"), parts[0] + parts[1])
    assert torch.equal(u.tensor("x.rep"), rep)
    cube = u.to_xarray(progress=False)
    assert cube["max"].sel(op="x.zz").item() == pytest.approx(full.max().item())
    assert zigzag_chunks(0, 2) == (0, 3) and zigzag_chunks(1, 4) == (1, 6)


def test_unsharded_entries_without_dims_must_agree(tmp_path):
    for rank in range(2):
        _write_rank(
            tmp_path / "b",
            rank,
            {"tp": (rank, 2)},
            {"x.same": torch.ones(4), "x.differs": torch.full((4,), float(rank))},
            {},
        )
    _write_rank(tmp_path / "a", 0, {}, {"x.same": torch.ones(4), "x.differs": torch.zeros(4)}, {})
    u = tdinspect.DumpSet.open(tmp_path / "b").unshard()
    assert torch.equal(u.tensor("x.same"), torch.ones(4))
    with pytest.raises(ValueError, match="not replicated: rank 0 and rank 1 differ"):
        u.tensor("x.differs")
    div = tdinspect.DumpSet.open(tmp_path / "a").diff(tmp_path / "b", unshard=True).first_divergence()
    assert div.key == "x.differs" and div.structural
    assert "B: no dims and not replicated: rank 0 and rank 1" in div.reason


def test_a_shard_given_no_dims_is_named_as_one_not_as_a_shape(tmp_path):
    """Each rank holds half of x.act but no dims say so: the diff says the copies differ
    (what to fix), not only that rank 0's copy is half the reference's width."""
    full = torch.arange(8.0)
    for rank in range(2):
        _write_rank(tmp_path / "b", rank, {"tp": (rank, 2)}, {"x.act": full.chunk(2)[rank]}, {})
    _write_rank(tmp_path / "a", 0, {}, {"x.act": full}, {})
    div = tdinspect.DumpSet.open(tmp_path / "a").diff(tmp_path / "b", unshard=True).first_divergence()
    assert div.key == "x.act" and div.structural
    assert div.reason.startswith("B: no dims and not replicated: rank 0 and rank 1 differ")
    assert "give the entry dims" in div.reason


def test_partial_sums_already_reduced_are_named_so(tmp_path):
    """A row-parallel layer that all-reduces inside the module hands every rank the full sum;
    dims saying 'partial' add the copies (rel_diff 0.2 at 2 ranks): the reason says why."""
    out = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    for rank in range(2):
        _write_rank(
            tmp_path / "b", rank, {"tp": (rank, 2)}, {"x.o": out.clone()}, {r"\.o$": "s h(tp,partial)"}
        )
    _write_rank(tmp_path / "a", 0, {}, {"x.o": out}, {})
    div = tdinspect.DumpSet.open(tmp_path / "a").diff(tmp_path / "b", unshard=True).first_divergence()
    assert div.key == "x.o" and div.value == pytest.approx(0.2)
    assert (
        "its 2 partial sums (rank 0 (tp 0 of 2), rank 1 (tp 1 of 2)) are identical: "
        "already all-reduced?" in div.reason
    )


def test_ranks_emulated_in_one_process_are_one_run(tmp_path):
    """One process captures each shard of a column-parallel Linear with parallel=: each
    is its own rank folder of one run, and unsharded they meet the unsharded layer."""
    gen = torch.Generator().manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(8, 6))
    x = torch.randn(2, 8, generator=gen)
    with torch.no_grad(), tdinspect.capture(full, tmp_path / "ref") as dump:
        full(x)
        dump.step()
    for rank in range(2):
        part = torch.nn.Sequential(torch.nn.Linear(8, 3))
        part[0].weight.data.copy_(full[0].weight.data.chunk(2)[rank])
        part[0].bias.data.copy_(full[0].bias.data.chunk(2)[rank])
        with (
            torch.no_grad(),
            tdinspect.capture(
                part, tmp_path / "tp2", parallel={"tp": (rank, 2)}, dims={"0$": "b h(tp)"}
            ) as dump,
        ):
            part(x)
            dump.step()
    assert sorted(p.name.split("_")[0] for p in (tmp_path / "tp2").iterdir()) == ["rank0", "rank1"]
    assert len(tdinspect.DumpSet.runs(tmp_path / "tp2")) == 1
    tp2 = tdinspect.DumpSet.open(tmp_path / "tp2")
    assert tp2.ranks == [0, 1]
    diff = tdinspect.DumpSet.open(tmp_path / "ref").diff(tp2, unshard=True)
    table = diff.table(progress=False)
    # a 3-wide matmul may block its sums otherwise than a 6-wide one (BLAS): equal to rounding
    assert list(table["op"]) == ["model.0"] and table["max_abs"].item() < 1e-6
    assert diff.first_divergence() is None


def test_replicas_are_compared_bit_for_bit(tmp_path):
    """A replica holding NaN is still one (NaN meets the same NaN); -0.0 against 0.0 is not."""
    nan = torch.tensor([1.0, math.nan, 3.0] * 3000)  # 36 KB: past the first compared block
    late = torch.arange(9000.0)
    for rank in range(2):
        tail = late.clone()
        tail[-1] += rank  # the copies differ in their last element only
        _write_rank(
            tmp_path,
            rank,
            {"tp": (rank, 2)},
            {"x.nan": nan, "x.zero": torch.tensor([0.0, -0.0 if rank else 0.0]), "x.late": tail},
            {},
        )
    u = tdinspect.DumpSet.open(tmp_path).unshard()
    back = u.tensor("x.nan")
    assert back.view(torch.int32).equal(nan.view(torch.int32))
    with pytest.raises(ValueError, match=r"rank 0 and rank 1 differ \(max \|Δ\| 0\)"):
        u.tensor("x.zero")
    with pytest.raises(ValueError, match=r"rank 0 and rank 1 differ \(max \|Δ\| 1\)"):
        u.tensor("x.late")


def test_partial_sums_over_three_ranks_in_a_reused_buffer(tmp_path):
    parts = [torch.randn(4, 6, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    for rank in range(3):
        _write_rank(
            tmp_path,
            rank,
            {"tp": (rank, 3)},
            {"x.p": parts[rank], "x.q": 2 * parts[rank]},
            {r"\.[pq]$": "s h(tp,partial)"},
        )
    u = tdinspect.DumpSet.open(tmp_path).unshard()
    pi = u.get_pass(0)
    loaded = pi.load(scratch=True)  # what a diff reads through: one buffer per shape and dtype
    p = pi.tensor("x.p", loaded).clone()
    q = pi.tensor("x.q", loaded)
    assert torch.equal(p, (parts[0] + parts[1]) + parts[2])  # the ranks' order, in float32
    assert torch.equal(q, (2 * parts[0] + 2 * parts[1]) + 2 * parts[2])
    assert torch.equal(u.tensor("x.p"), p)


def test_replicas_with_checksums_are_settled_without_reading(tmp_path):
    for rank in range(2):
        _write_rank(
            tmp_path,
            rank,
            {"tp": (rank, 2)},
            {"x.same": torch.ones(4), "x.differs": torch.full((4,), float(rank))},
            {},
            checksum=True,
        )
    u = tdinspect.DumpSet.open(tmp_path).unshard()
    plans = u.get_pass(0).plans
    assert plans["x.same"]["op"] == "read"  # the checksums agree: rank 0's copy, no comparison
    assert plans["x.differs"]["op"] == "error"
    assert "checksums differ (rank 0: " in plans["x.differs"]["reason"]
    assert torch.equal(u.tensor("x.same"), torch.ones(4))


def test_dims_given_at_open_for_foreign_dumps(tmp_path):
    """Pass files without sidecars (another tool): ranks are tp ranks, dims come from open()."""
    full = torch.arange(12.0).reshape(3, 4)
    for rank in range(2):
        folder = tmp_path / f"rank{rank}_pid{100 + rank}"
        folder.mkdir()
        torch.save({"lin": full.chunk(2, 1)[rank]}, folder / "pass00000.pt")
    with pytest.raises(ValueError, match="not replicated"):
        tdinspect.DumpSet.open(tmp_path).unshard().tensor("lin")
    u = tdinspect.DumpSet.open(tmp_path, dims={"lin": "s h(tp)"}).unshard()
    assert torch.equal(u.tensor("lin"), full)


# -- a real two-process tensor-parallel run -------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp2(out, fault_layer=None):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RANK", None)
    port = _free_port()
    extra = [] if fault_layer is None else [str(fault_layer)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.tp_block", str(r), "2", str(port), str(out), *extra],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()[-2000:]
    return out


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    run(str(root / "tp1"))
    return {"tp1": root / "tp1", "tp2": _tp2(root / "tp2"), "fault": _tp2(root / "fault", 1)}


def test_tp2_unsharded_matches_tp1(tp_runs):
    tp2 = tdinspect.DumpSet.open(tp_runs["tp2"])
    assert tp2.ranks == [0, 1]
    assert tp2.get_pass(0, 1).parallel == {"tp": [1, 2]}  # from torch.distributed
    q = tp2.tensor("model.blocks.0.q", rank=1)
    assert q.shape == (1, 16, 16)
    diff = tdinspect.DumpSet.open(tp_runs["tp1"]).diff(tp2, unshard=True)
    plan = diff.plan().set_index("a_key")  # readable before any tensor is read
    assert plan.loc["model.blocks.0.q", "assembled_b"] == "cat(dim 2: rank 0 (tp 0 of 2), rank 1 (tp 1 of 2))"
    assert plan.loc["model.blocks.0.o", "assembled_b"] == "sum(rank 0 (tp 0 of 2), rank 1 (tp 1 of 2))"
    assert plan.loc["model.blocks.0.ln1", "assembled_b"] == "same(rank 0, rank 1)"
    assert plan.loc["model.blocks.0.q", "assembled_a"] == "model.blocks.0.q of 0"
    assert (plan["status"] == "ok").all()
    table = diff.table(progress=False)
    assert len(table) == 20 and not table["structural"].any()
    # shards compared against the matching slices of tp1's tensors: the assembled pair's numbers
    from tdinspect.numerics.metrics import compare_tensors

    for row in table[table["op"].str.endswith(".q")].to_dict("records"):
        want = compare_tensors(diff.b.tensor(row["key"]), diff.a.tensor(row["key"]))
        assert row["max_abs"] == want["max_abs"] and row["equal"] == want["equal"]
        assert row["rel_diff"] == pytest.approx(want["rel_diff"], rel=1e-9, abs=1e-300)
    assert diff.first_divergence(threshold=1e-10) is None  # float32 noise is ~1e-14 in rel_diff
    assert table["max_abs"].max() < 1e-5
    # without unsharding, the same dumps do not line up
    assert tdinspect.DumpSet.open(tp_runs["tp1"]).diff(tp2).first_divergence().structural


def test_tp2_fault_in_rank1_shard_is_named_with_its_rank(tp_runs):
    diff = tdinspect.DumpSet.open(tp_runs["tp1"]).diff(tp_runs["fault"], unshard=True)
    div = diff.first_divergence(threshold=1e-10)
    assert div.key == "model.blocks.1.up"
    assert "rank 1 (tp 1 of 2)" in div.reason and "rank 0 (tp 0" not in div.reason
    from tdinspect.cli import main

    assert (
        main(
            [
                "first-divergence",
                str(tp_runs["tp1"]),
                str(tp_runs["fault"]),
                "--unshard",
                "--threshold",
                "1e-10",
            ]
        )
        == 1
    )


def _emulated_tp2(root, fault_rank=None):
    """A full Linear (``root/ref``) and its column-parallel TP=2 shards captured in one
    process (``root/tp2``); ``fault_rank``'s shard gets a perturbed bias."""
    gen = torch.Generator().manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(8, 6))
    x = torch.randn(2, 4, 8, generator=gen)
    with torch.no_grad(), tdinspect.capture(full, root / "ref") as dump:
        full(x)
        dump.step()
    for rank in range(2):
        part = torch.nn.Sequential(torch.nn.Linear(8, 3))
        part[0].weight.data.copy_(full[0].weight.data.chunk(2)[rank])
        part[0].bias.data.copy_(full[0].bias.data.chunk(2)[rank] + (0.5 if rank == fault_rank else 0.0))
        with (
            torch.no_grad(),
            tdinspect.capture(
                part, root / "tp2", parallel={"tp": (rank, 2)}, dims={"0$": "b s h(tp)"}
            ) as dump,
        ):
            part(x)
            dump.step()
    return root / "ref", root / "tp2"


@pytest.mark.parametrize(
    "mapping",
    [
        None,
        {r"model\.0": ["model.0", "reshape(2, 4, 6)"]},
        {r"model\.0": ["model.0", "flatten(0, 1).reshape(2, 4, 6)"]},
    ],
    ids=["no-rule", "noop-reshape", "flatten-reshape"],
)
def test_a_transform_rule_keeps_the_faulty_rank(tmp_path, mapping):
    """A mapping rule with a transform (here one that changes nothing) still names the rank
    whose shard differs: the shards' slices are followed through the transform."""
    ref, tp2 = _emulated_tp2(tmp_path, fault_rank=1)
    div = tdinspect.DumpSet.open(ref).diff(tp2, mapping=mapping, unshard=True).first_divergence()
    assert div is not None and div.key == "model.0"
    assert "rank 1 (tp 1 of 2)" in div.reason and "rank 0 (tp 0" not in div.reason, div.reason


def test_a_transform_rule_keeps_the_rank_of_a_sharded_a_side(tmp_path):
    """A the sharded run, B the full one behind a transform: A's slices are in the
    transform's output, and still name the rank."""
    ref, tp2 = _emulated_tp2(tmp_path, fault_rank=0)
    rule = {r"model\.0": ["model.0", "flatten(0, 1).reshape(2, 4, 6)"]}
    div = tdinspect.DumpSet.open(tp2).diff(ref, mapping=rule, unshard=True).first_divergence()
    assert div is not None and "rank 0 (tp 0 of 2)" in div.reason and "rank 1 (tp 1" not in div.reason, (
        div.reason
    )


def test_a_tp_shape_mismatch_without_unshard_names_the_ranks_and_unshard(tmp_path):
    """A full run against a TP=2 dump without unshard: the shape mismatch says B holds the
    entry in 2 ranks (tp) and to compare with unshard, in the API and the CLI; the other
    way round A is the sharded side."""
    ref, tp2 = _emulated_tp2(tmp_path)
    hint = "holds this entry in 2 ranks (tp); compare with unshard=True / --unshard"
    div = tdinspect.DumpSet.open(ref).diff(tp2).first_divergence()
    assert div.structural and div.reason.startswith("shape [2, 4, 6] vs [2, 4, 3]"), div.reason
    assert f"B {hint}" in div.reason, div.reason
    back = tdinspect.DumpSet.open(tp2).diff(ref).first_divergence()
    assert f"A {hint}" in back.reason, back.reason
    assert tdinspect.DumpSet.open(ref).diff(tp2, unshard=True).first_divergence() is None
    out = subprocess.run(
        [sys.executable, "-m", "tdinspect", "first-divergence", str(ref), str(tp2)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert f"B {hint}" in out.stdout, out.stdout + out.stderr


def test_shards_without_coordinates_that_add_up_are_hinted(tmp_path):
    """Ranks that record no parallel coordinates but whose shapes add up along one dim to
    the other side's are hinted too (without an axis name); shapes that do not add up
    are not."""
    _write_rank(tmp_path / "a", 0, {}, {"m.q": torch.ones(2, 6)}, {})
    for r in range(2):
        _write_rank(tmp_path / "b", r, {}, {"m.q": torch.ones(2, 3)}, {})
        _write_rank(tmp_path / "c", r, {}, {"m.q": torch.ones(2, 2)}, {})
    div = tdinspect.DumpSet.open(tmp_path / "a").diff(tmp_path / "b").first_divergence()
    assert "(B holds this entry in 2 ranks; compare with unshard=True / --unshard)" in div.reason, div.reason
    div = tdinspect.DumpSet.open(tmp_path / "a").diff(tmp_path / "c").first_divergence()
    assert div.reason.startswith("shape ") and "unshard" not in div.reason, div.reason
