"""Tensors and files a dump can forge: checked before use, refused naming the file, never a
crash, a read outside the dump, or an allocation far beyond what the file holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tdinspect
from tdinspect import DumpFormatError, DumpSet, load_pass
from tdinspect.cli import main

from .conftest import ROOT

RUN = {"cwd": ROOT, "capture_output": True, "text": True, "timeout": 300}


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _forged_sparse(folder: Path, indices, size) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    indices = torch.tensor(indices, dtype=torch.int64)
    values = torch.arange(1.0, indices.shape[1] + 1.0)
    t = torch.sparse_coo_tensor(indices, values, size, check_invariants=False)  # as a forger would
    torch.save({"model.a": t}, folder / "pass00000.pt")
    return folder


def test_random_forged_tensors_read_or_are_refused_under_a_memory_limit():
    """hypothesis: sparse indices anywhere (2^20, 2^62, negative), sizes up to 2^40, strides
    and offsets against the record; each read gives torch's own checked answer or a
    DumpFormatError, in a process limited to 6 GB of address space (before: double free or
    corruption, the process died)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fuzz_readers.py"), str(6 << 30)],
        env={**_env(), "FUZZ_EXAMPLES": "50"},
        **RUN,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    peak = float(out.stdout.split("peak")[1].split()[0])
    assert out.stdout.startswith("ok") and peak < 1500, out.stdout


@pytest.mark.parametrize("row", [2**20, 2**62, -1])
def test_a_sparse_index_past_its_size_is_refused_by_every_reader(tmp_path, row):
    """A 4x4 sparse tensor with one index at row 2^20 (an out-of-bounds write when made
    dense: SIGSEGV in ls/stats), 2^62 (wrapped silently to element 0) or -1."""
    folder = _forged_sparse(tmp_path / "dump", [[0, row], [0, 1]], (4, 4))
    with pytest.raises(
        DumpFormatError, match=r"pass00000\.pt: entry 'model\.a': a damaged torch\.sparse_coo"
    ):
        load_pass(folder / "pass00000.pt")
    with pytest.raises(DumpFormatError, match="pass00000.pt"):
        DumpSet.open(folder).tensor("model.a")
    for command in ("ls", "stats", "first-nonfinite"):
        out = subprocess.run([sys.executable, "-m", "tdinspect", command, str(folder)], env=_env(), **RUN)
        assert out.returncode == 2 and "pass00000.pt" in out.stderr and "damaged" in out.stderr, (
            command,
            out.returncode,
            out.stderr[-500:],
        )


def test_an_empty_sparse_tensor_whose_dense_strides_overflow_is_refused(tmp_path):
    """A sparse tensor of size 0 x 2^40 x 2^40 holds no element and passes the checks, yet
    torch cannot make it dense (its strides overflow int64): a RuntimeError left every reader
    (found by fuzz_readers); now a DumpFormatError naming the file, and CLI exit 2."""
    folder = _forged_sparse(tmp_path / "dump", [[], [], []], (0, 2**40, 2**40))
    with pytest.raises(DumpFormatError, match=r"pass00000\.pt.*cannot be made dense"):
        DumpSet.open(folder).tensor("model.a")
    out = subprocess.run([sys.executable, "-m", "tdinspect", "stats", str(folder)], env=_env(), **RUN)
    assert out.returncode == 2 and "pass00000.pt" in out.stderr, out.stderr[-500:]


