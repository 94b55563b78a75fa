"""Runs, passes and arguments a hostile or unlucky user can meet (issue 36, cases 4 and 8-14):
a pass cut short, empty and out-of-range arguments, runs sharing a PID, readers racing an
overwrite, sizes and depths taken from files."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import tdinspect
from tdinspect import DumpSet

from .conftest import only_folder


class _Stops(nn.Module):
    """A block whose forward raises when ``stop`` is set (a model cut short mid-pass)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stop = False

    def forward(self, x):
        y = self.lin(x)
        if self.stop:
            raise RuntimeError("out of pages")
        return y


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), _Stops(), nn.Linear(4, 4), nn.Linear(4, 4))


def _run(root, stop_at: int | None, passes: int = 2, wrong: bool = False):
    """``passes`` passes of ``_net``; the one numbered ``stop_at`` raises inside ``with capture``
    (``wrong``: its first layer's weights perturbed)."""
    net, x = _net(), torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    if wrong:
        with torch.no_grad():
            net[0].weight[0, 0] += 1.0
    with pytest.raises(RuntimeError, match="out of pages") if stop_at is not None else _nothing():
        with torch.no_grad(), tdinspect.capture(net, root, modules="all") as dump:
            for p in range(passes):
                net[1].stop = p == stop_at
                net(x)
                dump.step()
    return root


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_pass_cut_short_inside_capture_is_marked_failed_and_never_matches(tmp_path):
    """Case 10: an exception inside ``with capture(...)`` wrote the pass without its ``failed``
    mark, and the diff answered "only in A" for the rest of it; two runs cut short at the same
    place answered "matches". Now the pass says it failed and the verdict is incomplete."""
    a = _run(tmp_path / "a", stop_at=None)
    b = _run(tmp_path / "b", stop_at=1)
    doc = json.loads((only_folder(b) / "pass00001.json").read_text())
    assert doc.get("failed", "").startswith("RuntimeError: out of pages")
    v = DumpSet.open(a).diff(b).verdict()
    assert v.outcome == "incomplete", v.text
    assert "cut short" in v.gap and "out of pages" in v.gap
    # both sides cut short at the same place: what ran agrees, but the pass did not end
    v2 = DumpSet.open(b).diff(_run(tmp_path / "b2", stop_at=1)).verdict()
    assert v2.outcome == "incomplete" and "cut short" in v2.gap, v2.text
    # a real divergence before the cut is still named
    v3 = DumpSet.open(a).diff(_run(tmp_path / "c", stop_at=1, wrong=True)).verdict()
    assert v3.outcome == "diverges" and v3.divergence.key == "model.0", v3.text
