"""Runs: a new capture never merges into an old one; several runs in a folder open one at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import nbformat
import pytest
import torch
from nbclient import NotebookClient

import tdinspect
from tdinspect import DumpSet, RunWarning, list_runs, load_pass
from tdinspect.cli import main as cli

from .conftest import ROOT


def _model(scale=1.0):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with torch.no_grad():
        m[0].weight.mul_(scale)
    return m


def _run(dump, model, steps=1, **kw):
    x = torch.ones(2, 4)
    with tdinspect.capture(model, dump, **kw) as d:
        for _ in range(steps):
            model(x)
            d.step()
    return d.folder


def test_same_pid_twice_is_two_runs_never_merged(tmp_path, monkeypatch):
    """PID 1 in two containers (or a re-run cell): the second run gets its own folder and
    DumpSet.open gives exactly it (today it continued the first at pass 2)."""
    monkeypatch.setattr(os, "getpid", lambda: 1)
    first = _run(tmp_path, _model(), steps=2)
    with pytest.warns(RunWarning, match=r"already holds 1 earlier run.*rank0_pid1\).*rank0_pid1_run2"):
        second = _run(tmp_path, _model(2.0), steps=1)
    assert (first.name, second.name) == ("rank0_pid1", "rank0_pid1_run2")
    assert sorted(p.name for p in second.iterdir()) == ["pass00000.json", "pass00000.pt", "run.json"]
    assert list(load_pass(second / "pass00000.pt"))  # the documented layout, plain torch.load
    ids = {json.loads((f / "run.json").read_text())["run_id"] for f in (first, second)}
    assert len(ids) == 2
    with pytest.warns(RunWarning, match=r"holds 2 runs; opened the newest, rank0_pid1_run2"):
        ds = DumpSet.open(tmp_path)
    assert ds.passes == [0] and ds.run.name == "rank0_pid1_run2"
    expected = _model(2.0)[0](torch.ones(2, 4))
    assert torch.equal(ds.tensor("model.0"), expected.detach())
    old = DumpSet.open(tmp_path, run=-2)
    assert old.passes == [0, 1] and old.run.name == "rank0_pid1"
    assert DumpSet.open(tmp_path, run="rank0_pid1").passes == [0, 1]
    assert [r.name for r in list_runs(tmp_path)] == ["rank0_pid1", "rank0_pid1_run2"]
    assert [r.name for r in DumpSet.runs(tmp_path)] == ["rank0_pid1", "rank0_pid1_run2"]
    with pytest.raises(tdinspect.DumpFormatError, match="holds 2 run"):
        DumpSet.open(tmp_path, run=5)


def test_new_pid_after_restart_opens_the_newest(tmp_path, monkeypatch):
    """A kernel restart: a new pid folder beside the old one no longer fails the open."""
    for pid, scale in ((100, 1.0), (200, 3.0)):
        monkeypatch.setattr(os, "getpid", lambda pid=pid: pid)
        _run(tmp_path, _model(scale))
    monkeypatch.undo()
    with pytest.warns(RunWarning, match="opened the newest, rank0_pid200"):
        ds = DumpSet.open(tmp_path)
    assert torch.equal(ds.tensor("model.0"), _model(3.0)[0](torch.ones(2, 4)).detach())
    with pytest.warns(RunWarning):
        assert DumpSet.open(tmp_path).diff(DumpSet.open(tmp_path, run=-2)).first_divergence()


def test_overwrite_removes_earlier_runs_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 7)
    _run(tmp_path, _model())
    with pytest.warns(RunWarning):
        _run(tmp_path, _model())
    with pytest.warns(
        RunWarning,
        match=r"overwrite=True removed 2 earlier run folder\(s\).*"
        r"rank0_pid7, rank0_pid7_run2",
    ):
        folder = _run(tmp_path, _model(2.0), overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert len(list_runs(tmp_path)) == 1


def test_ranks_of_one_run_open_together_runs_apart(tmp_path, monkeypatch):
    """Two runs of two ranks each (world size known): grouped by run, newest opened."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for scale in (1.0, 2.0):
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            if scale == 2.0:
                with pytest.warns(RunWarning):
                    _run(tmp_path, _model(scale))
            else:
                _run(tmp_path, _model(scale))
    runs = list_runs(tmp_path)
    assert [r.ranks for r in runs] == [[0, 1], [0, 1]]
    with pytest.warns(RunWarning):
        ds = DumpSet.open(tmp_path)
    assert ds.ranks == [0, 1]
    assert all(f.path.name.endswith("_run2") for f in ds.run.folders)
    assert DumpSet.open(tmp_path, run=0).ranks == [0, 1]


