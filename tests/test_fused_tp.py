"""Fused tensor-parallel shards (issue 29): a dim made of segments each sharded on its own.

A fused GQA ``qkv`` under TP holds per rank ``[q_r | k_r | v_r]``; unsharded rank after
rank it is ``[q0 k0 v0 q1 k1 v1]``, not the model's ``[q | k | v]``. The ``fused=`` dims
put it back segment by segment. Real runs: a tiny Hugging Face Llama (GQA: 4 heads, 2
key/value heads) and its TP=2 port with fused ``qkv`` and ``gate_up``, two processes in a
``gloo`` group (:func:`tdinspect.examples.port_tp.capture_tp_port`).
"""

from __future__ import annotations

import pytest
import torch

import tdinspect
from tdinspect.align.dims import parse_dims
from tdinspect.errors import DimsError

from .test_unshard import _write_rank

pytest.importorskip("transformers")

from tdinspect.examples.port import make_hf_llama  # noqa: E402
from tdinspect.examples.port_tp import capture_hf, capture_tp_port, hf_port_mapping  # noqa: E402

QKV = "b s h(tp,fused=q:32,k:16,v:16)"


# -- the grammar ----------------------------------------------------------------------------
def test_fused_dims_read_segments_in_either_spelling():
    d = parse_dims("b s h(tp, fused=q:32,k:16,v:16)").dims[2]  # a space inside the parentheses
    assert d.axes == ("tp",) and d.fused == (("q", 32), ("k", 16), ("v", 16)) and not d.per_rank
    assert d.segments(2, 32) == [("q", 0, 16), ("k", 16, 8), ("v", 24, 8)]
    r = parse_dims("b s h(tp,fused_per_rank=q:16,k:8,v:8)").dims[2]
    assert r.per_rank and r.segments(2, 32) == d.segments(2, 32)
    assert parse_dims(QKV).fused() == {"h": (("q", 32), ("k", 16), ("v", 16))}
    with pytest.raises(DimsError, match=r"adds up to 64, the 2 rank\(s\) hold 24 each"):
        d.segments(2, 24)
    with pytest.raises(DimsError, match="'q' does not split into 3 equal shards"):
        parse_dims("h(tp,fused=q:32,k:16)").dims[0].segments(3, 16)


# -- unshard from written ranks ----------------------------------------------------------------
def _write_ranks(root, entries_by_rank: list[dict], dims: dict):
    for rank, entries in enumerate(entries_by_rank):
        _write_rank(root, rank, {"tp": (rank, 2)}, entries, dims)


def _qkv_shards(gen):
    q, k, v = (torch.randn(1, 3, n, generator=gen) for n in (32, 16, 16))
    shards = [torch.cat([t.chunk(2, -1)[r] for t in (q, k, v)], -1) for r in range(2)]
    return torch.cat([q, k, v], -1), shards


@pytest.mark.parametrize("spec", [QKV, "b s h(tp,fused_per_rank=q:16,k:8,v:8)"], ids=["whole", "per-rank"])
def test_fused_shards_unshard_to_the_whole_models_layout(tmp_path, spec):
    whole, shards = _qkv_shards(torch.Generator().manual_seed(0))
    _write_ranks(tmp_path, [{"m.qkv": s} for s in shards], {r"\.qkv$": spec})
    u = tdinspect.DumpSet.open(tmp_path).unshard()
    assert torch.equal(u.tensor("m.qkv"), whole)
    # plain h(tp) gives rank after rank: not the model's layout
    plain = tdinspect.DumpSet.open(tmp_path, dims={r"\.qkv$": "b s h(tp)"}).unshard()
    assert not torch.equal(plain.tensor("m.qkv"), whole)


def test_fused_widths_that_do_not_fit_name_the_entry_and_the_dims(tmp_path):
    _, shards = _qkv_shards(torch.Generator().manual_seed(0))
    bad = "b s h(tp,fused=q:32,k:16,v:8)"
    _write_ranks(tmp_path, [{"m.qkv": s} for s in shards], {r"\.qkv$": bad})
    u = tdinspect.DumpSet.open(tmp_path).unshard()
    with pytest.raises(ValueError) as err:
        u.tensor("m.qkv")
    assert "m.qkv" in str(err.value) and repr(bad) in str(err.value) and "adds up to 56" in str(err.value)
    row = tdinspect.DumpSet.open(tmp_path).diff(tmp_path, unshard=True).plan().iloc[0]  # before reading
    assert row["status"].startswith(f"A: m.qkv: dims {bad!r}: fused=q:32,k:16,v:8 adds up to 56"), row[
        "status"
    ]


