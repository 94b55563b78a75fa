"""Hugging Face outputs: the KV cache is captured under readable labels, and any output part
that cannot be stored is listed in the sidecar and said once."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import tdinspect
from tdinspect import DumpSet

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_past_key_values_are_captured_per_layer(tmp_path):
    model = _tiny_llama()
    tokens = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with (
        torch.no_grad(),
        tdinspect.capture(model, tmp_path, modules="all", filter=r"^model$", environ={}) as dump,
    ):
        out = model(tokens, use_cache=True)
        dump.step()
    cache_obj = getattr(out, "cache", None) or out.past_key_values  # renamed in transformers 5
    field = "cache" if getattr(out, "cache", None) is not None else "past_key_values"
    ds = DumpSet.open(tmp_path)
    cache = [op for op in ds.ops if op.startswith(f"model[{field}]")]
    assert cache == [f"model[{field}][{i}][{kv}]" for i in range(2) for kv in ("key", "value")], ds.ops
    layers = cache_obj.layers
    assert torch.equal(ds.tensor(f"model[{field}][1][value]"), layers[1].values)
    assert torch.equal(ds.tensor(f"model[{field}][0][key]"), layers[0].keys)


class Opaque:
    """An object a module returns that is neither a tensor nor plain data."""


class ReturnsAnObject(torch.nn.Module):
    def forward(self, x):
        return {"y": x * 2, "handle": Opaque(), "n": 3}


def test_dropped_output_parts_are_listed_in_the_sidecar_and_said_once(tmp_path):
    model = ReturnsAnObject()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with tdinspect.capture(model, tmp_path, modules="all", environ={}) as dump:
            for _ in range(2):
                model(torch.ones(3))
                dump.step()
    said = [str(w.message) for w in seen if "not stored" in str(w.message)]
    assert len(said) == 1 and "model[handle]" in said[0] and "Opaque" in said[0]
    (side,) = sorted(tmp_path.rglob("pass00000.json"))
    assert json.loads(side.read_text())["dropped"] == {"model[handle]": "Opaque"}
    assert DumpSet.open(tmp_path).ops == ["model[y]"]


def test_a_tied_module_that_never_runs_is_named_with_the_one_that_ran(tmp_path):
    """T5's `shared` embedding is never called (the encoder's and decoder's `embed_tokens`
    hold its weight and run): every T5 capture warned "never ran a hooked forward:
    model.shared", as if hooks had been missed. The warning now says whose weights ran."""
    cfg = transformers.T5Config(
        vocab_size=50,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=1,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    ids = torch.randint(2, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.warns(
        RuntimeWarning,
        match=r"never ran a hooked forward: model\.shared \(its "
        r"weights are model\.encoder\.embed_tokens's, which ran\)",
    ):
        with torch.no_grad(), tdinspect.capture(model, tmp_path, environ={}) as dump:
            model(input_ids=ids, decoder_input_ids=ids[:, :2])
            dump.step()
    assert "model.shared" not in DumpSet.open(tmp_path).ops
