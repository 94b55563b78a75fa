"""Op-level capture: the LayerNorm example and a transformer, forward and backward; replay."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tdinspect
from tdinspect import DumpSet, load_pass, parse_key
from tdinspect.examples.models import layernorm_test, make_model, make_tokens

from .conftest import only_folder


def _side(run):
    return json.loads((only_folder(run) / "pass00000.json").read_text())


def _ln_capture(tmp_path, **kw):
    torch.manual_seed(0)
    with tdinspect.capture_ops(tmp_path, **kw) as dump:
        grad = layernorm_test(torch.bfloat16)
        dump.step()
    return grad


def test_layernorm_forward_backward_sequence(tmp_path):
    torch.manual_seed(0)
    ref_grad = layernorm_test(torch.bfloat16)
    grad = _ln_capture(tmp_path, inputs=True)
    assert torch.equal(grad, ref_grad)
    keys = _side(tmp_path)["entries"]["key"]
    ops = [parse_key(k).op for k in keys if parse_key(k).io == "out"]
    ops = list(dict.fromkeys(ops))
    for expected in (
        "aten.randn.default",
        "aten._to_copy.default",
        "aten.empty.memory_format",
        "aten.fill_.Scalar",
        "aten.zero_.default",
        "aten.native_layer_norm.default",
        "aten.sum.default",
        "aten.mul.Tensor",
        "aten.ones_like.default",
        "aten.expand.default",
        "aten.native_layer_norm_backward.default",
        "aten.detach.default",
    ):
        assert expected in ops, expected
    assert ops.index("aten.native_layer_norm.default") < ops.index("aten.native_layer_norm_backward.default")
    # forward and backward of the LayerNorm are attributed to the module that ran them
    assert "model.LayerNorm/aten.native_layer_norm.default[out0]" in keys
    assert "model.LayerNorm/aten.native_layer_norm_backward.default[out1]" in keys
    assert "model/aten.sum.default[out0]" in keys  # outside any module: the root
    assert "model/aten._to_copy.default[out0]::call1" in keys
    assert not any("aten.stack" in k or "aten.aminmax" in k for k in keys)  # recorder's own ops


def test_uninitialized_outputs_marked_and_not_stored(tmp_path):
    _ln_capture(tmp_path, inputs=True)
    e = _side(tmp_path)["entries"]
    stored = load_pass(only_folder(tmp_path) / "pass00000.pt")
    i = e["key"].index("model/aten.empty.memory_format[out0]")
    assert e["uninitialized"][i] is True and e["stats"][i] is None
    assert "model/aten.empty.memory_format[out0]" not in stored
    j = e["key"].index("model/aten.fill_.Scalar[in0]")  # fill_ reads the uninitialised memory
    assert e["uninitialized"][j] is True
    ds = DumpSet.open(tmp_path)
    with pytest.raises(tdinspect.DumpFormatError, match="uninitialised"):
        ds.tensor("model/aten.empty.memory_format[out0]")


def test_inputs_recorded_before_inplace_and_references(tmp_path):
    x = torch.ones(4)
    with tdinspect.capture_ops(tmp_path, inputs=True) as dump:
        y = x * 3  # mul: out0 recorded
        y.add_(1)  # in-place: its input must be 3s, its output 4s
        z = y.view(2, 2)  # a view of a recorded tensor: a reference, not a copy
        w = z + 0
        dump.step()
    assert torch.equal(w, torch.full((2, 2), 4.0))
    ds = DumpSet.open(tmp_path)
    pi = ds.pass_indexes()[0]
    stored = load_pass(only_folder(tmp_path) / "pass00000.pt")
    assert torch.equal(ds.tensor("model/aten.add_.Tensor[in0]"), torch.full((4,), 3.0))
    assert torch.equal(ds.tensor("model/aten.add_.Tensor[out0]"), torch.full((4,), 4.0))
    # add_'s input is mul's output, unchanged since: a reference
    i = pi.position["model/aten.add_.Tensor[in0]"]
    assert pi.ref[i] == {"kind": "same", "of": "model/aten.mul.Tensor[out0]"}
    assert "model/aten.add_.Tensor[in0]" not in stored
    v = pi.position["model/aten.view.default[out0]"]
    # where the view's elements sit in the stored tensor: rebuilt by indexing, no op is run
    assert pi.ref[v] == {
        "kind": "view",
        "of": "model/aten.add_.Tensor[out0]",
        "base": [[4], [1], 0],
        "view": [[2, 2], [2, 1], 0],
    }
    assert "model/aten.view.default[out0]" not in stored
    assert torch.equal(ds.tensor("model/aten.view.default[out0]"), torch.full((2, 2), 4.0))
    # non-tensor arguments are in the sidecar
    m = pi.position["model/aten.view.default[out0]"]
    assert pi.call_args[m]["leaves"][1:] == [2, 2]


def test_trace_prints_one_line_per_op_with_correct_ranges(tmp_path):
    buf = io.StringIO()
    x = torch.tensor([-2.0, 5.0])
    with tdinspect.capture_ops(trace=buf):
        torch.empty(3)
        x * 2
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("model/aten.empty.memory_format") and "(uninitialized)" in lines[0]
    assert lines[1].startswith("model/aten.mul.Tensor")
    assert "in: f32[2] [-2, 5]" in lines[1] and "out: f32[2] [-4, 10]" in lines[1]
    assert len(lines) == 2


def test_transformer_forward_backward_identical_and_attributed(tmp_path):
    model, tokens = make_model(seed=0, n_layers=2), make_tokens(seed=0)
    loss = model(tokens).square().mean()
    loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    rng = torch.get_rng_state()
    with tdinspect.capture_ops(tmp_path, model=model) as dump:
        loss2 = model(tokens).square().mean()
        loss2.backward()
        dump.step()
    assert torch.equal(rng, torch.get_rng_state())
    assert torch.equal(loss, loss2)
    assert all(torch.equal(a, p.grad) for a, p in zip(ref_grads, model.parameters()))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    keys = _side(tmp_path)["entries"]["key"]
    assert "model.layers.0.ln1/aten.native_layer_norm.default[out0]" in keys
    assert "model.layers.0.ln1/aten.native_layer_norm_backward.default[out0]" in keys
    assert any(k.startswith("model.layers.1.attn.o_proj/aten.mm.default") for k in keys)
    assert any(k.startswith("model.layers.0.mlp.act/aten.gelu_backward.default") for k in keys)
    mods = {parse_key(k).module for k in keys}
    assert "model" in mods and "model.lm_head" in mods
    # filters match "module/op"
    with tdinspect.capture_ops(tmp_path / "f", model=model, filter=r"native_layer_norm\.") as dump:
        model(tokens)
        dump.step()
    fkeys = _side(tmp_path / "f")["entries"]["key"]
    assert fkeys and all("aten.native_layer_norm.default" in k for k in fkeys)


def test_stats_only_and_env_overlay(tmp_path, monkeypatch):
    monkeypatch.setenv("TDINSPECT_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TDINSPECT_DUMP_FILTER", r"native_layer_norm")
    _ln_capture(None, stats_only=True)
    folder = only_folder(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["pass00000.json", "run.json"]
    side = _side(tmp_path)
    assert side["level"] == "op" and side["stats_only"]
    assert all("native_layer_norm" in k for k in side["entries"]["key"])


def test_edge_dtypes_and_none_outputs(tmp_path):
    with tdinspect.capture_ops(tmp_path) as dump:
        a = torch.arange(6).reshape(2, 3)
        (a > 2).sum()
        torch.zeros(0, 3) + 1
        torch.randn(3, dtype=torch.complex64) * 2
        torch.ones(4).to(torch.float8_e4m3fn)
        dump.step()
    keys = _side(tmp_path)["entries"]["key"]
    assert "model/aten.gt.Scalar[out0]" in keys and "model/aten._to_copy.default[out0]" in keys
    cube = DumpSet.open(tmp_path).to_xarray(progress=False)
    assert "bool" in set(cube["dtype"].values.tolist())
    assert float(cube["max"].sel(op="model/aten._to_copy.default[out0]", call=0).sel({"pass": 0})) == 1.0


class _Perturb(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.gelu.default:
            out = out * 1.1  # a deliberately wrong kernel
        return out


def test_replay_finds_the_op_that_is_wrong(tmp_path):
    model, tokens = make_model(seed=0, n_layers=1), make_tokens(seed=0)
    with _Perturb(), torch.no_grad():
        with tdinspect.capture_ops(tmp_path, model=model, inputs=True) as dump:
            model(tokens)
            dump.step()
    gelu = tdinspect.replay(tmp_path, "model.layers.0.mlp.act/aten.gelu.default")
    after = tdinspect.replay(tmp_path, "model.layers.0.mlp.down/aten.addmm.default")
    before = tdinspect.replay(tmp_path, "model.layers.0.mlp.up/aten.addmm.default")
    assert gelu.rel_diff > 1e-3  # its own error: the 10% it added
    assert after.rel_diff < 1e-10  # it received a wrong input but computed correctly
    assert before.rel_diff < 1e-10
    assert "aten.gelu.default" in repr(gelu) and "own error" in gelu._repr_html_()


def test_replay_layernorm_sample(tmp_path):
    _ln_capture(tmp_path, inputs=True)
    r = tdinspect.replay(tmp_path, "model.LayerNorm/aten.native_layer_norm.default[out0]")
    assert r.op == "aten.native_layer_norm.default" and len(r.outputs) == 3
    assert 0 < r.rel_diff < 1e-3  # bf16 rounding, not an error
    with pytest.raises(KeyError, match="no op call"):
        tdinspect.replay(tmp_path, "model/aten.nothing.default")
    with tdinspect.capture_ops(tmp_path / "noin") as dump:
        layernorm_test(torch.bfloat16)
        dump.step()
    with pytest.raises(tdinspect.DumpFormatError, match="inputs=True"):
        tdinspect.replay(tmp_path / "noin", "model.LayerNorm/aten.native_layer_norm.default")
