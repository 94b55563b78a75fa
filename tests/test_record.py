"""What capture records besides module outputs: inputs, parameters, gradients."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import tdinspect
from tdinspect import ConfigError, DumpConfig, DumpSet, load_pass, parse_key
from tdinspect.examples.models import make_model, make_tokens

from .conftest import only_folder

WEIGHT = "layers.2.mlp.down.weight"


def capture_run(path, *, record, scale=1.0, steps=1, **kwargs):
    model = make_model(seed=0)
    with torch.no_grad():
        model.get_parameter(WEIGHT).mul_(scale)
        with tdinspect.capture(model, path, record=record, environ={}, **kwargs) as dump:
            for step in range(steps):
                model(make_tokens(seed=step))
                dump.step()
    return path


def sidecar(path, index=0):
    return json.loads((only_folder(path) / f"pass{index:05d}.json").read_text())["entries"]


def test_inputs_params_outputs_names_kinds_and_values(tmp_path):
    run = capture_run(tmp_path / "a", record=("inputs", "outputs", "params"), steps=2)
    e = sidecar(run)
    keys = e["key"]
    # per module, in execution order: its parameters (first call), its inputs, its outputs
    assert keys[:6] == [
        "model.embed.weight",
        "model.embed[in][0]",
        "model.embed",
        "model.layers.0.ln1.weight",
        "model.layers.0.ln1.bias",
        "model.layers.0.ln1[in][0]",
    ]
    kinds = dict(zip(keys, e["kind"]))
    assert kinds["model.embed.weight"] == "param" and kinds["model.embed[in][0]"] == "input"
    assert kinds["model.embed"] == "output"
    # the expert runs three times: three inputs and outputs, its parameters once
    assert [k for k in keys if k.startswith("model.expert")] == [
        "model.expert.weight",
        "model.expert.bias",
        "model.expert[in][0]",
        "model.expert",
        "model.expert[in][0]::call1",
        "model.expert::call1",
        "model.expert[in][0]::call2",
        "model.expert::call2",
    ]
    for key in keys:
        parse_key(key)  # every name follows the grammar
    assert parse_key("model.expert[in][0]::call2").labels == ("in", "0")
    tensors = load_pass(only_folder(run) / "pass00000.pt")
    model = make_model(seed=0)
    assert torch.equal(tensors["model.embed[in][0]"], make_tokens(seed=0))
    assert torch.equal(tensors["model.lm_head.weight"], model.lm_head.weight.detach())
    # an input is what the previous module gave
    assert torch.equal(
        tensors["model.expert[in][0]::call1"], tensors["model.expert[in][0]"] + 0.1 * tensors["model.expert"]
    )
    # pass 1: parameters did not change, so they are references to pass 0, not copies
    e1 = sidecar(run, 1)
    i = e1["key"].index("model.lm_head.weight")
    assert e1["stored"][i] is False
    assert e1["ref"][i] == {"kind": "same", "of": "model.lm_head.weight", "pass": 0}
    assert e1["stats"][i] == e["stats"][keys.index("model.lm_head.weight")]
    assert "model.lm_head.weight" not in load_pass(only_folder(run) / "pass00001.pt")
    ds = DumpSet.open(run)
    assert torch.equal(ds.tensor("model.lm_head.weight", pass_=1), model.lm_head.weight.detach())


def test_default_records_outputs_only_and_writes_no_kind_column(tmp_path):
    run = capture_run(tmp_path / "a", record=None)
    e = sidecar(run)
    assert "kind" not in e and not any("[in]" in k or k.endswith(".weight") for k in e["key"])


def test_keyword_inputs_are_recorded_by_name(tmp_path):
    class Gate(torch.nn.Module):
        def forward(self, x, *, scale, mask=None):
            return x * scale * mask

    model = torch.nn.Sequential()
    model.add_module("gate", Gate())
    x, mask = torch.randn(3), torch.tensor([1.0, 0.0, 1.0])
    with tdinspect.capture(model.gate, tmp_path, record="inputs,outputs", environ={}) as dump:
        model.gate(x, scale=2.0, mask=mask)
        dump.step()
    tensors = load_pass(only_folder(tmp_path) / "pass00000.pt")
    assert list(tensors) == ["model[in][0]", "model[in][mask]", "model"]
    assert torch.equal(tensors["model[in][mask]"], mask)


def test_record_from_the_environment_and_bad_values(tmp_path):
    cfg = DumpConfig().with_env({"TDINSPECT_DUMP_RECORD": "params, outputs"})
    assert cfg.record == ("outputs", "params")
    cfg = DumpConfig().with_env({"PHYAI_DEBUG_TENSOR_DUMP_RECORD": "grads"})
    assert cfg.record == ("grads",)
    with pytest.raises(ConfigError, match=r"TDINSPECT_DUMP_RECORD='outputs,weights'.*unknown: weights"):
        DumpConfig().with_env({"TDINSPECT_DUMP_RECORD": "outputs,weights"})
    with pytest.raises(ConfigError, match="record=.*expected one or more of inputs, outputs"):
        tdinspect.capture(make_model(), tmp_path, record=(), environ={})
    # the environment overrides the argument
    model = make_model()
    with (
        torch.no_grad(),
        tdinspect.capture(
            model, tmp_path / "e", record="outputs", environ={"TDINSPECT_DUMP_RECORD": "params"}
        ) as dump,
    ):
        model(make_tokens())
        dump.step()
    assert set(sidecar(tmp_path / "e")["kind"]) == {"param"}


def test_changed_weight_is_the_first_divergence_with_params(tmp_path):
    a = capture_run(tmp_path / "a", record=("params", "outputs"), steps=2)
    b = capture_run(tmp_path / "b", record=("params", "outputs"), scale=1.01, steps=2)
    diff = DumpSet.open(a).diff(b)
    div = diff.first_divergence(metric="equal")
    assert div.key == f"model.{WEIGHT}" and div.pass_ == 0
    # the same parameter in pass 1 refers to pass 0 on both sides: not compared twice
    rows = diff.table(progress=False).set_index(["pass", "key"])
    assert rows.loc[(1, f"model.{WEIGHT}"), "reason"] == "unchanged since pass 0 (compared there)"
    # without params, the first divergence is the module that weight feeds
    out_only = DumpSet.open(a).filter(r"^(?!.*\.(weight|bias)$)").diff(b)
    assert out_only.first_divergence(metric="equal").key == "model.layers.2.mlp.down"


def train_step(path, reg, steps=2):
    """Forward, backward and an SGD step with an L2 penalty ``reg`` on one weight."""
    model = make_model(seed=0).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tdinspect.capture(model, path, record=("outputs", "params", "grads"), environ={}) as dump:
        for step in range(steps):
            tokens = make_tokens(seed=step)
            logits = model(tokens)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
            loss = loss + reg * model.get_parameter(WEIGHT).square().sum()
            loss.backward()
            dump.step()
            opt.step()
            opt.zero_grad()
    return path, model


def test_training_step_records_gradients_and_changed_loss_weight_diverges_there(tmp_path):
    a, model = train_step(tmp_path / "a", reg=1e-3)
    b, _ = train_step(tmp_path / "b", reg=2e-3)
    e = sidecar(a)
    grads = [k for k, kind in zip(e["key"], e["kind"]) if kind == "grad"]
    assert len(grads) == len(list(model.parameters()))
    assert all(k.endswith(".grad") for k in grads)
    # gradients come after the forward, in the order backward accumulates them
    assert e["key"].index(grads[0]) > e["key"].index("model.lm_head")
    assert grads[0].startswith("model.lm_head.")
    # after the optimizer step every parameter changed: pass 1 stores them again
    e1 = sidecar(a, 1)
    assert all(s for s, kind in zip(e1["stored"], e1["kind"]) if kind == "param")
    tensors = load_pass(only_folder(a) / "pass00001.pt")
    torch.testing.assert_close(  # the second SGD step made the final weights
        tensors["model.lm_head.weight"] - 0.1 * tensors["model.lm_head.weight.grad"],
        model.lm_head.weight.detach(),
    )
    div = DumpSet.open(a).diff(b).first_divergence(metric="equal")
    assert (div.key, div.pass_) == (f"model.{WEIGHT}.grad", 0)
    pass0 = DumpSet.open(a).diff(b).table(progress=False).query("`pass` == 0")
    assert pass0.loc[pass0["equal"] == 0, "key"].tolist() == [f"model.{WEIGHT}.grad"]