def test_a_sparse_tensor_claiming_gigabytes_dense_is_refused_without_allocating(tmp_path):
    """A 2 KB file holding a 32768 x 32768 sparse tensor: ls made it dense (4.3 GB peak);
    now refused from its size alone, in a process that stays small."""
    folder = _forged_sparse(tmp_path / "dump", [[1], [2]], (2**15, 2**15))
    assert (folder / "pass00000.pt").stat().st_size < 4096
    code = (
        "import resource, sys; from tdinspect.cli import main; rc = main(['ls', sys.argv[1]]); "
        "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, 'rc', rc)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(folder)], env=_env(), **RUN)
    assert "rc 2" in out.stdout and "would be 4294967296 bytes dense" in out.stderr, out.stderr[-500:]
    assert int(out.stdout.split()[1]) < 1500, out.stdout
    # a reader that wants it anyway says so
    out = subprocess.run(
        [sys.executable, "-m", "tdinspect", "ls", str(folder)],
        env={**_env(), "TDINSPECT_MAX_DENSE_BYTES": str(8 << 30)},
        **RUN,
    )
    assert out.returncode == 0 and "[32768, 32768]" in out.stdout


def test_a_sparse_tensor_of_fair_size_still_reads_dense(tmp_path):
    t = torch.eye(5).to_sparse()
    (tmp_path / "d").mkdir()
    torch.save({"model.a": t, "model.b": torch.eye(3).to_sparse_csr()}, tmp_path / "d" / "pass00000.pt")
    ds = DumpSet.open(tmp_path / "d")
    assert torch.equal(ds.tensor("model.a"), torch.eye(5)) and torch.equal(ds.tensor("model.b"), torch.eye(3))


def _two_pass_dump(root: Path) -> Path:
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with torch.no_grad(), tdinspect.capture(m, root) as cap:
        for _ in range(2):
            m(torch.ones(1, 2))
            cap.step()
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    return folder


def test_a_link_leading_out_of_the_dump_is_refused_and_never_read(tmp_path):
    """pass00001.pt as a link to a private file elsewhere: `tdinspect stats` printed that
    file's tensor. Now refused naming the link; an audit hook over the whole CLI run sees no
    open of the private file (paths resolved, not trusted by name)."""
    folder = _two_pass_dump(tmp_path / "dump")
    private = tmp_path / "private" / "weights.pt"
    private.parent.mkdir()
    torch.save(
        {"secret": torch.tensor([1.25e30, 1.5e30])}, private
    )  # printed "e+30": no path or pid holds it
    (folder / "pass00001.pt").unlink()
    (folder / "pass00001.json").unlink()
    (folder / "pass00001.pt").symlink_to(private)
    with pytest.raises(DumpFormatError, match=r"pass00001\.pt: unreadable pass file \(a link"):
        DumpSet.open(tmp_path / "dump")
    with pytest.warns(RuntimeWarning, match="skipping unreadable pass"):
        assert DumpSet.open(tmp_path / "dump", on_error="warn").passes == [0]
    code = (
        "import os, sys\n"
        "seen = []\n"
        "sys.addaudithook(lambda e, a: seen.append(os.path.realpath(a[0])) "
        "if e == 'open' and isinstance(a[0], (str, bytes, os.PathLike)) else None)\n"
        "from tdinspect.cli import main\n"
        "rc = main(['stats', sys.argv[1]])\n"
        "print('rc', rc, 'opened', sys.argv[2] in seen)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dump"), str(private.resolve())], env=_env(), **RUN
    )
    assert "rc 2 opened False" in out.stdout, (out.stdout, out.stderr[-500:])
    assert "e+30" not in out.stdout + out.stderr and "never through links" in out.stderr


def test_a_folder_link_leading_out_is_refused_and_a_dump_reached_through_a_link_reads(tmp_path):
    folder = _two_pass_dump(tmp_path / "dump")
    # the dump itself named through a link (the user's choice of path) reads as usual
    (tmp_path / "latest").symlink_to(tmp_path / "dump", target_is_directory=True)
    assert DumpSet.open(tmp_path / "latest").passes == [0, 1] and folder.is_dir()
    # a rank folder that is a link to a folder elsewhere is not the dump's
    elsewhere = _two_pass_dump(tmp_path / "other")
    (tmp_path / "dump2").mkdir()
    (tmp_path / "dump2" / "rank0_pid1").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(DumpFormatError, match="rank0_pid1: a link to .*outside the dump"):
        DumpSet.open(tmp_path / "dump2")


def test_a_huge_sidecar_is_refused_naming_it_and_skipped_on_warn(tmp_path, capsys):
    """An 8 GiB sparse file as pass00001.json (a statistics-only pass): a bare MemoryError
    before, and on_error='warn' did not skip it."""
    folder = _two_pass_dump(tmp_path / "dump")
    (folder / "pass00001.pt").unlink()
    with open(folder / "pass00001.json", "r+b") as f:
        f.truncate(8 << 30)  # holes: no disk used
    with pytest.raises(DumpFormatError, match=r"pass00001\.json: a sidecar of 8589934592 bytes"):
        DumpSet.open(tmp_path / "dump")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = DumpSet.open(tmp_path / "dump", on_error="warn")
    assert ds.passes == [0] and any("pass00001.json" in str(w.message) for w in caught)
    assert main(["ls", str(tmp_path / "dump")]) == 2
    assert "a sidecar of 8589934592 bytes" in capsys.readouterr().err


def test_a_valid_sidecar_still_reads(tmp_path):
    folder = _two_pass_dump(tmp_path / "dump")
    doc = json.loads((folder / "pass00000.json").read_text())
    assert doc["format"] == "tdinspect.pass" and DumpSet.open(tmp_path / "dump").passes == [0, 1]