# -- a real TP=2 port with fused qkv and gate_up ---------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fusedtp")
    return {
        "hf": capture_hf(root / "hf"),
        "tp1": capture_tp_port(root / "tp1", size=1),
        "tp2": capture_tp_port(root / "tp2", size=2),
        "bad": capture_tp_port(root / "bad", size=2, fault=(1, "k")),
        "plain": capture_tp_port(root / "plain", size=2, fused=False),
    }


@pytest.fixture(scope="module")
def mapping():
    return hf_port_mapping(make_hf_llama().config)


def test_plan_shows_the_segment_layout_before_reading(runs):
    d = tdinspect.DumpSet.open(runs["tp1"]).diff(runs["tp2"], unshard=True)
    plan = d.plan().set_index("a_key")
    assert plan.loc["model.blocks.0.attn.qkv", "assembled_b"] == (
        "fused(dim 2: q 0..32 = rank 0 (tp 0 of 2) 0..16 + rank 1 (tp 1 of 2) 0..16; "
        "k 32..48 = rank 0 (tp 0 of 2) 16..24 + rank 1 (tp 1 of 2) 16..24; "
        "v 48..64 = rank 0 (tp 0 of 2) 24..32 + rank 1 (tp 1 of 2) 24..32)"
    )
    assert plan.loc["model.blocks.1.ffn.gate_up", "assembled_b"].startswith(
        "fused(dim 2: gate 0..64 = rank 0 (tp 0 of 2) 0..32 + rank 1 (tp 1 of 2) 0..32; up 64..128"
    )
    assert (plan["status"] == "ok").all()
    assert d.passes_read == []


def test_correct_tp2_port_matches_tp1_and_hf(runs, mapping):
    tp1 = tdinspect.DumpSet.open(runs["tp1"])
    d = tp1.diff(runs["tp2"], unshard=True)
    assert d.verdict().outcome == "matches"
    u = tdinspect.DumpSet.open(runs["tp2"]).unshard()
    for key in ("model.blocks.0.attn.qkv", "model.blocks.1.ffn.gate_up"):
        torch.testing.assert_close(u.tensor(key), tp1.tensor(key))
    hf = tdinspect.DumpSet.open(runs["hf"])
    d = hf.diff(runs["tp2"], unshard=True, mapping=mapping)
    verdict = d.verdict(structural="report", allow_uncompared=r"rotary_emb|act_fn")  # HF's own entries
    assert verdict.outcome == "matches", verdict
    table = d.table(progress=False)
    compared = table[~table["structural"]].set_index("op")
    for name in ("q_proj", "k_proj", "v_proj"):  # cut out of the unsharded fused qkv
        assert compared.loc[f"model.model.layers.1.self_attn.{name}", "rel_diff"] < 1e-10
    for name in ("gate_proj", "up_proj"):
        assert compared.loc[f"model.model.layers.1.mlp.{name}", "rel_diff"] < 1e-10
    assert set(table[table["structural"]]["op"]) == {
        "model.model.rotary_emb[0]",
        "model.model.rotary_emb[1]",
        "model.model.layers.0.mlp.act_fn",
        "model.model.layers.1.mlp.act_fn",
    }


def test_a_bug_in_rank1s_k_segment_is_named_with_module_rank_and_segment(runs, mapping):
    div = tdinspect.DumpSet.open(runs["tp1"]).diff(runs["bad"], unshard=True).first_divergence()
    assert div.key == "model.blocks.0.attn.qkv"
    assert "in rank 1 (tp 1 of 2) k: rel_diff" in div.reason and "rank 0 (tp 0" not in div.reason, div.reason
    div = tdinspect.DumpSet.open(runs["hf"]).diff(runs["bad"], unshard=True, mapping=mapping)
    div = div.first_divergence(structural="report")
    assert div.key == "model.model.layers.0.self_attn.k_proj"  # q_proj, before it, matches
    assert "rank 1 (tp 1 of 2) k" in div.reason and "rank 0 (tp 0" not in div.reason, div.reason


def test_fused_shards_without_fused_dims_are_hinted_with_the_dims_to_give(runs):
    div = tdinspect.DumpSet.open(runs["tp1"]).diff(runs["plain"], unshard=True).first_divergence()
    assert div.key == "model.blocks.0.attn.qkv" and div.value > 0.1  # every value right, misplaced
    assert "rank 0 (tp 0 of 2): rel_diff" in div.reason and "rank 1 (tp 1 of 2): rel_diff" in div.reason
    assert "3 segments" in div.reason and "(whole widths 32, 16, 16)" in div.reason, div.reason
    suggested = "b s h(tp,fused=s0:32,s1:16,s2:16)"
    assert repr(suggested) in div.reason
    # the dims it suggests (and the same for gate_up) settle it
    fixed = tdinspect.DumpSet.open(
        runs["plain"], dims={r"\.qkv$": suggested, r"\.gate_up$": "b s f(tp,fused=gate:64,up:64)"}
    )
    assert tdinspect.DumpSet.open(runs["tp1"]).diff(fixed, unshard=True).first_divergence() is None


