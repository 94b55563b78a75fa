"""Every slice judged: a fault confined to one decode step or one token is not diluted away.

A comparison made of slices (decode calls put end to end by ``concat``, a request's tokens
lined up by ``tokens=True``) applies the divergence rule to each slice as well as to the
whole: a fault of ``1e-3 x mean|out|`` on one position of 127 is 20x past the threshold on
its own and under it averaged over the whole. The correct variants of the same tiny Hugging
Face Llama (SDPA vs eager attention, generate vs one forward, bfloat16 generate vs bfloat16
forward) never diverge.
"""

from __future__ import annotations

import pytest
import torch

import tdinspect
from tdinspect.examples.engine import PackedLlama, capture_engine, capture_reference, engine_prompts
from tdinspect.examples.port import make_hf_llama

transformers = pytest.importorskip("transformers")

PROMPT, NEW = 120, 8
FED = PROMPT + NEW - 1  # generate never feeds its last token back through the model
CAPTURED = r"^model\.model\."  # lm_head runs on the last position only during generate
FAULTY = "model.layers.0.mlp.down_proj"


def _llama(dtype=torch.float32, attn="eager"):
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().to(dtype)


class _OnCall:
    """A forward hook adding ``1e-3 x mean|out|`` to the output of call ``at`` (0-based) only."""

    def __init__(self, at: int, rows=None):
        self.at, self.rows, self.calls = at, rows, 0

    def __call__(self, module, args, out):
        n, self.calls = self.calls, self.calls + 1
        if n != self.at:
            return None
        out = out.clone()
        where = out if self.rows is None else out[:, self.rows]
        where += 1e-3 * out.abs().mean()
        return out


def _generate(model, path, prompt, fault=None):
    handle = model.get_submodule(FAULTY).register_forward_hook(fault) if fault else None
    try:
        with torch.no_grad(), tdinspect.capture(model, path, filter=CAPTURED) as dump:
            tokens = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
            dump.step()
    finally:
        if handle is not None:
            handle.remove()
    return tokens


def _forward(model, path, tokens):
    with torch.no_grad(), tdinspect.capture(model, path, filter=CAPTURED) as dump:
        model(tokens)
        dump.step()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("slices")
    prompt = torch.randint(1, 64, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    eager, sdpa = _llama(), _llama(attn="sdpa")
    tokens = _generate(eager, root / "generate", prompt)
    assert tokens.shape == (1, PROMPT + NEW)
    _generate(eager, root / "faulty", prompt, _OnCall(NEW - 1))  # the last decode call
    _forward(eager, root / "forward", tokens[:, :FED])
    _forward(sdpa, root / "sdpa", tokens[:, :FED])
    _generate(sdpa, root / "generate_sdpa", prompt)
    bf16 = _llama(torch.bfloat16)
    tokens16 = _generate(bf16, root / "generate_bf16", prompt)
    _forward(bf16, root / "forward_bf16", tokens16[:, :FED])
    _forward(eager, root / "forward_f32", tokens16[:, :FED])  # float32 on the bfloat16 run's tokens
    return root


def _open(root, name):
    return tdinspect.DumpSet.open(root / name)


def test_a_fault_on_the_last_decode_step_diverges_naming_its_call_and_position(runs):
    """issue 35 case 4: generate vs one forward with the fault on the last decode call of
    down_proj read "matches" (the one position 21x past the threshold, diluted by 127)."""
    d = _open(runs, "forward").diff(_open(runs, "faulty"), concat="call:1")
    v = d.verdict()
    assert v.outcome == "diverges", v.text
    div = v.divergence
    assert div.key == f"model.{FAULTY}"
    assert f"call {NEW - 1}" in div.reason and f"position {FED - 1}" in div.reason, div.reason
    assert div.value > div.threshold  # the slice's value, past the threshold it is judged by
    whole = d.table(progress=False).set_index("key").loc[f"model.{FAULTY}", "rel_diff"]
    assert whole < div.threshold  # the whole alone is under it: the dilution this rule catches
    pp = d.per_position(f"model.{FAULTY}", dim=1)
    assert pp.attrs["first_position"] == FED - 1


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("forward", "generate"),  # the decode steps against one forward
        ("sdpa", "generate"),  # SDPA forward against an eager generate
        ("forward", "generate_sdpa"),  # eager forward against an SDPA generate
        ("forward_bf16", "generate_bf16"),  # bfloat16 on both sides
        ("forward_f32", "generate_bf16"),  # float32 against bfloat16: its rounding, step by step
    ],
)
def test_correct_decode_runs_never_diverge_slice_by_slice(runs, a, b):
    d = _open(runs, a).diff(_open(runs, b), concat="call:1")
    v = d.verdict()
    assert v.outcome == "matches", v.text
    table = d.table(progress=False)
    assert table["slice_rel_diff"].notna().sum() > 10  # the slices were judged, not skipped


