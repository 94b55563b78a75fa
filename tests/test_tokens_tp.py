"""The serving-engine case in full (issue 29): a port served packed with continuous batching
and fused TP=2 shards (two processes in a real ``gloo`` group), against the Hugging Face
model run one request at a time, lined up by (request, position) once the ranks are
unsharded and the names mapped (tdinspect.examples.engine_tp)."""

from __future__ import annotations

import pytest
import torch

import tdinspect

pytest.importorskip("transformers")

from tdinspect.examples.engine import CONTINUOUS, capture_reference, engine_prompts  # noqa: E402
from tdinspect.examples.engine_tp import TPPackedLlama, capture_tp_engine  # noqa: E402
from tdinspect.examples.port import make_hf_llama  # noqa: E402
from tdinspect.examples.port_tp import hf_port_mapping  # noqa: E402

HF_ONLY = r"rotary_emb|act_fn"  # the reference's entries the port has no module for


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens_tp")
    hf = make_hf_llama(seed=0)
    return {
        "hf": tdinspect.DumpSet.open(capture_reference(hf, engine_prompts(), root / "hf")),
        "tp2": capture_tp_engine(root / "tp2"),
        "bad": capture_tp_engine(root / "bad", bug=(1, 1, 6)),  # rank 1, request 1, positions >= 6
        "mapping": hf_port_mapping(hf.config),
    }


def test_one_rank_of_the_packed_engine_computes_what_hf_does():
    hf = make_hf_llama(seed=0)
    engine = TPPackedLlama.from_hf(hf)  # size 1: no group
    prompts = engine_prompts()
    with torch.no_grad():
        step = [(0, 3), (1, 6)]
        ids = torch.cat([prompts[r][:n] for r, n in step])
        request = torch.cat([torch.full((n,), r) for r, n in step])
        position = torch.cat([torch.arange(n) for _, n in step])
        logits = engine(ids, request, position)
        torch.testing.assert_close(logits[0, 3:], hf(prompts[1][None, :6]).logits[0])


def test_each_rank_records_its_steps_token_layouts_and_fused_dims(runs):
    tp2 = tdinspect.DumpSet.open(runs["tp2"])
    assert tp2.ranks == [0, 1] and len(tp2.passes) == len(CONTINUOUS)
    for rank in (0, 1):
        pi = tp2.get_pass(1, rank)
        assert pi.tokens.segments == ((0, 3, 1), (1, 6, 1), (2, 0, 12))
        assert pi.dims[pi.position["model.blocks.0.attn.qkv"]] == "b s h(tp,fused=q:32,k:16,v:16)"
        assert pi.dims[pi.position["model.blocks.0.ffn.down"]] == "b s h(tp,partial)"


def test_a_correct_tp_engine_matches_hf_by_token(runs):
    d = runs["hf"].diff(runs["tp2"], tokens=True, unshard=True, mapping=runs["mapping"])
    assert str(d.tokens.requests[1]) == (
        "request 1: positions 0..8 (9): A pass 1 rows 0..8 | "
        "B pass 0 rows 3..8, pass 1 row 1, pass 2 row 1, pass 3 row 0"
    )
    assert d.passes_read == []  # the plan is the sidecars' alone
    v = d.verdict(structural="report", allow_uncompared=HF_ONLY)
    assert v.outcome == "matches", v.text
    assert v.compared == 3 * 21  # every mapped entry of every request, q/k/v and gate/up cut from the fused
    # not by luck: without unsharding or without tokens they do not even line up
    with pytest.raises(tdinspect.errors.AlignError, match="add unshard=True"):
        runs["hf"].diff(runs["tp2"], tokens=True, mapping=runs["mapping"])
    assert runs["hf"].diff(runs["tp2"], unshard=True, mapping=runs["mapping"]).verdict().outcome == "diverges"


def test_a_bug_on_rank1_is_named_by_module_rank_request_and_position(runs):
    d = runs["hf"].diff(runs["bad"], tokens=True, unshard=True, mapping=runs["mapping"])
    div = d.first_divergence(structural="report")
    assert (div.key, div.request, div.position) == ("model.model.layers.0.self_attn.k_proj", 1, 6)
    assert "in rank 1 (tp 1 of 2) k: rel_diff" in div.reason and "rank 0 (tp 0" not in div.reason, div.reason
    assert "B pass 1 row 1" in div.reason  # the engine step and row where position 6 ran
    text = d.verdict(structural="report").text
    assert text.startswith("diverges: model.model.layers.0.self_attn.k_proj (request 1, position 6)")
    assert "rank 1 (tp 1 of 2)" in text
    pp = d.per_position("model.model.layers.0.self_attn.k_proj")
    thr = pp.attrs["threshold"]
    one = pp.sel(request=1, call=0)
    assert (one.sel(position=slice(0, 5)) <= thr).all() and (one.sel(position=slice(6, 8)) > thr).all()
    assert (pp.sel(request=[0, 2]).fillna(0) <= thr).all()
