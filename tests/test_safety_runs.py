"""overwrite=True removes only finished runs that tdinspect wrote; a capture that cannot
start leaves nothing behind."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import tdinspect
from tdinspect import DumpSet, RunWarning
from tdinspect.store import runs

from .conftest import ROOT


def _model(scale=1.0):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with torch.no_grad():
        m[0].weight.mul_(scale)
    return m


def _run(dump, model, steps=1, **kw):
    x = torch.ones(2, 4)
    with tdinspect.capture(model, dump, environ={}, **kw) as d:
        for _ in range(steps):
            model(x)
            d.step()
    return d.folder


def test_overwrite_keeps_a_capture_still_open_in_this_process(tmp_path):
    """overwrite=True removed the folder of a capture still open in the same process: its
    next step failed (CaptureWriteError ... FileNotFoundError), its pass 0 gone."""
    first_model, x = _model(), torch.ones(2, 4)
    first = tdinspect.capture(first_model, tmp_path, environ={}, background_write=False)
    first_model(x)
    first.step()
    with pytest.warns(RunWarning, match=r"kept 1 run folder\(s\) .* still open in this process"):
        second = _run(tmp_path / "." / ".." / tmp_path.name, _model(2.0), overwrite=True)  # spelt otherwise
    first_model(x)
    first.step()  # was: CaptureWriteError, FileNotFoundError
    first.close()
    assert DumpSet.open(first.folder).passes == [0, 1]
    assert DumpSet.open(second).passes == [0]
    # closed, it is an earlier run like any other
    with pytest.warns(RunWarning, match=r"removed 2 earlier run folder\(s\)"):
        last = _run(tmp_path, _model(), overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == [last.name]


_WRITER = """
import sys, time, torch, tdinspect
from tdinspect.store import runs
real = runs.atomic_write
def slow(path, *a, **kw):  # a run folder's manifest written slowly: the window made wide
    if str(path).endswith("run.json"):
        time.sleep(0.02)
    return real(path, *a, **kw)
runs.atomic_write = slow
model, failed = torch.nn.Sequential(torch.nn.Linear(4, 2)), 0
print("ready", flush=True)
for i in range({n}):
    try:
        with tdinspect.capture(model, {dump!r}, environ={{}}, background_write=False) as dump:
            model(torch.ones(2, 4)); dump.step()
            model(torch.ones(2, 4)); dump.step()
    except Exception as exc:
        failed += 1
        print(type(exc).__name__, exc, file=sys.stderr, flush=True)
print("failed", failed, flush=True)
"""


def test_overwrite_in_one_process_never_removes_a_run_another_is_starting(tmp_path):
    """Two processes, one folder: a run folder existed before its run.json, and a folder
    without a manifest was removed as an old one (2 of 300 captures failed). Now a run
    folder appears with its manifest inside (made under a temporary name, then renamed)."""
    n = 50
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_WRITER.format(n=n, dump=str(tmp_path)))],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout.readline() == "ready\n"
    mine = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        while child.poll() is None and mine < 20 * n:
            _run(tmp_path, _model(), overwrite=True, background_write=False)
            mine += 1
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    assert out.strip() == "failed 0", err
    assert mine > 0
    # every run of the other process that is left is whole
    for folder in tmp_path.glob(f"rank0_pid{child.pid}*"):
        assert DumpSet.open(folder).passes == [0, 1]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_overwrite_removes_only_what_tdinspect_wrote(tmp_path):
    _run(tmp_path, _model())
    (old,) = tmp_path.iterdir()
    (old / "my_notes.txt").write_text("mine")
    young = tmp_path / "rank0_pid99999"  # no manifest, no pass: being made, or not ours
    young.mkdir()
    with pytest.warns(RunWarning) as said:
        new = _run(tmp_path, _model(), overwrite=True)
    text = " ".join(str(w.message) for w in said)
    assert "my_notes.txt" in text and "rank0_pid99999" in text
    assert (old / "my_notes.txt").read_text() == "mine"
    assert sorted(p.name for p in old.iterdir()) == ["my_notes.txt"]
    assert young.is_dir()
    assert DumpSet.open(new).passes == [0]


@pytest.mark.parametrize("exists", [True, False], ids=["dump folder there", "dump folder made"])
def test_a_full_disk_at_capture_start_is_a_capture_write_error_and_leaves_nothing(
    tmp_path, monkeypatch, exists
):
    """Writing run.json on a full disk was a bare OSError, leaving an empty run folder."""
    dump = tmp_path / "dump" / "inner"
    if exists:
        dump.mkdir(parents=True)

    def full(path, *a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(runs, "atomic_write", full)
    model = _model()
    with pytest.raises(tdinspect.CaptureWriteError, match=rf"{dump}/rank0_pid\d+.*No space left on device"):
        _run(dump, model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    if exists:
        assert list(dump.iterdir()) == []
    else:
        assert list(tmp_path.iterdir()) == []
