"""Replicas and pipeline stages under unshard (issue 35, case 3).

Copies of an entry along a parallel axis its dims do not shard (data-parallel ranks fed the
same batch, a tensor-parallel rank's copy of a replicated layer norm) are compared with each
other, as the copies of an entry without dims are; a pipeline stage's entries are read from
the ranks that hold them. Real runs: :mod:`tests.parallel_block` (dp=2 x tp=2 in a ``gloo``
group) and a four-block pipeline of :mod:`tests.tp_block`'s blocks run as two stages.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import tdinspect
from tdinspect.cli import main
from tdinspect.dumper.recorder import Recorder
from tdinspect.examples.gloo import spawn_ranks

from .tp_block import DIMS, Block, inputs, run


def _write_rank(root, rank: int, coords: dict, entries: dict, dims: dict, checksum=False) -> None:
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


# -- replicated tensor-parallel copies, written by hand -------------------------------------
@pytest.mark.parametrize("fault", ["none", "half", "garbage"])
def test_replicated_tp_copies_are_compared(tmp_path, fault):
    """``m.norm`` is replicated over tp (its dims name no axis): rank 1's copy off by 0.5 or
    holding garbage diverges, naming the rank (before: rank 0's copy alone was read,
    "matches"); identical copies match."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, generator=gen)
    up = x @ torch.randn(8, 6, generator=gen)
    wrong = {"none": x, "half": x + 0.5, "garbage": torch.randn(2, 4, 8, generator=gen)}[fault]
    _write_rank(tmp_path / "a", 0, {}, {"m.norm": x, "m.up": up}, {})
    for r in range(2):
        entries = {"m.norm": wrong if r else x, "m.up": up.chunk(2, -1)[r]}
        _write_rank(tmp_path / "b", r, {"tp": (r, 2)}, entries, {r"norm$": "b s h", r"up$": "b s h(tp)"})
    d = tdinspect.DumpSet.open(tmp_path / "a").diff(tmp_path / "b", unshard=True)
    v = d.verdict()
    if fault == "none":
        assert v.outcome == "matches" and v.compared == 2, v.text
        return
    assert v.outcome == "diverges", v.text
    div = d.first_divergence()
    assert div.key == "m.norm" and div.structural
    assert "tp rank 1 differs from tp rank 0 (ranks [1] against [0]" in div.reason, div.reason
    with pytest.raises(tdinspect.errors.AlignError, match="tp rank 1 differs from tp rank 0"):
        tdinspect.DumpSet.open(tmp_path / "b").unshard().tensor("m.norm")


def test_a_dp_axis_named_in_dims_concatenates_instead(tmp_path):
    """Data-parallel ranks fed other samples: ``b(dp)`` says so, and the batch is put back."""
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(0))
    _write_rank(tmp_path / "a", 0, {}, {"m.norm": x}, {})
    for r in range(2):
        _write_rank(tmp_path / "b", r, {"dp": (r, 2)}, {"m.norm": x.chunk(2)[r]}, {r"norm$": "b(dp) s h"})
    assert torch.equal(tdinspect.DumpSet.open(tmp_path / "b").unshard().tensor("m.norm"), x)
    d = tdinspect.DumpSet.open(tmp_path / "a").diff(tmp_path / "b", unshard=True)
    assert d.verdict().outcome == "matches"
    # without it, the two halves are taken for copies, and they are not
    for r in range(2):
        _write_rank(tmp_path / "c", r, {"dp": (r, 2)}, {"m.norm": x.chunk(2)[r]}, {r"norm$": "b s h"})
    div = tdinspect.DumpSet.open(tmp_path / "a").diff(tmp_path / "c", unshard=True).first_divergence()
    assert "dp rank 1 differs from dp rank 0" in div.reason and "'b(dp) s h'" in div.reason


def test_a_copy_missing_on_a_dp_rank_is_named(tmp_path):
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    for r in range(2):
        entries = {"m.norm": x, **({"m.extra": x} if r == 0 else {})}
        _write_rank(tmp_path / "b", r, {"dp": (r, 2)}, entries, {r"": "s h"})
    plans = tdinspect.DumpSet.open(tmp_path / "b").unshard().get_pass(0).plans
    assert plans["m.extra"]["op"] == "error"
    assert "only on ranks [0] (not on [1])" in plans["m.extra"]["reason"]


