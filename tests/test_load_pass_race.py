"""``load_pass`` reads the one file it checked: a FIFO swapped in for the pass file after the
check is refused (it hung the reader: ``torch.load`` opened the path again), and a swap after
the file is open changes nothing, mapped (``mmap=True``) or read.

The reader runs in a subprocess with a timeout, so a hang fails the test instead of the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from .conftest import ROOT

# Replaces the pass file by a FIFO right after the first os.lstat of it (the check) or the first
# os.fstat (the file is open by then), then loads it.
_SWAP = textwrap.dedent("""
    import os, sys
    from tdinspect import DumpFormatError
    from tdinspect.store.format import load_pass
    path, when, mmap = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    real, swapped = getattr(os, when), []

    def swap_after(target, *args, **kwargs):
        st = real(target, *args, **kwargs)
        if not swapped and (when == "fstat" or os.fspath(target) == path):
            swapped.append(True)
            os.rename(path, path + ".old")
            os.mkfifo(path)
        return st

    setattr(os, when, swap_after)
    try:
        tensors = load_pass(path, mmap=mmap)
    except DumpFormatError as exc:
        print("refused:", exc)
    else:
        with open("/proc/self/maps") as maps:
            mapped = (path + ".old") in maps.read()
        print("read:", sorted(tensors), tensors["a"].tolist(), "mapped" if mapped else "read-in")
""")


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("when", ["lstat", "fstat"])  # the check is an lstat (links refused)
def test_a_fifo_swapped_in_for_a_pass_file_neither_hangs_nor_is_read(tmp_path, when, mmap):
    path = tmp_path / "pass00000.pt"
    torch.save({"a": torch.arange(4.0)}, path)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SWAP, str(path), when, str(int(mmap))],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"load_pass blocked on the FIFO swapped in after os.{when}")
    assert done.returncode == 0, done.stderr
    if when == "lstat":  # swapped between the check and the open: refused, naming the file
        assert done.stdout.startswith("refused:"), done.stdout
        assert str(path) in done.stdout and "not a regular file (a FIFO)" in done.stdout
    else:  # swapped once the file is open: the file checked is the file read (and mapped)
        assert done.stdout.split() == [
            "read:",
            "['a']",
            "[0.0,",
            "1.0,",
            "2.0,",
            "3.0]",
            "mapped" if mmap else "read-in",
        ], done.stdout
