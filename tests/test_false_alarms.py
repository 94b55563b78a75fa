"""Correct runs of real stacks must not read as diverging (issue 35, cases 6-9); a planted
fault in the same layouts is still named. Tiny Hugging Face models with random weights."""

from __future__ import annotations

import os

import pytest
import torch

import tdinspect
from tdinspect.align.dims import zigzag_chunks
from tdinspect.dumper.recorder import Recorder

pytest.importorskip("transformers")

from tdinspect.examples.port import make_hf_llama  # noqa: E402


def _record(root, rank, passes, dims=None, parallel=None):
    """One rank's dump: ``passes`` is a list of ({key: tensor}, TokenLayout or None)."""
    os.environ["RANK"] = str(rank)
    try:
        rec = Recorder(root, level="module", parallel=parallel, dims=dims, background_write=False)
    finally:
        del os.environ["RANK"]
    for entries, layout in passes:
        for key, t in entries.items():
            rec.record(key, t, module_type="LlamaDecoderLayer")
        rec.step(tokens=layout)
    rec.close()


# -- 9: packed THD under context parallelism, zigzag per sequence (Megatron) ------------------
CP = 2
LENGTHS = (8, 12, 4)  # each a multiple of 2 * CP


@pytest.fixture(scope="module")
def thd(tmp_path_factory):
    """A tiny Llama's hidden states of three sequences packed ``[T, h]``: the reference
    (one rank) and a cp=2 run whose rank r holds chunks r and 3-r of every sequence."""
    root = tmp_path_factory.mktemp("thd")
    hf = make_hf_llama(seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        rows = [
            hf(torch.randint(0, 100, (1, n), generator=gen), output_hidden_states=True).hidden_states[1][0]
            for n in LENGTHS
        ]
    packed = torch.cat(rows)
    ref = tdinspect.tokens(seq_lens=list(LENGTHS))
    _record(root / "ref", 0, [({"model.layers.0": packed}, ref)])
    dims = {r"layers\.0$": "t(cp,zigzag) h"}
    for name, fault in (("cp2", None), ("cp2_bad", (1, 2))):  # rank 1, request 2's chunk
        for rank in range(CP):
            shard, positions = [], []
            for request, seq in enumerate(rows):
                chunks = seq.chunk(2 * CP)
                n = len(seq) // (2 * CP)
                for k in zigzag_chunks(rank, CP):
                    part = chunks[k].clone()
                    if fault == (rank, request):
                        part[0, 0] += 1.0
                    shard.append(part)
                    positions += range(k * n, (k + 1) * n)
            layout = tdinspect.tokens(
                request_ids=list(range(len(rows))),
                seq_lens=[n // CP for n in LENGTHS],
                positions=positions,
            )
            _record(
                root / name, rank, [({"model.layers.0": torch.cat(shard)}, layout)], dims, {"cp": (rank, CP)}
            )
    return {k: root / k for k in ("ref", "cp2", "cp2_bad")}


def test_packed_thd_zigzag_per_sequence_reassembles_exactly(thd):
    ref = tdinspect.DumpSet.open(thd["ref"])
    u = tdinspect.DumpSet.open(thd["cp2"]).unshard()
    assert torch.equal(u.tensor("model.layers.0"), ref.tensor("model.layers.0"))
    assert u.get_pass(0).tokens == ref.get_pass(0).tokens  # the ranks' rows put where they belong


def test_packed_thd_zigzag_identical_data_matches(thd):
    ref = tdinspect.DumpSet.open(thd["ref"])
    v = ref.diff(thd["cp2"], unshard=True).verdict()
    assert v.outcome == "matches", v.text
    assert ref.diff(thd["cp2"], unshard=True, tokens=True).verdict().outcome == "matches"


def test_packed_thd_zigzag_fault_is_named_with_its_rank(thd):
    ref = tdinspect.DumpSet.open(thd["ref"])
    div = ref.diff(thd["cp2_bad"], unshard=True).first_divergence()
    assert div is not None and div.key == "model.layers.0"
    assert "rank 1 (cp 1 of 2)" in div.reason and "rank 0 (cp 0" not in div.reason, div.reason
    tok = ref.diff(thd["cp2_bad"], unshard=True, tokens=True).first_divergence()
    assert (tok.key, tok.request) == ("model.layers.0", 2)


def test_packed_thd_zigzag_with_sequences_the_ranks_disagree_on_is_named(tmp_path):
    dims = {r"x$": "t(cp,zigzag) h"}
    for rank, lens in enumerate(([2, 2], [2, 4])):
        layout = tdinspect.tokens(seq_lens=lens)
        _record(tmp_path, rank, [({"m.x": torch.zeros(sum(lens), 3)}, layout)], dims, {"cp": (rank, 2)})
    with pytest.raises(ValueError, match="cp ranks 0 and 1 hold different sequences"):
        tdinspect.DumpSet.open(tmp_path).unshard().tensor("m.x")


# -- 8: a left-padded batch, eager vs SDPA: the pad rows differ, the tokens do not -----------
def _padded_capture(hf, impl, root, ids, mask):
    hf.config._attn_implementation = impl
    with torch.no_grad(), tdinspect.capture(hf, root) as dump:
        hf(ids, attention_mask=mask)
        dump.step(tokens=tdinspect.tokens(attention_mask=mask))
    return tdinspect.DumpSet.open(root)


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded")
    hf = make_hf_llama(seed=0)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    out = {impl: _padded_capture(hf, impl, root / impl, ids, mask) for impl in ("eager", "sdpa")}
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight[0, 0] += 0.5
    out["bad"] = _padded_capture(hf, "sdpa", root / "bad", ids, mask)
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight[0, 0] -= 0.5
        hf.model.layers[0].self_attn.o_proj.weight[0, 0] += 0.5
    out["bad_attn"] = _padded_capture(hf, "sdpa", root / "bad_attn", ids, mask)
    with torch.no_grad():
        hf.model.layers[0].self_attn.o_proj.weight[0, 0] -= 0.5
    right = (ids.clone(), mask.clone())
    right[0][0, :5], right[1][0] = ids[0, 3:], torch.tensor([1] * 5 + [0] * 3)
    out["right"] = _padded_capture(hf, "sdpa", root / "right", *right)
    return out


def test_padding_alone_is_no_divergence_and_differing_layouts_point_to_tokens(padded):
    """The same layout on both sides: the plain diff compares the real token rows only (pads are
    no tokens), so eager against SDPA matches, every token-major entry saying so; differing
    layouts (left against right padding) still diverge, with the hint to line tokens up."""
    d = padded["eager"].diff(padded["sdpa"])
    v = d.verdict()
    assert v.outcome == "matches" and v.compared > 0, v.text
    rows = d.table().set_index("key")
    o_proj = "model.model.layers.0.self_attn.o_proj"
    a, b = padded["eager"].tensor(o_proj), padded["sdpa"].tensor(o_proj)
    assert float((a - b).abs().max()) > 1e-3  # the pad rows differ...
    assert rows.at[o_proj, "rel_diff"] < 1e-12  # ...and the real token rows are what is compared
    d = padded["eager"].diff(padded["sdpa"], tokens=True)
    assert d.verdict(structural="report", allow_uncompared="rotary_emb").outcome == "matches"
    other = padded["eager"].diff(padded["right"]).verdict()  # the same tokens padded on the right
    assert "both dumps carry token layouts and they differ" in other.divergence.reason
    d = padded["eager"].diff(padded["right"], tokens=True)
    assert d.verdict(structural="report", allow_uncompared="rotary_emb").outcome == "matches"


def test_a_fault_under_padding_is_named_and_never_called_padding(padded):
    v = padded["eager"].diff(padded["bad_attn"]).verdict()
    assert v.divergence.key == "model.model.layers.0.self_attn.o_proj"
    assert "pad rows" not in v.divergence.reason and "tokens=True" not in v.divergence.reason
    d = padded["eager"].diff(padded["bad"], tokens=True)
    div = d.verdict(structural="report", allow_uncompared="rotary_emb").divergence
    assert div is not None and div.key == "model.model.layers.1.mlp.down_proj", div


# -- 7: op level with backward, eager vs SDPA attention, align="sequence" ---------------------
def _op_families():
    import transformers as T

    from tdinspect.examples.port import TINY

    one = {**TINY, "num_hidden_layers": 1}
    return {
        "llama": (T.LlamaConfig(**one), T.LlamaForCausalLM, "self_attn.o_proj"),
        "qwen2": (T.Qwen2Config(**one), T.Qwen2ForCausalLM, "self_attn.o_proj"),
        "gpt2": (
            T.GPT2Config(
                n_embd=32, n_layer=1, n_head=4, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0
            ),
            T.GPT2LMHeadModel,
            "attn.c_proj",
        ),
    }


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def ops(request, tmp_path_factory):
    import copy

    config, cls, out_proj = _op_families()[request.param]
    root = tmp_path_factory.mktemp(f"ops_{request.param}")
    torch.manual_seed(0)
    base = cls(config).eval()
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, impl in (("eager", "eager"), ("sdpa", "sdpa"), ("bad", "sdpa")):
        model = copy.deepcopy(base)
        model.config._attn_implementation = impl
        if name == "bad":
            with torch.no_grad():
                model.get_submodule(next(n for n, _ in model.named_modules() if n.endswith(out_proj))).weight[
                    0, 0
                ] += 0.5
        with tdinspect.capture_ops(root / name, model=model) as dump:
            model(ids).logits.sum().backward()
            dump.step()
        out[name] = tdinspect.DumpSet.open(root / name)
    out["out_proj"] = out_proj
    return out


def test_op_level_backward_eager_vs_sdpa_pairs_no_two_different_tensors(ops):
    d = ops["eager"].diff(ops["sdpa"], align="sequence")
    v = d.verdict(structural="report")
    assert v.outcome != "diverges", v.text  # the ops only one side runs are set aside: incomplete
    pa = ops["eager"].get_pass(0)
    backward = {k for k, call in zip(pa.keys, pa.module_call) if call is None}
    t = d.table(progress=False)
    paired = t[t["key_b"].notna() & ~t["structural"]]
    assert len(paired) > 100 and paired["key"].isin(backward).sum() > 40  # backward compared too


def test_op_level_backward_fault_is_still_named(ops):
    div = ops["eager"].diff(ops["bad"], align="sequence").verdict(structural="report").divergence
    assert div is not None and ops["out_proj"] + "/aten." in div.key, div


# -- 6: MoE routing, float32 vs bfloat16: near-tied experts picked in another order ------------
def _mixtral(seed=0):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).eval()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Layer 0's router scores experts 1 and 2 alike: in float32 they differ by 1e-6 of the
    weights (below bfloat16's resolution), in bfloat16 they tie exactly, so the two runs pick
    them in another order or pick the other one. Correct either way."""
    import copy

    root = tmp_path_factory.mktemp("moe")
    base = _mixtral()
    gate = base.model.layers[0].mlp.gate.weight
    with torch.no_grad():
        gate[2] = gate[1] + 1e-6 * torch.randn(gate.shape[1], generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))

    def run(name, model):
        with torch.no_grad(), tdinspect.capture(model, root / name) as dump:
            model(ids)
            dump.step()
        return tdinspect.DumpSet.open(root / name)

    def bf16(fault=None):
        model = copy.deepcopy(base).to(torch.bfloat16)
        g = model.model.layers[0].mlp.gate.weight
        with torch.no_grad():
            g[2] = g[1]  # an exact tie in bfloat16
            if fault == "router":
                g[2] += 0.3
            if fault == "expert":
                model.model.layers[0].mlp.experts.down_proj[0] *= 20
        return model

    out = {"f32": run("f32", base), "bf16": run("bf16", bf16())}
    out["router"] = run("router", bf16("router"))
    out["expert"] = run("expert", bf16("expert"))
    return out


def test_moe_topk_indices_differing_at_near_ties_are_not_a_divergence(moe):
    key = "model.model.layers.0.mlp.gate[2]"
    assert not torch.equal(moe["f32"].tensor(key), moe["bf16"].tensor(key))  # the picks do differ
    d = moe["f32"].diff(moe["bf16"])
    v = d.verdict()
    assert v.outcome == "incomplete", v.text  # never "diverges"; the expert rows are set aside
    row = d.table(progress=False).set_index("key").loc[key]
    assert row["reason"].startswith("compared as tied: ") and row["rel_diff"] == 0.0
    assert "model.model.layers.0.mlp.experts.act_fn" in v.gap and "set aside: routing differs" in v.gap
    assert v.compared > 20


def test_moe_faults_are_still_named(moe):
    div = moe["f32"].diff(moe["router"]).verdict().divergence
    assert div is not None and div.key.startswith("model.model.layers.0.mlp.gate["), div
    # the experts module is recorded (parameters of its own, issue 35 case 11): its per-token
    # output is compared on the tokens both runs route alike, so the expert's fault is named there
    div = moe["f32"].diff(moe["expert"]).verdict().divergence
    assert div is not None and div.key == "model.model.layers.0.mlp.experts", div


def test_topk_picks_that_are_no_tie_stay_a_divergence():
    from tdinspect.compare.routing import tie_resolved

    scores = torch.tensor([[0.5, 0.3, 0.1, 0.0]])
    assert tie_resolved(torch.tensor([[0, 1]]), torch.tensor([[0, 2]]), scores, scores) is None
    near = torch.tensor([[0.5, 0.3, 0.2999, 0.0]], dtype=torch.bfloat16)
    found = tie_resolved(torch.tensor([[0, 1]]), torch.tensor([[0, 2]]), near.float(), near)
    assert found is not None and found[0].tolist() == [[0, 1]]


def test_sequence_islands_are_dropped_only_where_both_sides_differ():
    from difflib import Match

    from tdinspect.compare.pairing import _trusted

    # a one-sided insert before and after a short run (an extra op on A): the run stays paired
    kept = _trusted([Match(0, 0, 5), Match(6, 5, 2), Match(9, 7, 5), Match(14, 12, 0)], 14, 12)
    assert Match(6, 5, 2) in kept
    # the same run with both sides differing just after it: an island, left unmatched
    dropped = _trusted([Match(0, 0, 5), Match(6, 5, 2), Match(9, 8, 5), Match(14, 13, 0)], 14, 13)
    assert Match(6, 5, 2) not in dropped and len(dropped) == 2