# -- real runs: dp=2 x tp=2 in a gloo group --------------------------------------------------
def _parallel(root, size: int, fault: str):
    out = root / fault
    spawn_ranks("tests.parallel_block", size, root / f"{fault}.store", lambda r: [str(out), fault])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    run(str(root / "tp1"))
    return {
        "tp1": root / "tp1",
        "dp2tp2": _parallel(root, 4, "none"),
        "nan": _parallel(root, 4, "nan"),
        "ln": _parallel(root, 2, "ln"),
    }


def test_a_correct_dp2_tp2_run_matches_with_every_copy_compared(runs):
    b = tdinspect.DumpSet.open(runs["dp2tp2"])
    assert b.ranks == [0, 1, 2, 3] and b.get_pass(0, 3).parallel == {"dp": [1, 2], "tp": [1, 2]}
    d = tdinspect.DumpSet.open(runs["tp1"]).diff(b, unshard=True)
    plan = d.plan().set_index("a_key")
    assert plan.loc["model.blocks.0.q", "assembled_b"] == (
        "same(dp rank 0 [cat(dim 2: rank 0 (tp 0 of 2), rank 1 (tp 1 of 2))], "
        "dp rank 1 [cat(dim 2: rank 2 (tp 0 of 2), rank 3 (tp 1 of 2))])"
    )
    assert plan.loc["model.blocks.0.ln1", "assembled_b"] == (
        "same(dp rank 0, tp rank 0, dp rank 0, tp rank 1, dp rank 1, tp rank 0, dp rank 1, tp rank 1)"
    )
    v = d.verdict()
    assert v.outcome == "matches" and v.compared == 20, v.text
    assert main(["first-divergence", str(runs["tp1"]), str(runs["dp2tp2"]), "--unshard"]) == 0


def test_dp_rank1_all_nan_diverges_naming_the_dp_rank(runs, capsys):
    """Every entry has dims and none names dp: before, dp rank 1 was never read ("matches",
    exit 0 with --unshard, though a plain diff names it)."""
    d = tdinspect.DumpSet.open(runs["tp1"]).diff(runs["nan"], unshard=True)
    div = d.first_divergence()
    assert div.key == "model.blocks.0.ln1" and div.structural
    assert "dp rank 1, tp rank 0 differs from dp rank 0, tp rank 0 (ranks [2] against [0]" in div.reason
    assert d.verdict().outcome == "diverges"
    # a sharded entry's copies: each put together from its own dp rank's shards, then compared
    u = tdinspect.DumpSet.open(runs["nan"]).unshard()
    with pytest.raises(
        tdinspect.errors.AlignError, match=r"dp rank 1 differs from dp rank 0 \(ranks \[2, 3\]"
    ):
        u.tensor("model.blocks.0.q")
    capsys.readouterr()
    assert main(["first-divergence", str(runs["tp1"]), str(runs["nan"]), "--unshard"]) == 1
    assert "dp rank 1" in capsys.readouterr().out
    assert main(["first-divergence", str(runs["tp1"]), str(runs["nan"])]) == 1  # as before


def test_a_replicated_weight_out_of_sync_is_named_at_the_replica(runs):
    """tp rank 1's copy of ``blocks.1.ln2`` is off: named there, not at the shard of ``up``
    it feeds (before: ``blocks.1.up`` in rank 1, the consequence)."""
    div = tdinspect.DumpSet.open(runs["tp1"]).diff(runs["ln"], unshard=True).first_divergence()
    assert div.key == "model.blocks.1.ln2", div
    assert "tp rank 1 differs from tp rank 0 (ranks [1] against [0]" in div.reason


