"""Health checks: the first NaN/Inf named live (capture, capture_ops) and offline (DumpSet, CLI)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import tdinspect
from tdinspect import DumpSet
from tdinspect.cli import main
from tdinspect.examples.models import make_model, make_tokens

from .conftest import only_folder

SICK = "model.layers.1.mlp.up"


def _inject_nan_at(model, module: str, at_pass: int):
    """A forward hook (registered before capture's) that puts 3 NaN into ``module``'s output on
    its ``at_pass``-th call: what a real overflow looks like to the hooks after it."""
    calls = {"n": 0}

    def hook(mod, args, out):
        if calls["n"] == at_pass:
            out = out.clone()
            out[0, 0, :3] = float("nan")
        calls["n"] += 1
        return out

    return model.get_submodule(module.removeprefix("model.")).register_forward_hook(hook)


def _run(model, cap, passes=5):
    with torch.no_grad():
        for p in range(passes):
            model(make_tokens(seed=p))
            cap.step()


def test_nan_in_pass_2_named_live_with_no_file_and_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = make_model()
    handle = _inject_nan_at(model, SICK, at_pass=2)
    with pytest.raises(tdinspect.NonFiniteError) as info:
        with tdinspect.capture(model, on_nonfinite="raise") as cap:
            _run(model, cap)
    live = info.value.nonfinite
    assert (live.key, live.op, live.call, live.pass_) == (SICK, SICK, 0, 2)
    assert (live.nan, live.inf, live.numel) == (3, 0, 2 * 16 * 256)
    assert live.inherited is None  # module level
    assert SICK in str(info.value) and "pass 2" in str(info.value) and "3 NaN" in str(info.value)
    assert cap.recorder is None and all(
        not m._forward_hooks for n, m in model.named_modules() if n != SICK.removeprefix("model.")
    )
    assert list(tmp_path.iterdir()) == []  # checked without writing any file

    # the same run dumped in full: the offline answer is the same entry
    model2 = make_model()
    _inject_nan_at(model2, SICK, at_pass=2)
    with tdinspect.capture(model2, tmp_path / "full") as cap:
        _run(model2, cap)
    found = DumpSet.open(tmp_path / "full").first_nonfinite()
    assert (found.key, found.call, found.pass_, found.nan, found.inf, found.numel) == (
        live.key,
        live.call,
        live.pass_,
        live.nan,
        live.inf,
        live.numel,
    )
    assert found.order == live.order
    # the layers after it inherit the NaN, but the first one is named
    assert DumpSet.open(tmp_path / "full").sel(pass_=[0, 1]).first_nonfinite() is None
    # a dump without sidecars (another tool's): statistics computed on load, same answer
    for f in only_folder(tmp_path / "full").glob("*.json"):
        f.unlink()
    bare = DumpSet.open(tmp_path / "full").first_nonfinite()
    assert (bare.key, bare.pass_, bare.nan) == (SICK, 2, 3)
    handle.remove()


def test_cli_first_nonfinite_exit_codes(tmp_path, capsys):
    model = make_model()
    with tdinspect.capture(model, tmp_path / "clean") as cap:
        _run(model, cap, passes=2)
    _inject_nan_at(model, SICK, at_pass=1)
    with tdinspect.capture(model, tmp_path / "sick") as cap:
        _run(model, cap, passes=2)
    assert main(["first-nonfinite", str(tmp_path / "clean")]) == 0
    assert "no NaN/Inf" in capsys.readouterr().out
    assert main(["first-nonfinite", str(tmp_path / "sick"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["key"], out["pass"], out["nan"], out["inf"]) == (SICK, 1, 3, 0)
    assert main(["first-nonfinite", str(tmp_path / "sick")]) == 1
    assert SICK in capsys.readouterr().out
    assert main(["first-nonfinite", str(tmp_path / "missing")]) == 2
    assert "error" in capsys.readouterr().err


def test_warn_goes_on_and_dump_keeps_complete_passes(tmp_path):
    model = make_model()
    _inject_nan_at(model, SICK, at_pass=1)
    with pytest.warns(RuntimeWarning, match=r"pass 1: model\.layers\.1\.mlp\.up") as rec:
        with tdinspect.capture(model, tmp_path / "w", on_nonfinite="warn") as cap:
            _run(model, cap, passes=3)
    assert len([w for w in rec if "non-finite" in str(w.message)]) == 1  # once per pass
    assert [p.name for p in sorted(only_folder(tmp_path / "w").glob("*.pt"))] == [
        "pass00000.pt",
        "pass00001.pt",
        "pass00002.pt",
    ]

    # raise with a dump: the passes before it are complete, the unfinished one is not written
    model = make_model()
    _inject_nan_at(model, SICK, at_pass=1)
    with pytest.raises(tdinspect.NonFiniteError):
        with tdinspect.capture(model, tmp_path / "r", on_nonfinite="raise") as cap:
            _run(model, cap, passes=3)
    assert sorted(p.name for p in only_folder(tmp_path / "r").iterdir()) == [
        "pass00000.json",
        "pass00000.pt",
        "run.json",
    ]
    with pytest.raises(tdinspect.ConfigError, match="on_nonfinite"):
        tdinspect.capture(model, on_nonfinite="stop")


def test_with_a_dump_the_check_reads_the_statistics_not_the_tensor(tmp_path, monkeypatch):
    """Module capture with a dump computes each output's statistics anyway: their NaN/Inf
    counts answer the health check (no second read of the tensor), with the same report."""
    from tdinspect.dumper import checks

    reads = []
    monkeypatch.setattr(checks, "_finite_cpu", lambda v, f=checks._finite_cpu: reads.append(1) or f(v))
    model = make_model()
    _inject_nan_at(model, SICK, at_pass=1)
    with pytest.raises(tdinspect.NonFiniteError) as info:
        with tdinspect.capture(model, tmp_path / "d", on_nonfinite="raise") as cap:
            _run(model, cap, passes=3)
    found = info.value.nonfinite
    assert (found.key, found.pass_, found.nan, found.inf, found.numel) == (SICK, 1, 3, 0, 2 * 16 * 256)
    assert reads == []
    # the same run checked without a dump reads each output itself, and names the same entry
    model = make_model()
    _inject_nan_at(model, SICK, at_pass=1)
    with pytest.raises(tdinspect.NonFiniteError) as info:
        with tdinspect.capture(model, on_nonfinite="raise") as cap:
            _run(model, cap, passes=3)
    assert reads and (info.value.nonfinite.key, info.value.nonfinite.order) == (SICK, found.order)


class SqrtOfRelu(nn.Module):
    """``sqrt(relu(x))``: finite forward; at a negative x, sqrt's backward divides by sqrt(0)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        return torch.sqrt(self.act(self.lin(x)))


def _sqrt_model():
    torch.manual_seed(0)
    model = SqrtOfRelu()
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.zero_()
    return model, torch.tensor([[4.0, -1.0, 1.0, 9.0]])  # -1 -> relu 0 -> d sqrt = inf


def test_backward_only_nonfinite_named_at_op_level_as_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, x = _sqrt_model()
    with tdinspect.capture_ops(model=model, on_nonfinite="raise") as cap:
        y = model(x)
        assert torch.isfinite(y).all()  # forward is clean: no error so far
        with pytest.raises(tdinspect.NonFiniteError) as info:
            y.sum().backward()
    found = info.value.nonfinite
    # sqrt's backward is grad / (2 * sqrt(x)): the division makes the Inf, in the root's forward
    assert found.key == "model/aten.div.Tensor[out0]" and found.pass_ == 0
    assert found.inherited is False and found.inf == 1 and found.nan == 0
    assert "this op created them" in str(info.value)
    assert cap.recorder is None and list(tmp_path.iterdir()) == []

    # offline, from a dump with inputs: the same op, created there
    model, x = _sqrt_model()
    with tdinspect.capture_ops(tmp_path / "ops", model=model, inputs=True) as cap:
        model(x).sum().backward()
        cap.step()
    off = DumpSet.open(tmp_path / "ops").first_nonfinite()
    assert (off.key, off.pass_, off.inf, off.inherited) == (found.key, 0, 1, False)


def test_op_level_inherited_when_inputs_already_nonfinite():
    model, _ = _sqrt_model()
    x = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]])
    with pytest.raises(tdinspect.NonFiniteError) as info:
        with tdinspect.capture_ops(model=model, on_nonfinite="raise") as cap:
            model(x)
            cap.step()
    found = info.value.nonfinite
    assert found.key == "model.lin/aten.addmm.default[out0]" and found.inherited is True
    assert "inherited" in str(info.value)
    # after the error the mode is gone: torch runs unrecorded
    assert torch.sqrt(torch.tensor(4.0)) == 2.0


def test_huge_finite_values_odd_dtypes_and_layouts():
    """The CPU check squares values (v·v): an overflow there is confirmed exactly, never reported."""
    model = nn.Sequential(nn.Identity())
    with tdinspect.capture(model, on_nonfinite="raise") as cap:
        model(torch.full((4, 3), 3e38))  # v·v overflows float32: still finite
        model(torch.full((4, 3), 1e300, dtype=torch.float64))
        model(torch.ones(4, 3).t())  # non-contiguous
        model(torch.ones(3, dtype=torch.bfloat16))
        model(torch.arange(3))  # integers cannot hold NaN
        cap.step()
    for bad, counts in (
        (torch.tensor([1.0, float("inf")]).t(), (0, 1)),
        (torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16), (1, 0)),
        (torch.full((3, 2), 3e38)[:, :1].clone().fill_(float("-inf")), (0, 3)),
    ):
        with pytest.raises(tdinspect.NonFiniteError) as info:
            with tdinspect.capture(model, on_nonfinite="raise") as cap:
                model(bad)
        assert (info.value.nonfinite.nan, info.value.nonfinite.inf) == counts
