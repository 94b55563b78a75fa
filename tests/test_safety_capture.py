"""A capture or graft leaves the process and the model as they were, on every path; statistics
never fail the model's forward."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import tdinspect
from tdinspect.cli import main
from tdinspect.examples.models import make_model, make_tokens

from .conftest import only_folder


def _stance() -> str:
    from torch._dynamo import eval_frame

    return eval_frame._stance.stance


def _tiny_llama():
    pytest.importorskip("transformers")
    from tdinspect.examples.port import make_hf_llama  # the project's tiny Llama (random weights)

    return make_hf_llama(vocab_size=64, max_position_embeddings=32)


def test_every_path_out_of_a_capture_of_a_compiled_model_restores_the_stance(tmp_path):
    """A failed capture() (bad dims, a file as dump_dir) and two captures closed in the order
    they were opened each left dynamo's force_eager on: compiled models then ran eagerly
    (compile="eager": the mode that runs a compiled model eagerly while capturing)."""
    model = _tiny_llama()
    compiled = torch.compile(model, backend="eager")
    ids = torch.randint(0, 64, (1, 8))
    assert _stance() == "default"
    file = tmp_path / "a_file"
    file.write_text("not a folder")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception, match="dims|spec"):
            tdinspect.capture(
                compiled, tmp_path / "d0", dims={"lm_head": "b s ?? ?"}, compile="eager", environ={}
            )
        assert _stance() == "default"
        with pytest.raises(tdinspect.ConfigError, match="a_file"):
            tdinspect.capture(compiled, file, compile="eager", environ={})
        assert _stance() == "default"
        for order in ("opened", "reversed"):
            a = tdinspect.capture(compiled, tmp_path / f"{order}_a", compile="eager", environ={})
            b = tdinspect.capture(compiled, tmp_path / f"{order}_b", compile="eager", environ={})
            with torch.no_grad():
                compiled(ids)
            assert _stance() == "force_eager"
            first, second = (a, b) if order == "opened" else (b, a)
            first.close()
            assert _stance() == "force_eager"  # the other capture is still open
            second.close()
            assert _stance() == "default", order
    # the compiled model runs compiled again: dynamo is asked to compile once more
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    again = torch.compile(model, backend=counter)
    with torch.no_grad():
        again(ids)
    assert counter.frame_count >= 1


def _reference(tmp_path):
    model = make_model(seed=0)
    with (
        torch.no_grad(),
        tdinspect.capture(model, tmp_path / "ref", record=("inputs", "outputs"), environ={}) as c,
    ):
        model(make_tokens(seed=0))
        c.step()
    return tmp_path / "ref"


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_graft_that_fails_leaves_no_hook(tmp_path):
    """graft(..., capture=<not a capture>) raised after its hooks were on the model: the model
    then ran grafted (outputs no longer bitwise equal)."""
    ref = _reference(tmp_path)
    model = make_model(seed=1)  # other weights: a hook left on would change its outputs
    x = make_tokens(seed=0)
    with torch.no_grad():
        before = model(x)
    with pytest.raises(TypeError, match="capture"):
        tdinspect.graft(model, ref, modules=[r"down$"], what="outputs", capture=object())
    assert _hooks(model) == 0
    # a GraftError in the forward (no such entry), without a with block
    g = tdinspect.graft(model, ref, modules=[r"down$"], what="inputs", start=0)
    with pytest.raises(tdinspect.GraftError):
        with torch.no_grad():
            model(make_tokens(seed=0)[:, :5])  # shapes differ
    assert _hooks(model) == 0
    g.close()
    with torch.no_grad():
        assert torch.equal(model(x), before)


class _Tiny(torch.nn.Module):
    def forward(self, x):
        return x * 1e-310  # subnormal in float64


@pytest.mark.parametrize("checksum", [False, True])
def test_subnormal_outputs_are_captured_and_their_statistics_read(tmp_path, capsys, checksum):
    """float64 outputs near 1e-310: model(x) raised OverflowError under capture
    (stats.power_of_two_scale asked ldexp(1.0, 1029)), the warning then said the module
    "never ran a hooked forward", and `tdinspect stats` failed naming no file."""
    model = torch.nn.Sequential(_Tiny(), torch.nn.Identity()).double()
    x = torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "never ran a hooked forward"
        with tdinspect.capture(model, tmp_path / "d", checksum=checksum, environ={}) as cap:
            out = model(x)
            cap.step()
    assert torch.equal(out, x * 1e-310)
    folder = only_folder(tmp_path / "d")
    doc = json.loads((folder / "pass00000.json").read_text())
    stats = dict(zip(doc["entries"]["key"], doc["entries"]["stats"]))["model.0"]
    lo, hi, mean, std, absmax, l2, nan, inf, n = stats
    assert (lo, hi, absmax, nan, inf, n) == (-2e-310, 3e-310, 3e-310, 0, 0, 3)
    assert mean == pytest.approx(2e-310 / 3, rel=1e-9) and l2 == pytest.approx(14**0.5 * 1e-310, rel=1e-9)
    assert std > 0
    assert main(["stats", str(tmp_path / "d")]) == 0
    assert "model.0" in capsys.readouterr().out
