"""What a new user met on the merged release, tried on tiny Hugging Face models (random weights)."""

from __future__ import annotations

import pytest
import torch

import tdinspect
from tdinspect import DumpSet

transformers = pytest.importorskip("transformers")


def _qwen2():
    cfg = transformers.Qwen2Config(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def _padded_batch():
    """Two prompts (6 and 9 tokens) left-padded to 9."""
    torch.manual_seed(1)
    seqs = [torch.randint(0, 100, (n,)) for n in (6, 9)]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, 9 - len(s) :] = s
        mask[i, 9 - len(s) :] = 1
    return ids, mask


def _capture(model, path, ids, mask):
    with torch.no_grad(), tdinspect.capture(model, path) as dump:
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        dump.step(tokens=tdinspect.tokens(attention_mask=mask))
    return DumpSet.open(path)


def test_padded_plain_diff_names_a_fault_in_one_real_token_row(tmp_path):
    """A padded batch compared plainly (pads left out) judges each real token row too: a fault
    in one real token (request 0, position 5) of ``layers.1.mlp.down_proj``, diluted below the
    threshold over the 15 real rows, used to read "matches" (``tokens=True`` on the same dumps
    named it), and the hint then said the divergence was the pads'. Eager against SDPA (pads
    filled differently) still matches."""
    model = _qwen2()
    ids, mask = _padded_batch()
    ref = _capture(model, tmp_path / "eager", ids, mask)

    def one_row(module, args, out):
        out = out.clone()
        out[0, 8] *= 1.0006  # request 0's last real token (position 5)
        return out

    model.set_attn_implementation("sdpa")
    assert ref.diff(_capture(model, tmp_path / "sdpa", ids, mask)).verdict().outcome == "matches"
    hook = model.model.layers[1].mlp.down_proj.register_forward_hook(one_row)
    try:
        faulty = _capture(model, tmp_path / "fault", ids, mask)
    finally:
        hook.remove()
    assert ref.diff(faulty, tokens=True).verdict().outcome == "diverges"
    verdict = ref.diff(faulty).verdict()
    assert verdict.outcome == "diverges"
    assert verdict.divergence.op == "model.model.layers.1.mlp.down_proj"
    assert "in request 0's real token rows" in verdict.text and "position 5" in verdict.text
    assert "pad rows only" not in verdict.text


def test_padded_moe_flattened_token_rows_leave_their_pads_out(tmp_path):
    """A Qwen2-MoE block flattens the batch (``[b*s, h]``: its router, shared expert and experts'
    output): those rows are the layout's token rows in row-major order (as ``tokens=True`` reads
    them), so a plain diff of a left-padded batch compares them on real tokens too. Eager against
    SDPA (pads filled differently) used to diverge at ``shared_expert.gate_proj`` (rel_diff 6e-3,
    pads alone); now only the experts' inner rows, gathered by the routing (``[b*s*k, ...]``, no
    token's rows), are left to differ. A fault in one token of the shared expert (flattened row
    8) read "matches"; it is named with its request and position."""
    model = _tiny_qwen_moe()
    ids, mask = _padded_batch()
    ref = _capture(model, tmp_path / "eager", ids, mask)

    def one_token(module, args, out):  # flattened row 8: request 0's last token (position 5)
        return out.index_put((torch.tensor([8]),), out[8] * 1.0006)

    hook = model.model.layers[1].mlp.shared_expert.down_proj.register_forward_hook(one_token)
    try:
        verdict = ref.diff(_capture(model, tmp_path / "fault", ids, mask)).verdict()
    finally:
        hook.remove()
    assert verdict.outcome == "diverges"  # before: "matches", the fault diluted by the pads and the batch
    assert verdict.divergence.op == "model.model.layers.1.mlp.shared_expert.down_proj"
    assert "request 0's real token rows" in verdict.text and "position 5" in verdict.text
    model.set_attn_implementation("sdpa")
    diff = ref.diff(_capture(model, tmp_path / "sdpa", ids, mask))
    flagged = set(diff.divergences()["op"])
    assert not {op for op in flagged if not op.endswith("mlp.experts.act_fn")}, flagged


