"""Decode steps against one full forward: concat over calls and passes, narrow."""

from __future__ import annotations

import pytest
import torch

import tdinspect


def _linear(seed=0):
    lin = torch.nn.Linear(4, 3)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)))
        lin.bias.zero_()
    return torch.nn.Sequential(lin)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """One forward over 6 positions; the same positions as calls (2+1+1+1+1) and as passes."""
    root = tmp_path_factory.mktemp("concat")
    x = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(1))
    model = _linear()
    pieces = [x[:, :2], *x[:, 2:].split(1, 1)]
    with torch.no_grad():
        with tdinspect.capture(model, root / "full", dims={"0": "b s h"}) as dump:
            model(x)
            dump.step()
        with tdinspect.capture(model, root / "calls", dims={"0": "b s h"}) as dump:
            for p in pieces:
                model(p)
            dump.step()
        with tdinspect.capture(model, root / "passes") as dump:
            for p in pieces:
                model(p)
                dump.step()
    return root


def test_calls_and_passes_concatenate_to_the_full_forward(steps):
    full = tdinspect.DumpSet.open(steps / "full")
    calls = tdinspect.DumpSet.open(steps / "calls").concat("call", dim="s")
    assert calls.summary()["max_calls"] == 1 and calls.ops == ["model.0"]
    torch.testing.assert_close(calls.tensor("model.0"), full.tensor("model.0"))
    passes = tdinspect.DumpSet.open(steps / "passes").concat("pass", dim=1)
    assert passes.passes == [0]
    torch.testing.assert_close(passes.tensor("model.0"), full.tensor("model.0"))
    assert full.diff(steps / "calls", concat="call:s").first_divergence(threshold=1e-10) is None
    assert full.diff(steps / "passes", concat=("pass", 1)).first_divergence(threshold=1e-10) is None
    assert full.narrow("s", 0, 5).tensor("model.0").shape == (1, 5, 3)


def test_concat_errors_are_reasons(steps):
    passes = tdinspect.DumpSet.open(steps / "passes")
    div = tdinspect.DumpSet.open(steps / "full").diff(passes, concat="pass:s").first_divergence()
    assert div.structural and "dim 's' needs dims for 'model.0'" in div.reason
    plan = tdinspect.DumpSet.open(steps / "full").diff(passes, concat="pass:s").plan()
    assert plan["status"].iloc[0].startswith("B: dim 's' needs dims")
    plan = tdinspect.DumpSet.open(steps / "full").diff(passes, concat="pass:1").plan()
    assert plan["assembled_b"].iloc[0] == "cat(dim 1: pass 0, pass 1, pass 2, pass 3, pass 4)"
    narrow = passes.narrow(1, 0, 4)
    div = narrow.diff(passes).first_divergence()
    assert "has 2 positions along dim 1, fewer than 0 + 4" in div.reason
    with pytest.raises(ValueError, match="over must be 'pass' or 'call'"):
        passes.concat("token", 1)
    with pytest.raises(ValueError, match="expected OVER:DIM"):
        passes.diff(passes, concat="pass")


def test_cli_concat(steps, capsys):
    from tdinspect.cli import main

    assert (
        main(
            [
                "first-divergence",
                str(steps / "full"),
                str(steps / "calls"),
                "--concat",
                "call:1",
                "--threshold",
                "1e-10",
            ]
        )
        == 0
    )
    assert main(["first-divergence", str(steps / "full"), str(steps / "calls")]) == 1
    assert main(["diff", str(steps / "full"), str(steps / "calls"), "--concat", "step:1"]) == 2
    assert "over must be 'pass' or 'call'" in capsys.readouterr().err


def test_op_dump_without_module_calls_warns_that_an_ops_runs_are_mixed(tmp_path):
    """An op-level dump written by another tool (no sidecar, so no module calls): an op run
    twice a step cannot be told apart from the next step's, every call goes end to end, and
    a warning says so."""
    folder = tmp_path / "rank0_pid1"
    folder.mkdir()
    t = [torch.full((1, n, 4), float(i)) for i, n in enumerate((2, 2, 1, 1))]
    torch.save(
        {
            "m.norm/aten.mul.Tensor[out0]": t[0],
            "m.norm/aten.mul.Tensor[out0]::call1": t[1],
            "m.norm/aten.mul.Tensor[out0]::call2": t[2],
            "m.norm/aten.mul.Tensor[out0]::call3": t[3],
        },
        folder / "pass00000.pt",
    )
    with pytest.warns(RuntimeWarning, match="does not say which call of its module ran each op"):
        cat = tdinspect.DumpSet.open(tmp_path).concat("call", dim=1)
    assert cat.ops == ["m.norm/aten.mul.Tensor[out0]"]
    assert torch.equal(cat.tensor("m.norm/aten.mul.Tensor[out0]"), torch.cat(t, 1))


def test_a_dim_name_neither_side_holds_is_an_argument_error(steps, capsys):
    """--concat call:x (a typo) read as a divergence at the first entry, exit 1; it is an error
    in the argument: exit 2, naming it. A name one side holds stays each entry's reason."""
    from tdinspect.cli import main

    with pytest.raises(ValueError, match="concat dim 'x': no entry of either side has dims naming it"):
        tdinspect.DumpSet.open(steps / "full").diff(steps / "calls", concat="call:x")
    assert main(["first-divergence", str(steps / "full"), str(steps / "calls"), "--concat", "call:x"]) == 2
    assert "concat dim 'x'" in capsys.readouterr().err
