"""Statistics-only passes have no pass file to recompute their facts from, so their sidecar is
all there is: an edited or damaged one must not be read as the run's numbers, nor vanish. A hand
edit of one statistic (the sealed digest left as it was) read as written (``DumpSet.diff``
reported ``stats_rel 0.933`` at the edited entry, without a word), and a second pass whose
sidecar was cut short was taken for one still being written and left out silently. Both are
now a ``DumpFormatError`` naming the sidecar."""

from __future__ import annotations

import json

import pytest
import torch

from tdinspect import DumpFormatError, DumpSet
from tdinspect.cli import main

from .conftest import only_folder
from .recorded import record_dump

PASSES = [{"m.a": torch.arange(6.0), "m.b": torch.arange(6.0) * -2}] * 2


def _runs(tmp_path):
    for name in ("a", "b"):
        record_dump(tmp_path / name, PASSES, stats_only=True)
    return only_folder(tmp_path / "b")


def test_an_edited_statistics_only_sidecar_is_refused_naming_it(tmp_path, capsys):
    sidecar = _runs(tmp_path) / "pass00000.json"
    assert DumpSet.open(tmp_path / "a").diff(tmp_path / "b").first_divergence() is None
    doc = json.loads(sidecar.read_bytes())
    stats = doc["entries"]["stats"][1]
    row = json.dumps(stats, separators=(",", ":"))
    edited = json.dumps([stats[0] * 2, *stats[1:]], separators=(",", ":"))  # min -10 -> -20
    text = sidecar.read_text()
    assert text.count(row) == 1
    sidecar.write_text(text.replace(row, edited))  # an editor's change: the seal left as it was
    with pytest.raises(DumpFormatError, match=r"pass00000\.json: sidecar was edited"):
        DumpSet.open(tmp_path / "b")
    capsys.readouterr()
    assert main(["first-divergence", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "pass00000.json: sidecar was edited" in capsys.readouterr().err


def test_a_damaged_statistics_only_sidecar_is_not_left_out_silently(tmp_path):
    sidecar = _runs(tmp_path) / "pass00001.json"
    sidecar.write_bytes(sidecar.read_bytes()[:-40])
    with pytest.raises(DumpFormatError, match=r"pass00001\.json: unreadable sidecar"):
        DumpSet.open(tmp_path / "b")
    with pytest.warns(RuntimeWarning, match=r"skipping unreadable pass: .*pass00001\.json"):
        assert DumpSet.open(tmp_path / "b", on_error="warn").passes == [0]