def test_padded_batch_against_one_request_at_a_time_points_to_tokens(tmp_path):
    """A padded batch against the same prompts run one at a time, both with token layouts, in a
    plain diff: the shapes differ ([2, 9, 32] vs [1, 6, 32]) and the answer said only that; it
    now says the layouts differ and that ``tokens=True`` lines them up (which then matches)."""
    model = _qwen2()
    ids, mask = _padded_batch()
    ref = _capture(model, tmp_path / "batch", ids, mask)
    with torch.no_grad(), tdinspect.capture(model, tmp_path / "one") as dump:
        for i in range(2):
            real = ids[i][mask[i].bool()]
            model(real[None])
            dump.step(tokens=tdinspect.tokens(request_ids=[i], seq_lens=[len(real)], shape=(1, len(real))))
    verdict = ref.diff(tmp_path / "one").verdict()
    assert verdict.outcome == "diverges" and "shape [2, 9, 32] vs [1, 6, 32]" in verdict.text
    assert "tokens=True lines them up" in verdict.text
    assert ref.diff(tmp_path / "one", tokens=True).verdict().outcome == "matches"


# -- a correct MoE run against its bfloat16 and one-request-at-a-time variants, tokens=True ------
@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory):
    """A tiny Qwen2-MoE (random weights): a left-padded batch of two prompts in float32, the same
    in bfloat16, and the prompts one request at a time."""
    import copy

    root = tmp_path_factory.mktemp("qwen_moe")
    model = _tiny_qwen_moe()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 100, (n,), generator=gen) for n in (6, 9)]
    ids, mask = torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, 9 - len(s) :], mask[i, 9 - len(s) :] = s, 1
    position = (mask.cumsum(-1) - 1).clamp(min=0)

    def batch(m, name):
        with torch.no_grad(), tdinspect.capture(m, root / name) as dump:
            m(ids, attention_mask=mask, position_ids=position)
            dump.step(tokens=tdinspect.tokens(attention_mask=mask))
        return tdinspect.DumpSet.open(root / name)

    def one_at_a_time(m, name):
        with torch.no_grad(), tdinspect.capture(m, root / name) as dump:
            for i, s in enumerate(seqs):
                m(s[None])
                dump.step(tokens=tdinspect.tokens(request_ids=[i], seq_lens=[len(s)], shape=(1, len(s))))
        return tdinspect.DumpSet.open(root / name)

    return {
        "f32": batch(model, "f32"),
        "bf16": batch(copy.deepcopy(model).to(torch.bfloat16), "bf16"),
        "one": one_at_a_time(model, "one"),
    }


def test_a_per_token_gate_near_zero_is_judged_at_the_entrys_scale(qwen_moe):
    """float32 against bfloat16 with tokens=True: the shared expert's gate is one value per token;
    a slice that small, near 0, read its own roundings as 1.3x bfloat16's threshold (a false
    alarm). Each slice's energy is now at least its share of the pair's: no alarm; the experts'
    rows gathered by the routing are set aside, never compared (incomplete, never diverges)."""
    v = qwen_moe["f32"].diff(qwen_moe["bf16"], tokens=True).verdict()
    assert v.outcome != "diverges", v.text
    assert v.outcome == "matches" or "not token-major" in v.gap, v.text
    assert v.compared > 0


def test_entries_token_major_on_neither_side_are_set_aside_not_a_divergence(qwen_moe):
    """A batch against one request at a time: the experts' activations ([tokens * k, ...], rows
    gathered by the routing) are token-major on neither side: "incomplete" with that reason (it
    read "diverges ... (set aside, not compared)", an outcome contradicting its own reason);
    allowing them by name gives "matches"."""
    d = qwen_moe["f32"].diff(qwen_moe["one"], tokens=True)
    v = d.verdict()
    assert v.outcome == "incomplete" and "not token-major" in v.gap, v.text
    assert d.verdict(allow_uncompared=r"experts\.act_fn").outcome == "matches"


def _tiny_qwen_moe():
    """A tiny Qwen2-MoE built from its config (random weights, seed 0), eager attention."""
    import transformers

    cfg = transformers.Qwen2MoeConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