def test_sdpa_forward_against_eager_forward_matches(runs):
    assert _open(runs, "forward").diff(_open(runs, "sdpa")).verdict().outcome == "matches"


# -- tokens=True ----------------------------------------------------------------------------

LENGTHS = (40, 56, 48)
# request 1's last token (position 55) comes alone in the last step
SCHEDULE = [[(0, 40), (1, 30)], [(1, 25), (2, 48)], [(1, 1)]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("slices_tokens")
    hf = make_hf_llama(seed=0)
    prompts = engine_prompts(lengths=LENGTHS)
    capture_reference(hf, prompts, root / "hf")
    capture_engine(PackedLlama(hf), prompts, SCHEDULE, root / "engine")
    engine = PackedLlama(hf)
    handle = engine.model.get_submodule("layers.0.mlp.down_proj").register_forward_hook(_OnCall(2))
    try:
        capture_engine(engine, prompts, SCHEDULE, root / "faulty")
    finally:
        handle.remove()
    hf_eager = make_hf_llama(seed=0)
    hf_eager.config._attn_implementation = "eager"  # the reference with eager attention
    capture_reference(hf_eager, prompts, root / "hf_eager")
    return root


def test_a_fault_on_one_requests_last_token_diverges_naming_request_and_position(served):
    """issue 35 case 4 with tokens=True: one request's last token 19x past the threshold
    read "matches" (diluted by the request's other tokens)."""
    d = _open(served, "hf").diff(_open(served, "faulty"), tokens=True)
    v = d.verdict()
    assert v.outcome == "diverges", v.text
    div = v.divergence
    assert (div.key, div.request, div.position) == ("model.model.layers.0.mlp.down_proj", 1, LENGTHS[1] - 1)
    assert v.text.startswith(
        f"diverges: model.model.layers.0.mlp.down_proj (request 1, position {LENGTHS[1] - 1})"
    )
    whole = d.pass_rows(0, 1).set_index("key").loc["model.model.layers.0.mlp.down_proj", "rel_diff"]
    assert whole < div.threshold < div.value


@pytest.mark.parametrize("ref", ["hf", "hf_eager"])
def test_correct_engines_never_diverge_token_by_token(served, ref):
    """The engine (SDPA, packed, continuous batching) against the reference run one request at
    a time with SDPA or eager attention."""
    d = _open(served, ref).diff(_open(served, "engine"), tokens=True)
    v = d.verdict()
    assert v.outcome == "matches", v.text
    assert d.table(progress=False)["slice_rel_diff"].notna().any()


# -- rows paired along a checksum dim ---------------------------------------------------------


def test_a_fault_on_one_row_of_a_batch_paired_along_its_checksum_dim_diverges(tmp_path):
    """capture(checksum_dim=0): a batch of 4 against a batch of 3 compares their 3 common rows;
    a fault on one of them, 2x past the threshold on its own, is under it over the 3 rows."""
    from .test_batch_invariance import _capture, _model

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    thr = 1.49e-8  # float32's "auto" rel_diff threshold, u/4

    def fault(module, args, out):
        out = out.clone()
        row = out[1]
        row += (2 * thr * 2 * row.square().sum() / row.numel()).sqrt()  # row's rel_diff ~ 2 thr
        return out

    _capture(_model(False), tmp_path / "four", x, stats_only=False, checksum_dim=0)
    model = _model(False)
    handle = model[2].register_forward_hook(fault)
    try:
        _capture(model, tmp_path / "three", x[:3], stats_only=False, checksum_dim=0)
    finally:
        handle.remove()
    d = tdinspect.DumpSet.open(tmp_path / "four").diff(tmp_path / "three")
    v = d.verdict()
    assert v.outcome == "diverges", v.text
    assert v.divergence.op == "model.2" and "in a slice" in v.divergence.reason, v.divergence.reason
    row = d.table(progress=False).set_index("key").loc["model.2"]
    assert row["rel_diff"] < v.divergence.threshold < row["slice_rel_diff"]
    assert tdinspect.DumpSet.open(tmp_path / "four").diff(tmp_path / "four").verdict().outcome == "matches"