# -- pipeline stages ------------------------------------------------------------------------
class Pipeline(nn.Module):
    """Four of :mod:`tests.tp_block`'s blocks (TP=1); ``forward(x, layers)`` runs a stage's."""

    def __init__(self, fault: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleList(Block(0, 1, gen) for _ in range(4))
        if fault:  # a bug in a layer of stage 1
            with torch.no_grad():
                self.blocks[3].up.weight[:4] *= 1.01

    def forward(self, x, layers=range(4)):
        for i in layers:
            x = self.blocks[i](x)
        return x


def _pipeline(root, fault: bool = False):
    """PP=1 (``root/pp1``: every block on rank 0) and PP=2 (``root/pp2``: blocks 0-1 on
    stage 0, rank 0; blocks 2-3 on stage 1, rank 1), captured one stage after the other."""
    model = Pipeline(fault)
    with torch.no_grad():
        with tdinspect.capture(model, root / "pp1", dims=DIMS) as dump:
            model(inputs())
            dump.step()
        x = inputs()
        for stage, layers in enumerate((range(2), range(2, 4))):
            with tdinspect.capture(model, root / "pp2", dims=DIMS, parallel={"pp": (stage, 2)}) as dump:
                x = model(x, layers)
                dump.step()
    return root / "pp1", root / "pp2"


@pytest.mark.filterwarnings("ignore:.*never ran a hooked forward")  # the other stage's blocks
@pytest.mark.parametrize("fault", [False, True])
def test_pipeline_stages_meet_one_stage_entry_by_entry(tmp_path, fault):
    pp1, _ = _pipeline(tmp_path / "good")
    _, pp2 = _pipeline(tmp_path / "run", fault)
    b = tdinspect.DumpSet.open(pp2)
    assert b.ranks == [0, 1]
    assert b.tensor("model.blocks.2.up", rank=1).shape == (1, 16, 64)
    d = tdinspect.DumpSet.open(pp1).diff(pp2, unshard=True)
    v = d.verdict()
    table = d.table(progress=False)
    assert len(table) == 40 and not table["reason"].astype(bool).any()  # each entry once, none one-sided
    if not fault:
        assert v.outcome == "matches" and v.compared == 40, v.text
        plain = tdinspect.DumpSet.open(pp1).diff(pp2).first_divergence()  # rank by rank: says what to do
        assert "rank 1 only in B (a pp rank: compare with unshard=True / --unshard)" in plain.reason
        return
    div = d.first_divergence()
    assert div.key == "model.blocks.3.up" and not div.structural, div
    assert main(["first-divergence", str(pp1), str(pp2), "--unshard"]) == 1


def test_a_shard_wrong_in_every_dp_copy_is_named_with_its_tp_rank(tmp_path):
    """The copies agree (the same bug on both dp ranks): the divergence is named with the
    shard that differs, read through the first copy."""
    up = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(0))
    _write_rank(tmp_path / "a", 0, {}, {"m.up": up}, {})
    for r in range(4):
        dp, tp = divmod(r, 2)
        shard = up.chunk(2, -1)[tp] * (1.5 if tp == 1 else 1.0)
        _write_rank(tmp_path / "b", r, {"dp": (dp, 2), "tp": (tp, 2)}, {"m.up": shard}, {r"up$": "b s h(tp)"})
    div = tdinspect.DumpSet.open(tmp_path / "a").diff(tmp_path / "b", unshard=True).first_divergence()
    assert div.key == "m.up" and not div.structural
    assert "in rank 1 (tp 1 of 2)" in div.reason and "rank 0 (tp 0" not in div.reason, div.reason


def test_copies_with_checksums_are_settled_without_reading(tmp_path):
    """capture(checksum=True): copies whose shards' checksums agree are one read; a copy
    whose checksums differ is named without reading it."""
    up = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(0))
    for r in range(4):
        dp, tp = divmod(r, 2)
        shard = up.chunk(2, -1)[tp]
        entries = {"m.up": shard, "m.bad": shard + (r == 3)}
        _write_rank(tmp_path, r, {"dp": (dp, 2), "tp": (tp, 2)}, entries, {r"": "b s h(tp)"}, checksum=True)
    plans = tdinspect.DumpSet.open(tmp_path).unshard().get_pass(0).plans
    assert plans["m.up"]["op"] == "cat" and [p["src"] for p in plans["m.up"]["parts"]] == [0, 1]
    assert plans["m.bad"]["op"] == "error"
    assert (
        "dp rank 1 differs from dp rank 0: their checksums differ (ranks [2, 3]" in plans["m.bad"]["reason"]
    )
