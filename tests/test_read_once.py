"""Each pass file is read once: its zip index (sidecar binding and record reader share it), and,
without a sidecar, its pickle (the open's load is handed to the first read)."""

from __future__ import annotations

import os
import pickle
import zipfile
from collections import Counter

import pytest
import torch

import tdinspect.store.picklelayout as picklelayout
import tdinspect.store.rawpass as rawpass
import tdinspect.store.zipindex as zipindex
from tdinspect.dumpset import DumpSet
from tdinspect.numerics.metrics import same_bits
from tdinspect.store import passindex

from .recorded import record_dump
from .test_dumpset_diff import write_dump


def _run(root, passes=3, scale=1.0, sidecars=True):
    """A dump of ``passes`` x 4 small entries: written by tdinspect, or by plain torch.save."""
    tensors = [
        {f"model.layers.{e}.out": torch.arange(12.0).reshape(3, 4) * (p + e + 1) * scale for e in range(4)}
        for p in range(passes)
    ]
    if not sidecars:
        return write_dump(root, tensors)
    return record_dump(root, tensors)


def test_the_fast_index_reads_what_zipfile_reads(tmp_path):
    torch.save({"a": torch.randn(5), "b": torch.ones(2, dtype=torch.bfloat16)}, tmp_path / "t.pt")
    plain = tmp_path / "odd.zip"
    with zipfile.ZipFile(plain, "w") as zf:  # compressed, non-ASCII, a comment
        zf.writestr("a/é.txt", b"hello" * 100, compress_type=zipfile.ZIP_DEFLATED)
        zf.writestr("a/b", b"x")
        zf.comment = b"a comment"
    prefixed = tmp_path / "prefixed.zip"  # data before the archive: zipfile's own reading
    prefixed.write_bytes(b"junk" + plain.read_bytes())
    forced = tmp_path / "zip64.zip"
    with zipfile.ZipFile(forced, "w") as zf:
        with zf.open("big", "w", force_zip64=True) as f:
            f.write(b"y" * 1000)
    for path in (tmp_path / "t.pt", plain, prefixed, forced):
        index = zipindex.read_index(path)
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
        assert index.records == {
            i.filename: (i.header_offset, i.file_size, i.compress_type, i.CRC) for i in infos
        }, path
        with open(path, "rb") as f:  # the binding's digest, as zipfile's reading gives it
            assert index.digest == zipindex._slow(f)[2], path
        assert index.size == path.stat().st_size
    for path, fast in ((tmp_path / "t.pt", True), (plain, True), (prefixed, False)):
        with open(path, "rb") as f:  # the comparison above holds because _fast itself read it
            assert (zipindex._fast(f, path.stat().st_size) is not None) == fast, path
    assert zipindex.read_index(tmp_path / "missing.pt") is None
    (tmp_path / "not.zip").write_bytes(b"not an archive" * 10)
    assert zipindex.read_index(tmp_path / "not.zip") is None
    (tmp_path / "cut.pt").write_bytes((tmp_path / "t.pt").read_bytes()[:-30])
    assert zipindex.read_index(tmp_path / "cut.pt") is None


