"""Live comparison reports its verdict whatever happens to its files, and writes files a
spreadsheet reads as text."""

from __future__ import annotations

import csv
import errno

import pytest
import torch

import tdinspect
from tdinspect.dumper import live as live_module
from tdinspect.store import format as store_format

from .test_live import _perturbed, _steps


def test_a_full_disk_loses_the_evidence_not_the_divergence(runs, tmp_path, monkeypatch):
    """Evidence written to a full disk raised OSError [Errno 28] and the divergence itself
    was never reported; now the DivergenceError names it and a warning says what was lost."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(live_module, "atomic_write", full)
    monkeypatch.setattr(store_format, "atomic_write", full)  # every file the evidence is made of
    model = _perturbed()
    with pytest.warns(RuntimeWarning, match="the evidence could not be written .*No space left"):
        with pytest.raises(tdinspect.DivergenceError, match="model.layers.2.mlp.down") as info:
            with tdinspect.capture(model, tmp_path / "ev", compare_to=runs["ref"]) as cap:
                _steps(model, cap)
    assert info.value.evidence is None and info.value.divergence.key.startswith("model.layers.2.mlp.down")


def test_a_name_that_is_a_spreadsheet_formula_is_written_as_text(runs, tmp_path):
    """A reference entry named =HYPERLINK(...) (names come from files) went into the live CSV
    as is: a formula when the CSV is opened in a spreadsheet."""
    ref = tmp_path / "ref"
    ref.mkdir()
    evil = '=HYPERLINK("http://example.invalid","x")'
    torch.save({evil: torch.ones(2), "model.0": torch.ones(1, 2)}, ref / "pass00000.pt")
    model = torch.nn.Sequential(torch.nn.Identity())
    with tdinspect.capture(model, tmp_path / "out", compare_to=ref, on_divergence="record") as cap:
        with torch.no_grad():
            model(torch.ones(1, 2))
        cap.step()
    (table,) = (tmp_path / "out").rglob("pass00000.csv")
    cells = [c for row in csv.reader(table.open()) for c in row]
    assert "'" + evil in cells and evil not in cells
    assert not any(c[:1] in "=+@" for c in cells if c)


def test_uncompared_warning_shows_names_from_files_escaped(tmp_path):
    """UncomparedWarning printed entry names with raw escape sequences and newlines (a name
    from a file could clear the terminal or forge a line of output)."""
    import warnings

    from tdinspect import DumpSet, UncomparedWarning

    evil = "model.b\x1b[2J\nfake: no divergence"
    for side, keys in (("a", ["model.a", evil]), ("b", ["model.a"])):
        (tmp_path / side).mkdir()
        torch.save({k: torch.ones(3) for k in keys}, tmp_path / side / "pass00000.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert DumpSet.open(tmp_path / "a").diff(tmp_path / "b").first_divergence(structural="report") is None
    (w,) = [w for w in caught if issubclass(w.category, UncomparedWarning)]
    text = str(w.message)
    assert "model.b" in text and "\x1b" not in text and "\n" not in text
