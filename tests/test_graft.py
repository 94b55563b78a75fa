"""Grafting a reference run into a live model: which module introduces an error."""

from __future__ import annotations

import pytest
import torch

import tdinspect
from tdinspect import ConfigError, DumpSet, GraftError, load_pass
from tdinspect.examples.models import make_model, make_tokens

from .conftest import only_folder

WEIGHT = "layers.2.mlp.down.weight"
OWNER = "model.layers.2.mlp.down"


def reference_run(path, steps=2, **kwargs):
    model = make_model(seed=0)
    with (
        torch.no_grad(),
        tdinspect.capture(model, path, record=("inputs", "outputs"), environ={}, **kwargs) as dump,
    ):
        for step in range(steps):
            model(make_tokens(seed=step))
            dump.step()
    return path


def broken_model(dtype=torch.float32):
    model = make_model(seed=0, dtype=dtype)
    with torch.no_grad():
        model.get_parameter(WEIGHT).mul_(1.01)
    return model


def grafted_run(path, reference, steps=2, graft=True, model=None, **kwargs):
    model = model if model is not None else broken_model()
    with torch.no_grad(), tdinspect.capture(model, path, record=("inputs", "outputs"), environ={}) as dump:
        g = tdinspect.graft(model, reference, capture=dump, **kwargs) if graft else None
        for step in range(steps):
            model(make_tokens(seed=step))
            dump.step()
        if g is not None:
            g.close()
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("graft") / "a")


def test_grafted_inputs_isolate_the_module_that_owns_the_changed_weight(tmp_path, reference):
    b = grafted_run(tmp_path / "b", reference)
    table = DumpSet.open(reference).diff(b).table(progress=False)
    outputs = table[~table["key"].str.contains(r"\[in\]", regex=True)]
    assert len(outputs) == 2 * 42  # 40 leaves (the expert called three times), two passes
    owner = outputs["op"] == OWNER
    # the module owning the weight differs (a 1% weight error: rel_diff ~ 5e-5)...
    assert (outputs.loc[owner, "rel_diff"] > 1e-6).all()
    # ...and every other module, fed the reference's inputs, agrees to float32 noise
    others = outputs[~owner]
    assert (others["rel_diff"] < 1e-12).all() and (others["max_rel"] < 1e-5).all()
    ranked = DumpSet.open(reference).diff(b).introduced(progress=False)
    assert ranked["module"].iloc[0] == OWNER and ranked["error"].iloc[0] > 1e-6
    assert ranked["error"].iloc[1] < 1e-12
    assert len(ranked) == 40 and ranked["module"].is_unique
    # the inputs B recorded are the reference's (grafted before the capture saw them)
    ta = load_pass(only_folder(reference) / "pass00001.pt")
    tb = load_pass(only_folder(b) / "pass00001.pt")
    assert torch.equal(ta["model.lm_head[in][0]"], tb["model.lm_head[in][0]"])


def test_without_graft_the_error_spreads_to_every_later_module(tmp_path, reference):
    b = grafted_run(tmp_path / "b", reference, graft=False)
    diff = DumpSet.open(reference).diff(b)
    assert diff.first_divergence(metric="equal").key == OWNER
    later = diff.table(progress=False).query("`pass` == 0 and equal == 0")
    assert len(later) > 10 and "model.lm_head" in set(later["op"])
    # every later module carries error: without grafting none of them can be cleared
    ranked = diff.introduced(progress=False)
    assert (ranked["error"] > 1e-9).sum() > 10


def test_grafted_outputs_replace_what_comes_out(tmp_path, reference):
    model = broken_model()
    b = grafted_run(
        tmp_path / "b", reference, model=model, modules=[r"layers\.2\.mlp\.down$"], what="outputs"
    )
    # the only wrong module's output came from the reference: everything after it is the reference's
    diff = DumpSet.open(reference).diff(b)
    assert diff.first_divergence(metric="equal") is None
    # and the live module did compute something else
    assert not torch.equal(
        model.layers[2].mlp.down(torch.ones(256)), make_model(seed=0).layers[2].mlp.down(torch.ones(256))
    )


def test_step_without_capture_and_hooks_removed(tmp_path, reference):
    model = broken_model()
    ref = [load_pass(only_folder(reference) / f"pass0000{p}.pt") for p in range(2)]
    with torch.no_grad(), tdinspect.graft(model, reference, modules=[r"down$"], what="outputs") as g:
        for step in range(2):
            out = model(make_tokens(seed=step))
            assert torch.equal(out, ref[step]["model.lm_head"])
            g.step()
        assert g.names == [f"model.layers.{i}.mlp.down" for i in range(4)]
        with pytest.raises(
            GraftError,
            match=r"live run is at pass 2, but the reference .* has "
            r"passes \[0, 1\]",
        ):
            model(make_tokens())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_dtype_and_device_follow_the_live_tensor(tmp_path, reference):
    model = broken_model(torch.bfloat16)
    b = grafted_run(tmp_path / "b", reference, steps=1, model=model, modules=[r"lm_head$"])
    ta = load_pass(only_folder(reference) / "pass00000.pt")
    tb = load_pass(only_folder(b) / "pass00000.pt")
    assert tb["model.lm_head[in][0]"].dtype == torch.bfloat16
    assert torch.equal(tb["model.lm_head[in][0]"], ta["model.lm_head[in][0]"].bfloat16())


def test_mismatches_are_clear_errors_naming_both_sides(tmp_path, reference):
    model = broken_model()
    with torch.no_grad(), tdinspect.graft(model, reference, modules=[r"lm_head$"]):
        with pytest.raises(
            GraftError,
            match=r"input 'model.lm_head\[in\]\[0\]' of the live run "
            r"\(pass 0\) has shape \[2, 9, 64\], the reference's "
            r"'model.lm_head\[in\]\[0\]' in .*pass00000.* has shape "
            r"\[2, 16, 64\]",
        ):
            model(make_tokens(seq=9))
    outputs_only = tmp_path / "o"
    with torch.no_grad(), tdinspect.capture(model, outputs_only, environ={}) as dump:
        model(make_tokens())
        dump.step()
    with torch.no_grad(), tdinspect.graft(model, outputs_only, modules=[r"lm_head$"]):
        with pytest.raises(
            GraftError,
            match=r"has no entry 'model.lm_head\[in\]\[0\]'.*it records "
            r"\['model.lm_head'\]",
        ):
            model(make_tokens())
    with pytest.raises(ConfigError, match="what='weights'"):
        tdinspect.graft(model, reference, what="weights")
    with pytest.raises(ConfigError, match="selects no module"):
        tdinspect.graft(model, reference, modules=[r"no_such_module"])


def test_mapping_pairs_differently_named_modules(tmp_path):
    ref = reference_run(tmp_path / "net", steps=1, root="net")
    b = grafted_run(tmp_path / "b", ref, steps=1, mapping={r"net\.(.*)": r"model.\1"})
    rows = DumpSet.open(reference_run(tmp_path / "a", steps=1)).diff(b).introduced(progress=False)
    assert rows["module"].iloc[0] == OWNER and rows["error"].iloc[1] < 1e-12
