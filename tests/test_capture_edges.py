"""Capture meeting real code: containers, compiled models, Hugging Face outputs, per-call shapes."""

from __future__ import annotations

import warnings

import torch

import tdinspect


def test_modules_all_does_not_report_containers_as_missing(model, tokens, tmp_path):
    """Issue 13: modules="all" warned "never ran a hooked forward: model.layers" (a ModuleList)."""
    assert any(isinstance(m, torch.nn.ModuleList) for m in model.modules())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), tdinspect.capture(model, tmp_path, modules="all", environ={}) as dump:
            model(tokens)
            dump.step()
    assert not [w for w in caught if "never ran" in str(w.message)]
    assert dump.unfired == []
    assert "model.layers" in dump.names  # still selected, just not missing


def test_ls_shows_per_call_shapes_when_they_differ(model, tmp_path, capsys):
    """Issue 13: ls showed call 0's shape only (prefill [2, 16, .] and decode [2, 1, .] alike)."""
    from tdinspect.cli import main
    from tdinspect.examples.models import make_tokens

    tokens = make_tokens()
    with torch.no_grad(), tdinspect.capture(model, tmp_path, environ={}) as dump:
        model(tokens)  # "prefill"
        dump.step()
        for step in range(3):  # "decode": one token at a time
            model(tokens[:, step : step + 1])
            dump.step()
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.lstrip().startswith("model.layers.0.attn.q_proj "))
    assert "[2, 16, 64] (pass 0 call 0)" in line and "[2, 1, 64] (pass 1 call 0, x3)" in line