def _spy(monkeypatch, module, name, key=lambda f: os.path.realpath(f.name if hasattr(f, "read") else f)):
    """Count the calls of ``module.name`` by the file of their first argument (a path, an open
    file, or ``/proc/self/fd/N``: load_pass maps a file by its descriptor's name)."""
    calls = Counter()
    real = getattr(module, name)

    def spy(f, *args, **kwargs):
        calls[key(f)] += 1
        return real(f, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_open_and_diff_read_each_zip_index_once(tmp_path, monkeypatch):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", scale=1.1)
    indexes = _spy(monkeypatch, zipindex, "index_of")
    monkeypatch.setattr(rawpass, "index_of", zipindex.index_of)  # the record reader's name for it
    loads = _spy(monkeypatch, torch, "load")
    diff = DumpSet.open(a).diff(b)
    assert all(pi._zip is not None for pi in diff.a.pass_indexes() + diff.b.pass_indexes())
    div = diff.first_divergence()
    assert (div.pass_, div.key) == (0, "model.layers.0.out")
    rows = diff.table(progress=False)
    assert len(rows) == 12 and rows["max_abs"].gt(0).all()
    files = sorted(str(p) for p in list(a.rglob("*.pt")) + list(b.rglob("*.pt")))
    # once each; the divergence's two pass files once more, to check its records' CRC-32s
    checked = {str(p) for p in list(a.rglob("pass00000.pt")) + list(b.rglob("pass00000.pt"))}
    assert sorted(indexes) == files, indexes
    assert dict(indexes) == {f: 1 + (f in checked) for f in files}, indexes
    assert not loads  # nothing unpickled: the records are read as the sidecars lay them out
    assert all(pi._zip is None for pi in diff.a.pass_indexes())  # used once, then let go
    DumpSet.open(a).diff(b).table(progress=False)
    assert dict(indexes) == {f: 2 + (f in checked) for f in files}, indexes


def test_a_stale_index_is_read_again(tmp_path):
    tensors = {"a": torch.arange(4.0), "b": torch.arange(6.0)}
    torch.save(tensors, tmp_path / "pass00000.pt")
    torch.save({"pad": torch.zeros(1000), **tensors}, tmp_path / "other.pt")
    stale = zipindex.read_index(tmp_path / "other.pt")  # another file: other offsets
    back = rawpass.read_raw(tmp_path / "pass00000.pt", ["a", "b"], rawpass.layout(tensors), stale)
    assert back is not None and all(same_bits(back[k], tensors[k]) for k in tensors)


def test_without_a_sidecar_a_plain_file_is_never_unpickled(tmp_path, monkeypatch):
    a = _run(tmp_path / "a", sidecars=False)
    b = _run(tmp_path / "b", scale=1.1, sidecars=False)
    loads = _spy(monkeypatch, torch, "load")
    opcode_reads = _spy(monkeypatch, picklelayout, "_exact_layout", key=lambda data: "pickle")
    diff = DumpSet.open(a).diff(b)
    assert diff.first_divergence().pass_ == 0
    rows = diff.table(progress=False)
    assert len(rows) == 12 and rows["max_abs"].gt(0).all()
    diff.to_xarray()
    assert not loads  # each file's layout read from its pickle's opcodes, then its records
    assert not opcode_reads  # by the template reader: the opcode reader is for anything else
    ds = DumpSet.open(a)
    assert all(pi.raw is not None and pi._held is not None for pi in ds.pass_indexes())
    monkeypatch.undo()
    for pi in ds.pass_indexes():
        truth = torch.load(pi.files.tensors, weights_only=True)
        got = pi.load()
        assert list(got) == list(truth) and all(same_bits(got[k], truth[k]) for k in truth)
        assert pi.shape == [list(t.shape) for t in truth.values()]  # from the layout read
        assert pi.dtype == [str(t.dtype) for t in truth.values()]


def test_without_a_sidecar_other_files_are_unpickled_once(tmp_path, monkeypatch):
    passes = [
        {
            "model.a": (torch.ones(3) * p).to(torch.float8_e4m3fn),  # saved another way
            "model.b": torch.arange(4.0) + p,
        }
        for p in range(3)
    ]
    a, b = write_dump(tmp_path / "a", passes), write_dump(tmp_path / "b", passes)
    loads = _spy(monkeypatch, torch, "load")
    diff = DumpSet.open(a).diff(b)
    assert diff.first_divergence() is None
    assert len(loads) == 6 and set(loads.values()) == {1}, loads  # the open's load, handed on
    DumpSet.open(a).ensure_stats(progress=False)  # another open reads again, once
    assert sorted(loads.values()) == [1, 1, 1, 2, 2, 2]


def test_tensors_held_from_open_are_bounded_and_never_travel(tmp_path, monkeypatch):
    monkeypatch.setattr(passindex, "HELD_PASSES", 2)
    a = write_dump(
        tmp_path / "a", [{"model.x": (torch.ones(2) * p).to(torch.float8_e5m2)} for p in range(4)]
    )  # read with torch.load
    ds = DumpSet.open(a)
    assert [pi._held is not None for pi in ds.pass_indexes()] == [False, False, True, True]
    copy = pickle.loads(pickle.dumps(ds.get_pass(3)))  # what a dask worker receives
    assert copy._held is None and copy._zip is None and copy.keys == ds.get_pass(3).keys
    for pi in ds.pass_indexes():  # held or read again: the file's tensors
        truth = torch.load(pi.files.tensors, weights_only=True)
        got = pi.load()
        assert list(got) == list(truth) and all(same_bits(got[k], truth[k]) for k in truth)
    assert all(pi._held is None for pi in ds.pass_indexes())


@pytest.mark.parametrize("where", [0, 300, 1023])
def test_same_bits_looks_at_every_element(where):
    x = torch.randn(1024)
    y = x.clone()
    assert same_bits(x, y)
    y[where] = torch.nextafter(y[where], torch.tensor(10.0))
    assert not same_bits(x, y)
    assert not same_bits(x.reshape(32, 32).t(), y.reshape(32, 32).t())  # not contiguous
    assert same_bits(x.reshape(32, 32).t(), x.clone().reshape(32, 32).t())
    assert not same_bits(torch.zeros(300), -torch.zeros(300))
