"""Re-running notebook cells stays quiet and bounded (issue 28 case 5), and the explorer keeps
the entry a user picked when the threshold moves (case 8)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import matplotlib
import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import tdinspect
from tdinspect import DumpSet
from tdinspect.store.format import RANK_DIR_RE
from tdinspect.store.runs import prune_runs

matplotlib.use("Agg")


@pytest.fixture
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext tdinspect")
    yield sh
    sh.run_cell("%unload_ext tdinspect")
    sh.configurables[:] = [c for c in sh.configurables if type(c).__name__ != "TdinspectMagics"]


def _to_stderr(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _run(sh, cell: str) -> list[str]:
    """The lines a cell prints (stdout, stderr and warnings together), as a kernel shows them:
    every warning, however often it repeats, on stderr with its source line."""
    with capture_output() as out, warnings.catch_warnings():  # displayed results apart: the answer
        warnings.simplefilter("always")
        warnings.showwarning = _to_stderr  # pytest records warnings; a kernel prints them
        result = sh.run_cell(cell)
    assert result.error_in_exec is None and result.error_before_exec is None, out.stderr
    return [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]


def _rank_folders(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if RANK_DIR_RE.match(p.name))


def test_run_all_six_times_prints_one_short_line_per_cell_and_keeps_three_runs(shell, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    cells = [
        "import torch\nfrom tdinspect.examples.models import make_model, make_tokens\n"
        "m = make_model(); x = make_tokens()",
        f"%%tdi_capture {a} --model m --filter layers\\.0\\.\nm(x)",
        f"%%tdi_capture {b} --model m --filter layers\\.0\\.\nm(x * 0 + 1)",
        f"%tdi_open ds {a}",
        f"%tdi_diff {a} {b}",
    ]
    for run in range(6):
        printed = [_run(shell, c) for c in cells]
        for cell, lines in zip(cells, printed):
            assert len(lines) <= 1, (run, cell, lines)
            text = "\n".join(lines)
            assert "Warning" not in text and "magics.py" not in text and "cap = " not in text, text
            assert len(text.replace(str(tmp_path), "~")) < 160, text  # short, whatever the folder
    assert _rank_folders(a) == _rank_folders(b) and len(_rank_folders(a)) == 3
    # the newest runs are the ones kept, and the cells said so
    assert printed[1][0].startswith("tdinspect: wrote ") and "(3 runs kept, 1 older removed)" in printed[1][0]
    newest = DumpSet.open(a, run=-1).run.name
    assert printed[3] == [f"tdinspect: {a} holds 3 runs; opened the newest, {newest}"]
    assert "_run6" in printed[3][0] and "_run6" in printed[4][0]


def test_keep_runs_is_a_setting_and_a_flag(shell, tmp_path, monkeypatch):
    shell.run_cell("import torch\nm = torch.nn.Sequential(torch.nn.Linear(2, 2))")
    shell.run_cell("%config TdinspectMagics.keep_runs = 2")
    for _ in range(4):
        _run(shell, f"%%tdi_capture {tmp_path / 'c'} --model m\nm(torch.ones(1, 2))")
    assert len(_rank_folders(tmp_path / "c")) == 2
    _run(shell, f"%%tdi_capture {tmp_path / 'c'} --model m --keep-runs 1\nm(torch.ones(1, 2))")
    assert len(_rank_folders(tmp_path / "c")) == 1


def test_prune_removes_only_finished_runs_tdinspect_made(tmp_path):
    torch = pytest.importorskip("torch")
    dump = tmp_path / "d"
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tdinspect.capture(model, dump) as cap:
                model(torch.ones(1, 2))
                cap.step()
    names = _rank_folders(dump)
    # the oldest: another live process of this host wrote it (its manifest says so)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        doc = json.loads((dump / names[0] / "run.json").read_text())
        doc["pid"] = sleeper.pid
        (dump / names[0] / "run.json").write_text(json.dumps(doc))
        # the second holds a file tdinspect did not write
        (dump / names[1] / "notes.txt").write_text("mine")
        # a link to a run elsewhere (the oldest of all) is never followed
        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(dump / names[2], elsewhere)
        doc = json.loads((elsewhere / "run.json").read_text())
        (elsewhere / "run.json").write_text(json.dumps({**doc, "started": doc["started"] - 100}))
        os.symlink(elsewhere, dump / "rank0_pid1")
        assert prune_runs(dump, keep=1) == []  # a dump holding a link out: nothing pruned
        assert _rank_folders(dump) == sorted([*names, "rank0_pid1"])
        (dump / "rank0_pid1").unlink()
        assert prune_runs(dump, keep=1) == []
        assert _rank_folders(dump) == names
        assert (dump / names[1] / "notes.txt").exists() and (dump / names[1] / "pass00000.pt").exists()
        # an open capture's run is never removed either
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cap = tdinspect.capture(model, dump)
            model(torch.ones(1, 2))
            cap.step()
            (dump / names[1] / "notes.txt").unlink()
            assert prune_runs(dump, keep=1) == names[1:]  # finished, ours: removed
            assert cap.folder.exists()
            cap.close()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert names[0] in _rank_folders(dump)  # the live process's run stayed
    assert names[1] not in _rank_folders(dump)
    with pytest.raises(tdinspect.ConfigError, match="keep_runs=0"):
        prune_runs(dump, keep=0)
    assert (elsewhere / "pass00000.pt").exists()


def test_moving_the_threshold_keeps_the_entry_the_user_picked(runs):
    ex = tdinspect.explore(DumpSet.open(runs["ref"]).diff(runs["wrong"]))
    assert ex.shown == ex.divergence.key  # before a pick the view follows the divergence
    ex.entry.value = "model.lm_head"  # the user picks an entry
    assert ex.shown == "model.lm_head"
    ex.threshold.value = 1e-9
    assert ex.divergence.key != "model.lm_head"
    assert ex.entry.value == "model.lm_head" and ex.shown == "model.lm_head"
    ex.auto.value = True
    assert ex.entry.value == "model.lm_head" and ex.shown == "model.lm_head"
    # a row picked in the dashboard's table stays too
    board = tdinspect.dashboard(runs["ref"], runs["wrong"])
    board.entries.value = next(v for _, v in board.entries.options if v[0] == "model.lm_head")
    board.explorer.threshold.value = 1e-9
    assert board.explorer.shown == "model.lm_head"


def test_a_warning_inside_a_magic_names_the_users_cell(shell, tmp_path):
    shell.run_cell("import torch\nm2 = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))")
    lines = _run(shell, f"%%tdi_capture {tmp_path / 'w'} --model m2\nm2[0](torch.ones(1, 2))")
    warned = [line for line in lines if "never ran a hooked forward: model.1" in line]
    assert len(warned) == 1 and warned[0].startswith("<ipython-input-"), lines
    assert not any("magics.py" in line or "site-packages" in line for line in lines), lines


def test_a_capture_cell_never_prunes_runs_a_script_made(shell, tmp_path):
    """A reference captured by a script, then a cell pointed at its folder: the cell's first run
    removed the script's oldest run ("3 runs kept, 1 older removed"). Only runs capture cells
    made (run.json ``made_by``) are pruned now; the script's stay and count among the runs."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    ref = tmp_path / "ref"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            with tdinspect.capture(model, ref) as dump:
                model(torch.ones(1, 2))
                dump.step()
    script_runs = _rank_folders(ref)
    shell.user_ns.update(m=model, torch=torch)
    for _ in range(5):
        lines = _run(shell, f"%%tdi_capture {ref} --model m --keep-runs 2\nm(torch.ones(1, 2))")
    assert set(script_runs) <= set(_rank_folders(ref))
    assert len(_rank_folders(ref)) == 3 + 2  # the script's, and the cells' newest 2
    assert "(5 runs kept, 1 older removed)" in lines[0]
    made = [json.loads((ref / n / "run.json").read_text()).get("made_by") for n in _rank_folders(ref)]
    assert sorted(made, key=str) == ["%%tdi_capture"] * 2 + [None] * 3
