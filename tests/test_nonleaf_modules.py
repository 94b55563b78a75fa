"""Modules with parameters of their own that are not leaves are captured (issue 35 case 11).

Mixtral's ``experts`` holds the 3-D expert weights and calls an ``act_fn`` child: with forward
hooks on leaves only, its output was never recorded, and a fault in one expert's weight was named
in the next layer, with no warning. It is now recorded under its dotted name, when it returns
(after its children), and grafting, filters, parameters and compiled capture see it too.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import tdinspect
from tdinspect import DumpSet, load_pass
from tdinspect.dumper.modules import owns_parameters
from tdinspect.examples.port import make_hf_llama, port_tokens

from .conftest import only_folder

pytest.importorskip("transformers")

EXPERTS = "model.model.layers.0.mlp.experts"


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=100,
        max_position_embeddings=64,
    )
    return MixtralForCausalLM(config).eval()


def _capture(model, path, graft=None, **options):
    with torch.no_grad(), tdinspect.capture(model, path, environ={}, **options) as dump:
        g = tdinspect.graft(model, graft, capture=dump) if graft is not None else None
        model(port_tokens(0))
        dump.step()
        if g is not None:
            g.close()
    return path


def _faulty(model, weight: str):
    """``model`` with expert 1's slice of layer 0's ``weight`` (``down_proj``, ``gate_up_proj``)
    1% off: every token routed to expert 1 gets a wrong result."""
    bad = copy.deepcopy(model)
    with torch.no_grad():
        getattr(bad.model.layers[0].mlp.experts, weight)[1] *= 1.01
    return bad


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    model = _mixtral()
    return {
        "model": model,
        "ref": _capture(model, root / "ref"),
        "ref_io": _capture(model, root / "ref_io", record=("inputs", "outputs", "params")),
        "down": _capture(_faulty(model, "down_proj"), root / "down"),
        "gate_up": _capture(_faulty(model, "gate_up_proj"), root / "gate_up"),
    }


def test_an_expert_weight_fault_is_named_at_the_experts_module(mixtral):
    """Before: ``experts`` was not recorded; the fault was named at layer 1's input norm."""
    assert owns_parameters(mixtral["model"].model.layers[0].mlp.experts)
    div = DumpSet.open(mixtral["ref"]).diff(mixtral["down"]).first_divergence()
    assert (div.key, div.pass_) == (EXPERTS, 0)


def test_the_parent_is_recorded_where_it_returns_after_its_children(mixtral):
    """Execution order is the order outputs arrive: ``experts.act_fn`` (called inside
    ``experts``) comes before ``experts``, which comes before the next layer. A fault in the
    weights that feed the child is named at the child, inside ``experts``."""
    keys = list(load_pass(only_folder(mixtral["ref"]) / "pass00000.pt"))
    at = keys.index(EXPERTS)
    assert keys[at - 1] == EXPERTS + ".act_fn"
    assert keys[at + 1] == "model.model.layers.1.input_layernorm"
    div = DumpSet.open(mixtral["ref"]).diff(mixtral["gate_up"]).first_divergence()
    assert div.key == EXPERTS + ".act_fn"


def test_its_own_parameters_and_inputs_are_recorded(mixtral):
    """Before: ``record=("params",)`` never stored the expert weights (no leaf holds them)."""
    keys = set(load_pass(only_folder(mixtral["ref_io"]) / "pass00000.pt"))
    assert {EXPERTS + ".gate_up_proj", EXPERTS + ".down_proj", EXPERTS + "[in][0]"} <= keys


def test_grafted_inputs_name_the_experts_as_the_module_that_makes_the_error(mixtral, tmp_path):
    """Every recorded module fed the reference's inputs: only the experts' own output differs.
    Before, with leaves only, the next layer was fed the reference's values and the fault
    vanished from the grafted run."""
    b = _capture(
        _faulty(mixtral["model"], "down_proj"),
        tmp_path / "b",
        graft=mixtral["ref_io"],
        record=("inputs", "outputs"),
    )
    ranked = DumpSet.open(mixtral["ref_io"]).diff(b).introduced(progress=False)
    assert ranked["module"].iloc[0] == EXPERTS and ranked["error"].iloc[0] > 1e-8
    assert ranked["error"].iloc[1] < 1e-12


def test_a_filter_selects_the_parent_alone(mixtral, tmp_path):
    path = _capture(mixtral["model"], tmp_path / "f", filter=r"experts$")
    assert list(load_pass(only_folder(path) / "pass00000.pt")) == [
        EXPERTS,
        "model.model.layers.1.mlp.experts",
    ]


def test_a_model_of_leaves_is_captured_as_before(tmp_path):
    """A tiny Llama's modules with parameters are all leaves: the hooked modules are exactly
    its leaves, as before."""
    model = make_hf_llama(0)
    with torch.no_grad(), tdinspect.capture(model, tmp_path, environ={}) as dump:
        model(port_tokens(0))
        dump.step()
    leaves = [f"model.{n}" for n, m in model.named_modules() if n and next(m.children(), None) is None]
    assert dump.names == leaves


class _Scaled(nn.Module):
    """A module with a parameter of its own around a child (an expert block in miniature)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 8)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(x @ self.weight) @ self.weight.T


def test_compiled_capture_records_the_parent_as_the_eager_capture_does(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Scaled(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    with torch.no_grad(), tdinspect.capture(model, tmp_path / "eager", environ={}) as dump:
        model(x)
        dump.step()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend="eager")
        with torch.no_grad(), tdinspect.capture(compiled, tmp_path / "graph", environ={}) as dump:
            compiled(x)
            dump.step()
    torch._dynamo.reset()
    assert dump.compile_mode == "graph"
    eager = load_pass(only_folder(tmp_path / "eager") / "pass00000.pt")
    graph = load_pass(only_folder(tmp_path / "graph") / "pass00000.pt")
    assert list(eager) == ["model.0", "model.1.act", "model.1", "model.2"] == list(graph)
    assert all(torch.equal(eager[k], graph[k]) for k in eager)


def test_memory_capture_holds_the_parent(mixtral):
    with torch.no_grad(), tdinspect.capture(mixtral["model"], memory=True, environ={}) as cap:
        mixtral["model"](port_tokens(0))
        cap.step()
    assert EXPERTS in cap.dumpset.ops
