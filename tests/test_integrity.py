"""No capture is silently lost: full disk, Ctrl-C, file modes, load_pass without a mapping."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

import tdinspect
from tdinspect import DumpSet, load_pass
from tdinspect.format import atomic_write

from .conftest import only_folder


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 20 MB tmpfs (needs root; skipped elsewhere)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _big_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 1 << 16), torch.nn.ReLU())  # 4 MB per output


@pytest.mark.parametrize("background", [False, True])
def test_real_full_disk_says_no_space_left(tiny_disk, background):
    model, x = _big_model(), torch.randn(16, 64)
    with pytest.raises(tdinspect.CaptureWriteError, match="No space left on device") as info:
        with tdinspect.capture(model, tiny_disk / "d", background_write=background) as dump:
            for _ in range(10):  # 8 MB a pass: the third cannot fit
                model(x)
                dump.step()
                dump.recorder.writer.flush()
    assert "unexpected pos" not in str(info.value).split("(")[0]
    folder = only_folder(tiny_disk / "d")
    finals = sorted(p.name for p in folder.iterdir() if p.name.startswith("pass"))
    assert finals[:4] == ["pass00000.json", "pass00000.pt", "pass00001.json", "pass00001.pt"]
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    for name in finals:
        if name.endswith(".pt"):
            assert len(load_pass(folder / name)) == 2
    assert DumpSet.open(tiny_disk / "d").passes == [0, 1]


def test_full_disk_inside_torch_save_names_the_cause(tmp_path, monkeypatch):
    """Without root: torch's zip writer hits ENOSPC and reports 'unexpected pos'; the message
    still says No space left on device."""
    from tdinspect import format as fmt

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f, limit):
            self.f, self.left = f, limit

        def write(self, data):
            if len(data) > self.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    real_create = fmt._create_temporary
    created = {}

    def create(path):
        fd, tmp = real_create(path)
        created[fd] = path.name
        return fd, tmp

    def fdopen(fd, mode="r", *args, **kwargs):
        f = real_fdopen(fd, mode, *args, **kwargs)
        return Full(f, 1000) if created.get(fd) == "pass00001.pt" else f

    monkeypatch.setattr(fmt, "_create_temporary", create)
    monkeypatch.setattr(fmt.os, "fdopen", fdopen)
    model, x = _big_model(), torch.randn(2, 64)
    with pytest.raises(tdinspect.CaptureWriteError, match=r"pass 1 .*No space left on device"):
        with tdinspect.capture(model, tmp_path, background_write=False) as dump:
            for _ in range(3):
                model(x)
                dump.step()
    folder = only_folder(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["pass00000.json", "pass00000.pt",
                                                          "run.json"]


def test_ctrl_c_during_inline_write_is_a_keyboard_interrupt(tmp_path, monkeypatch):
    from tdinspect.dumper import writer

    real = writer.save_pass
    calls = {"n": 0}

    def interrupted(path, tensors, fsync=False, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            def write(f):
                f.write(b"PK\x03\x04 half a pass")
                raise KeyboardInterrupt
            atomic_write(path, write)
        return real(path, tensors, fsync=fsync, **kw)

    monkeypatch.setattr(writer, "save_pass", interrupted)
    model, x = _big_model(), torch.randn(2, 64)
    with pytest.raises(KeyboardInterrupt):
        with tdinspect.capture(model, tmp_path, background_write=False) as dump:
            for _ in range(3):
                model(x)
                dump.step()
    assert all(not m._forward_hooks for m in model.modules())
    folder = only_folder(tmp_path)
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(("pass", "."))) == [
        "pass00000.json", "pass00000.pt"]
    assert len(load_pass(folder / "pass00000.pt")) == 2


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_files_respect_the_umask(tmp_path, umask):
    model, x = _big_model(), torch.randn(2, 64)
    old = os.umask(umask)
    try:
        with tdinspect.capture(model, tmp_path / "d", background_write=False) as dump:
            model(x)
            dump.step()
        torch.save({}, tmp_path / "reference.pt")
    finally:
        os.umask(old)
    expected = (tmp_path / "reference.pt").stat().st_mode & 0o777
    assert expected == 0o666 & ~umask
    files = [p for p in only_folder(tmp_path / "d").iterdir() if p.is_file()]
    assert files and {p.stat().st_mode & 0o777 for p in files} == {expected}


def test_load_pass_result_can_be_modified_and_saved_over_its_file(tmp_path):
    model, x = _big_model(), torch.randn(2, 64)
    with tdinspect.capture(model, tmp_path, background_write=False) as dump:
        model(x)
        dump.step()
    p = only_folder(tmp_path) / "pass00000.pt"
    before = load_pass(p)
    k = "model.0"
    # the exact sequence of the report, in a child: on failure it dies of SIGBUS
    code = ("import sys, torch; from tdinspect import load_pass; p = sys.argv[1]; "
            "t = load_pass(p); t['model.0'] *= 2; torch.save(t, p)")
    done = subprocess.run([os.sys.executable, "-c", code, str(p)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(tdinspect.__path__[0].rsplit(os.sep, 1)[0]),
                               os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-500:]
    after = load_pass(p)
    assert torch.equal(after[k], before[k] * 2)
    assert torch.equal(after["model.1"], before["model.1"])
    mapped = load_pass(p, mmap=True)  # the opt-in still maps
    assert torch.equal(mapped[k], after[k])