def test_ranks_without_world_size_group_by_start_time(tmp_path, monkeypatch):
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        _run(tmp_path, _model())
    assert [r.ranks for r in list_runs(tmp_path)] == [[0, 1]]
    assert DumpSet.open(tmp_path).ranks == [0, 1]  # one run: no warning needed


def test_dumps_without_manifests_still_open(tmp_path):
    for rank, pid in ((0, 11), (1, 22)):
        d = tmp_path / f"rank{rank}_pid{pid}"
        d.mkdir()
        torch.save({"model.a": torch.ones(2)}, d / "pass00000.pt")
    assert DumpSet.open(tmp_path).ranks == [0, 1]
    assert [r.ranks for r in list_runs(tmp_path)] == [[0, 1]]


def test_cli_ls_lists_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "getpid", lambda: 1)
    _run(tmp_path, _model(), steps=2)
    with pytest.warns(RunWarning):
        _run(tmp_path, _model())
    with pytest.warns(RunWarning):
        assert cli(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 runs" in out and "rank0_pid1 (started" in out and "rank0_pid1_run2 (started" in out
    assert cli(["ls", str(tmp_path), "--run", "-2"]) == 0
    assert "2 passes" in capsys.readouterr().out


def _notebook(cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(
        nb, timeout=120, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    return [
        "".join(
            o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) + "".join(o.get("traceback", []))
            for o in cell.outputs
        )
        for cell in nb.cells
    ]


def test_rerun_capture_cells_give_the_new_run(tmp_path):
    """Fix the bad model, re-run its capture cell: %tdi_diff sees the new run, not pass 0 of the
    old one; a failing cell says so and marks its pass; a kernel restart opens fine."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    setup = (
        "import torch\ntorch.manual_seed(0)\nm = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
        "x = torch.ones(2, 4)\nimport copy\nb = copy.deepcopy(m)\n"
        "with torch.no_grad(): b[0].weight.mul_(2)\n%load_ext tdinspect"
    )
    out = _notebook(
        [
            setup,
            f"%%tdi_capture {good} --model m\nm(x)",
            f"%%tdi_capture {bad} --model b\nb(x)",
            f"%tdi_diff {good} {bad} --as d\nprint('DIV', d.first_divergence() is not None)",
            "b = m\n",
            f"%%tdi_capture {bad} --model b\nb(x)",
            f"%tdi_diff {good} {bad} --as d\nprint('DIV', d.first_divergence() is not None)",
            f"%%tdi_capture {tmp_path / 'fail'} --model m\nm(x)\n1/0",
            f"%%tdi_capture {bad} --model b --overwrite\nb(x)",
        ]
    )
    assert "DIV True" in out[3]
    assert "(2 runs kept)" in out[5] and "_run2" in out[5]
    assert "DIV False" in out[6] and "opened the newest" in out[6]
    assert "ZeroDivisionError" in out[7] and "the cell raised ZeroDivisionError" in out[7]
    assert "marked failed" in out[7]
    assert "(1 run kept, 2 older removed)" in out[8]
    (folder,) = (tmp_path / "fail").iterdir()
    side = json.loads((folder / "pass00000.json").read_text())
    assert side["failed"].startswith("ZeroDivisionError") and side["entries"]["key"] == ["model.0"]
    assert "cut short by an error" in repr(DumpSet.open(tmp_path / "fail"))
    # a restarted kernel (a new pid): the folders of the earlier kernel do not make it fail
    out = _notebook(
        [
            setup,
            f"%%tdi_capture {good} --model m\nm(x)",
            f"%tdi_open g {good}\nprint('PASSES', g.passes, g.run.name)",
            f"%tdi_diff {good} {bad} --as d\nprint('DIV', d.first_divergence() is not None)",
        ]
    )
    assert "PASSES [0] rank0_pid" in out[2] and "several folders" not in out[2]
    assert "DIV False" in out[3]


def test_rerun_cell_with_an_unclosed_capture_leaves_one_set_of_hooks(tmp_path):
    """`cap = tdinspect.capture(m, DIR)` in a cell run twice: the first capture, never closed,
    kept its hooks on the model and recorded every later forward (doubled hooks, its passes
    growing in memory). Now the new capture closes it, writing what it held, and says so."""
    run = tmp_path / "run"
    setup = (
        "import torch, tdinspect\ntorch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\nx = torch.ones(2, 4)\n"
        "hooks = lambda: sum(len(s._forward_hooks) for s in m.modules())"
    )
    cell = f"cap = tdinspect.capture(m, {str(run)!r})\nm(x)\ncap.step()\nprint('HOOKS', hooks())"
    out = _notebook([setup, cell, f"m(x)\n{cell}", "cap.close()\nm(x)\nprint('HOOKS', hooks())"])
    assert "HOOKS 2" in out[1]
    assert "HOOKS 2" in out[2], out[2]  # one capture's hooks, not two
    assert "closed the earlier capture" in out[2] and "still open" in out[2]
    assert "HOOKS 0" in out[3]
    first, second = sorted(run.iterdir())
    assert second.name == first.name + "_run2"
    # the first run keeps its pass and the forward run before the second cell's capture
    # (written when it was closed); nothing of the second cell went into it
    assert sorted(p.name for p in first.glob("pass*.pt")) == ["pass00000.pt", "pass00001.pt"]
    assert sorted(p.name for p in second.glob("pass*.pt")) == ["pass00000.pt"]
    x = torch.ones(2, 4)
    for folder in (first, second):
        for p in folder.glob("pass*.pt"):
            assert list(load_pass(p)) == ["model.0", "model.1"]
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with torch.no_grad():
        assert torch.equal(load_pass(second / "pass00000.pt")["model.1"], ref(x))


def test_rerun_cell_with_an_unclosed_op_capture_leaves_one_mode(tmp_path):
    """The same with `cap = tdinspect.capture_ops(DIR, model=m).start()`: the first capture's
    dispatch mode stayed on the stack under the second, recording every op of every later cell,
    and stayed there after `cap.close()` closed the second."""
    run = tmp_path / "ops"
    setup = (
        "import torch, tdinspect\ntorch.manual_seed(0)\n"
        "from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as modes\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\nx = torch.ones(2, 4)"
    )
    cell = (
        f"cap = tdinspect.capture_ops({str(run)!r}, model=m).start()\nm(x)\ncap.step()\n"
        "print('MODES', len(modes()))"
    )
    out = _notebook([setup, cell, cell, "cap.close()\nm(x)\nprint('MODES', len(modes()))"])
    assert "MODES 1" in out[1] and "MODES 1" in out[2], out[2]
    assert "closed the earlier op capture" in out[2]
    assert "MODES 0" in out[3]
    first, second = sorted(run.iterdir())
    assert second.name == first.name + "_run2"
    keys = [list(load_pass(f / "pass00000.pt")) for f in (first, second)]
    assert keys[0] == keys[1] and any("aten.addmm" in k for k in keys[0])  # each op once
    assert not (first / "pass00001.pt").exists() and not (second / "pass00001.pt").exists()


def test_rerun_cell_with_another_root_closes_the_capture_it_covers(tmp_path):
    """A cell `cap = capture(m[0], DIR)` edited to `cap = capture(m, DIR)` and re-run: the
    first capture, on a submodule, kept recording beside the new one (both hooked m[0]).
    Now either way round (submodule then model, model then submodule) the new one closes it."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.ones(2, 4)
    hooks = lambda: sum(len(s._forward_hooks) for s in m.modules())  # noqa: E731
    for i, (first_root, second_root, word, keys) in enumerate(
        [
            (m[0], m, "inside this Sequential", ["model.0", "model.1"]),
            (m, m[0], "holding this Linear", ["model"]),
        ]
    ):
        run = tmp_path / str(i)
        first = tdinspect.capture(first_root, run)  # noqa: F841 - held open until the second closes it
        m(x)
        with pytest.warns(RuntimeWarning, match=f"closed the earlier capture of a \\w+ {word}"):
            second = tdinspect.capture(second_root, run)
        assert hooks() == len(second.names)  # the new capture's hooks only
        m(x)
        second.step()
        second.close()
        old, new = sorted(run.iterdir())
        assert [p.name for p in old.glob("pass*.pt")] == ["pass00000.pt"]  # written at close
        assert list(load_pass(new / "pass00000.pt")) == keys
        assert hooks() == 0


def test_captures_of_one_model_into_two_folders_both_record_and_a_warning_says_so(tmp_path):
    """Two captures meant side by side (one per filter, each its own folder) are not a
    re-run cell's: the second keeps the first open, and says both record."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.ones(2, 4)
    first = tdinspect.capture(m, tmp_path / "linear", filter=[r"\.0$"])
    with pytest.warns(RuntimeWarning, match="still open outside a `with`: both record"):
        second = tdinspect.capture(m, tmp_path / "relu", filter=[r"\.1$"])
    m(x)
    first.step()
    second.step()
    first.close()
    second.close()
    (a,), (b,) = (list((tmp_path / n).glob("*/pass00000.pt")) for n in ("linear", "relu"))
    assert list(load_pass(a)) == ["model.0"] and list(load_pass(b)) == ["model.1"]
    assert torch.equal(load_pass(b)["model.1"], m(x))


def test_op_captures_into_two_folders_both_record_and_a_warning_says_so(tmp_path):
    """The same rule for op captures (one mechanism, :mod:`tdinspect.dumper.reruns`): an
    earlier one into another folder stays on the stack, recording."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as modes

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    first = tdinspect.capture_ops(tmp_path / "one", model=m).start()
    try:
        with pytest.warns(RuntimeWarning, match="still open outside a `with`: both record"):
            second = tdinspect.capture_ops(tmp_path / "two", model=m).start()
        assert len(modes()) == 2
        m(torch.ones(2, 4))
        second.step()
        first.step()
    finally:
        second.close()
        first.close()
    assert len(modes()) == 0
    (a,), (b,) = (list((tmp_path / n).glob("*/pass00000.pt")) for n in ("one", "two"))
    keys_a, keys_b = list(load_pass(a)), list(load_pass(b))
    # both recorded the model's ops (the outer one also what the inner one ran to record them)
    assert any("aten.addmm" in k for k in keys_b) and set(keys_b) <= set(keys_a)


def test_overwrite_keeps_the_run_of_a_process_still_writing(tmp_path):
    """Two processes, one folder: overwrite=True removed the folder of a capture still running
    in another process (its pass 0 lost; its next step failed, saying earlier passes were
    complete). That run is kept now, with a warning, and ends whole."""
    script = textwrap.dedent(f"""
        import sys, torch, tdinspect
        model = torch.nn.Sequential(torch.nn.Linear(4, 2))
        with tdinspect.capture(model, {str(tmp_path)!r}) as dump:
            model(torch.ones(2, 4)); dump.step()
            print("pass 0 written", flush=True)
            sys.stdin.readline()
            model(torch.ones(2, 4)); dump.step()
    """)
    writer = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert writer.stdout.readline() == "pass 0 written\n"
        with pytest.warns(
            RunWarning,
            match=rf"kept 1 run folder\(s\) .*still running.*"
            rf"rank0_pid{writer.pid}",
        ):
            folder = _run(tmp_path, _model(), overwrite=True)
    finally:
        writer.communicate("go\n", timeout=120)
    assert writer.returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([folder.name, f"rank0_pid{writer.pid}"])
    assert DumpSet.open(tmp_path / f"rank0_pid{writer.pid}").passes == [0, 1]
    # once that process has ended, its run is an earlier run like any other
    with pytest.warns(RunWarning, match=rf"removed 2 earlier run folder\(s\).*rank0_pid{writer.pid}"):
        last = _run(tmp_path, _model(), overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == [last.name]


@pytest.mark.parametrize("below", [False, True], ids=["the file", "below a file"])
def test_capture_into_a_file_is_a_config_error_naming_it(tmp_path, below):
    """A dump_dir that is a file was a bare ``FileExistsError: [Errno 17] File exists`` (or
    ``NotADirectoryError``) from deep inside the capture."""
    (tmp_path / "notes.txt").write_text("mine")
    target = tmp_path / "notes.txt" / "run" if below else tmp_path / "notes.txt"
    model = _model()
    with pytest.raises(tdinspect.ConfigError, match=rf"dump_dir {target}: not a folder"):
        _run(target, model)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_overwrite_removes_a_linked_run_folder_as_a_link(tmp_path):
    """A run folder that is a symbolic link: rmtree refused it (ignored), so the run stayed
    while the warning said it was removed. The link goes; what it points to is left alone."""
    elsewhere = tmp_path / "elsewhere"
    _run(elsewhere, _model())
    (target,) = list(elsewhere.iterdir())
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "rank0_pid1").symlink_to(target, target_is_directory=True)
    kept = sorted(p.name for p in target.iterdir())
    with pytest.warns(RunWarning, match=r"removed 1 earlier run folder\(s\) .*: rank0_pid1$"):
        folder = _run(dump, _model(), overwrite=True)
    assert [p.name for p in dump.iterdir()] == [folder.name]
    assert sorted(p.name for p in target.iterdir()) == kept