def test_two_runs_fused_alike_compare_shard_by_shard(runs):
    """TP=2 against TP=2: each rank's shard meets its partner whole (no strided segment
    views); the numbers are those of the assembled tensors, the fault still named."""
    from tdinspect.numerics.metrics import compare_tensors

    d = tdinspect.DumpSet.open(runs["tp2"]).diff(runs["bad"], unshard=True)
    div = d.first_divergence()
    assert div.key == "model.blocks.0.attn.qkv"
    assert "in rank 1 (tp 1 of 2) k: rel_diff" in div.reason and "rank 0 (tp 0" not in div.reason, div.reason
    table = d.table(progress=False).set_index("op")
    for key in ("model.blocks.0.attn.qkv", "model.blocks.1.ffn.gate_up"):
        want = compare_tensors(d.b.tensor(key), d.a.tensor(key))
        assert table.loc[key, "max_abs"] == want["max_abs"]
        assert table.loc[key, "rel_diff"] == pytest.approx(want["rel_diff"], rel=1e-9, abs=1e-300)


def test_through_a_mapping_the_references_cuts_hint_the_fused_layout(runs, mapping):
    """HF against the port with plain h(tp) dims: the rule for q_proj cuts rank 0's whole
    shard (only rank 0 is blamed); the cuts the reference takes of qkv (q_proj, k_proj,
    v_proj) tile it, and each rank holds their sum / 2: the hint gives the fused dims."""
    hf = tdinspect.DumpSet.open(runs["hf"])
    div = hf.diff(runs["plain"], unshard=True, mapping=mapping).first_divergence(structural="report")
    assert div.key == "model.model.layers.0.self_attn.q_proj"
    assert "the reference cuts it into q_proj 0..32, k_proj 32..48, v_proj 48..64" in div.reason, div.reason
    suggested = "b s h(tp,fused=q_proj:32,k_proj:16,v_proj:16)"
    assert "each rank holds 32 = their sum / 2" in div.reason and repr(suggested) in div.reason
    fixed = tdinspect.DumpSet.open(
        runs["plain"], dims={r"\.qkv$": suggested, r"\.gate_up$": "b s f(tp,fused=gate_proj:64,up_proj:64)"}
    )
    verdict = hf.diff(fixed, unshard=True, mapping=mapping).verdict(
        structural="report", allow_uncompared=r"rotary_emb|act_fn"
    )
    assert verdict.outcome == "matches", verdict


def test_cuts_are_read_from_the_rules_transforms():
    from tdinspect.align import parse_transform
    from tdinspect.align.fusedhint import cut_of, cuts_hint

    assert cut_of(parse_transform("narrow(-1, 32, 16)"), 64, 2, 3) == (32, 16)
    assert cut_of(parse_transform("chunk(2, -1)[1]"), 64, 2, 3) == (32, 32)
    assert cut_of(parse_transform("reshape(2, 32)"), 64, 2, 3) is None  # not a cut along the dim
    cuts = {"m.q_proj": (0, 32), "m.k_proj": (32, 16), "m.v_proj": (48, 16)}
    assert "'b s h(tp,fused=q_proj:32,k_proj:16,v_proj:16)'" in cuts_hint(cuts, 2, 32, 2, "b s h(tp)")
    assert cuts_hint({"m.q_proj": (0, 32), "m.k_proj": (40, 24)}, 2, 32, 2, "b s h(tp)") == ""  # a gap
    assert cuts_hint({"m.q_proj": (0, 64)}, 2, 32, 2, "b s h(tp)") == ""  # one segment: plain tp


def test_suggested_mapping_finds_q_k_v_in_the_unsharded_fused_qkv(runs):
    """Unsharded with fused dims, the port's qkv is the model's [q | k | v]: suggest_mapping
    cuts k_proj and v_proj out of it by values, and its rules match."""
    hf = tdinspect.DumpSet.open(runs["hf"])
    rules = tdinspect.suggest_mapping(hf, tdinspect.DumpSet.open(runs["tp2"]).unshard()).rules
    layer = r"model\.model\.layers\.(\d+)\."
    assert rules[layer + r"self_attn\.k_proj"] == [r"model.blocks.\1.attn.qkv", "chunk(4, -1)[2]"]
    assert rules[layer + r"mlp\.up_proj"] == [r"model.blocks.\1.ffn.gate_up", "chunk(2, -1)[1]"]
    verdict = hf.diff(runs["tp2"], unshard=True, mapping=rules).verdict(
        structural="report", allow_uncompared=r"rotary_emb|act_fn"
    )
    assert verdict.outcome == "matches", verdict
