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
