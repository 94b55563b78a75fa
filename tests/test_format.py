"""The on-disk format: load_pass safety, atomic writes under SIGKILL, bad files, layout discovery."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import tdinspect
from tdinspect import DumpFormatError, DumpSet, load_pass
from tdinspect.store.format import atomic_write
from tdinspect.store.runs import discover

from .conftest import ROOT, only_folder


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "pass00000.pt"
    torch.save({"model.x": torch.ones(2), "evil": _Evil(marker)}, bad)
    with pytest.raises(DumpFormatError, match=r"pass00000\.pt.*refused"):
        load_pass(bad)
    raw = tmp_path / "raw" / "pass00000.pt"
    raw.parent.mkdir()
    raw.write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(DumpFormatError, match="pass00000.pt"):
        load_pass(raw)
    assert not marker.exists()


@pytest.mark.parametrize(
    "content,match",
    [
        (b"", "empty file"),
        (b"\x00\x01garbage" * 10, "not a torch.save file"),
    ],
)
def test_damaged_files_name_the_file(tmp_path, content, match):
    p = tmp_path / "pass00000.pt"
    p.write_bytes(content)
    with pytest.raises(DumpFormatError, match=match) as err:
        load_pass(p)
    assert str(p) in str(err.value)


def test_truncated_and_wrong_type(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"a": torch.randn(1000)}, good)
    trunc = tmp_path / "pass00000.pt"
    trunc.write_bytes(good.read_bytes()[:2000])
    with pytest.raises(DumpFormatError, match="pass00000.pt"):
        load_pass(trunc)
    lst = tmp_path / "pass00001.pt"
    torch.save([torch.ones(1)], lst)
    with pytest.raises(DumpFormatError, match="expected a dict of tensors, found list"):
        load_pass(lst)
    nt = tmp_path / "pass00002.pt"
    torch.save({"a": 3}, nt)
    with pytest.raises(DumpFormatError, match="entry 'a' is a int"):
        load_pass(nt)


def test_load_pass_keeps_order_and_mmaps(tmp_path):
    p = tmp_path / "pass00000.pt"
    data = {f"model.l{i}": torch.full((3,), float(i)) for i in (5, 1, 9, 0)}
    torch.save(data, p)
    out = load_pass(p)
    assert list(out) == list(data)
    assert all(torch.equal(out[k], data[k]) for k in data)


def test_atomic_write_failure_keeps_old_file(tmp_path):
    p = tmp_path / "pass00000.pt"
    p.write_bytes(b"old")

    def fail(f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(p, fail)
    assert p.read_bytes() == b"old"
    assert [x.name for x in tmp_path.iterdir()] == ["pass00000.pt"]


def test_sigkill_mid_write_leaves_complete_passes_only(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch, tdinspect
        from tdinspect.examples.models import make_model, make_tokens
        model = make_model()
        real_save = torch.save
        calls = []
        def dying_save(obj, f, *a, **k):
            calls.append(1)
            if len(calls) == 2:   # second pass: write half of it, then die
                f.write(b"PK\\x03\\x04" + b"x" * 100000)
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(obj, f, *a, **k)
        torch.save = dying_save
        with tdinspect.capture(model, {str(tmp_path)!r}) as dump:
            for s in range(3):
                model(make_tokens(seed=s))
                dump.step()
                dump.recorder.writer.flush()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    folder = only_folder(tmp_path)
    finals = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert "pass00000.pt" in finals and "pass00001.pt" not in finals
    assert len(load_pass(folder / "pass00000.pt")) == 42
    ds = DumpSet.open(tmp_path)  # the half-written pass is invisible; its sidecar alone is ignored
    assert ds.passes == [0]


def test_full_disk_stops_capture_with_clear_error(tmp_path, model, tokens, monkeypatch):
    from tdinspect.dumper import writer

    real = writer.save_pass
    state = {"n": 0}

    def enospc(path, tensors, fsync=False, **kw):
        state["n"] += 1
        if state["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(path, tensors, fsync=fsync, **kw)

    monkeypatch.setattr(writer, "save_pass", enospc)
    with pytest.raises(tdinspect.CaptureWriteError, match="pass 1.*No space left"):
        with tdinspect.capture(model, tmp_path) as dump:
            for _ in range(4):
                model(tokens)
                dump.step()
                dump.recorder.writer.flush()
    assert all(not m._forward_hooks for m in model.modules())
    folder = only_folder(tmp_path)
    assert len(load_pass(folder / "pass00000.pt")) == 42
    assert not (folder / "pass00001.pt").exists()


def test_discover_errors(tmp_path):
    with pytest.raises(DumpFormatError, match="no such file"):
        discover(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpFormatError, match="not a dump"):
        discover(tmp_path / "empty")
    for pid, when in ((22, 1000), (11, 2000)):  # two runs of rank 0 written before manifests
        d = tmp_path / "dup" / f"rank0_pid{pid}"
        d.mkdir(parents=True)
        torch.save({"a": torch.ones(1)}, d / "pass00000.pt")
        os.utime(d / "pass00000.pt", (when, when))
    assert [f.path.name for f in discover(tmp_path / "dup")] == ["rank0_pid11"]  # the newest
    assert [f.path.name for f in discover(tmp_path / "dup", run=-2)] == ["rank0_pid22"]
    with pytest.raises(DumpFormatError, match="not a pass file"):
        (tmp_path / "x.txt").write_text("hi")
        discover(tmp_path / "x.txt")


def test_a_pickle_protocol_4_file_names_the_protocol(tmp_path):
    """Another tool's ``torch.save(..., pickle_protocol=4)``: torch's weights_only reader
    refuses its FRAME opcode; the error said "damaged, or not written by torch.save"."""
    folder = tmp_path / "dump" / "rank0_pid1"
    folder.mkdir(parents=True)
    torch.save({"m.a": torch.ones(3)}, folder / "pass00000.pt", pickle_protocol=4)
    with pytest.raises(DumpFormatError, match=r"pass00000\.pt: .*pickle_protocol=4"):
        DumpSet.open(tmp_path / "dump")
    from tdinspect.cli import main

    assert main(["ls", str(tmp_path / "dump")]) == 2


def test_a_text_file_named_as_a_pass_file_is_called_what_it_is(tmp_path):
    """A pass00000.pt holding the text 'garbage' was reported as 'pickle opcode 103 (damaged,
    or saved with a pickle protocol above 2)': it is not a torch.save file at all."""
    (tmp_path / "pass00000.pt").write_text("garbage")
    with pytest.raises(DumpFormatError, match=r"pass00000\.pt: not a torch\.save file"):
        load_pass(tmp_path / "pass00000.pt")
