"""Pass files whose zip structure says two things: a record listed twice, or a directory entry
leading to another record's local header. ``torch.load`` reads such a file without a word (a
record listed twice as its first copy, a misdirected entry as the bytes it leads to), and
tdinspect's record reader read the last copy: the diff then answered about other numbers than
``torch.load`` gives for the same file. Every reader now refuses them, naming the file and
the record."""

from __future__ import annotations

import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import tdinspect
from tdinspect import DumpFormatError, DumpSet, load_pass
from tdinspect.cli import main

from .conftest import only_folder
from .recorded import record_dump

PASS = [{"m.a": torch.arange(8.0), "m.b": torch.arange(8.0) * 2, "m.c": torch.arange(8.0) * 3}]
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header


def _dump(root: Path, sidecars: bool) -> Path:
    """A one-pass dump of three same-sized entries (records data/0..2); its pass file."""
    record_dump(root, PASS)
    folder = only_folder(root)
    if not sidecars:
        (folder / "pass00000.json").unlink()
    return folder / "pass00000.pt"


def _directory(data: bytes) -> dict[str, int]:
    """``{record name: offset of its central directory entry}``."""
    at = data.rfind(b"PK\x05\x06")
    count, _, start = struct.unpack_from("<H2L", data, at + 10)
    out, pos = {}, start
    for _ in range(count):
        fields = _CENTRAL.unpack_from(data, pos)
        out[data[pos + 46 : pos + 46 + fields[10]].decode()] = pos
        pos += 46 + fields[10] + fields[11] + fields[12]
    return out


def _misdirect(path: Path) -> None:
    """Point data/1's directory entry at data/2's local header (same size: the name, CRC and
    size the sidecar's binding digests are unchanged, and so is the file's size)."""
    data = bytearray(path.read_bytes())
    entries = _directory(bytes(data))
    prefix = next(iter(entries)).split("/")[0]
    to = struct.unpack_from("<L", data, entries[f"{prefix}/data/2"] + 42)[0]
    struct.pack_into("<L", data, entries[f"{prefix}/data/1"] + 42, to)
    path.write_bytes(bytes(data))


def _list_twice(path: Path, first: bool) -> None:
    """Rewrite the archive with a second record named data/1 (zeros), before or after the
    real one."""
    with zipfile.ZipFile(path) as src, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
        with zipfile.ZipFile(path.with_suffix(".new"), "w") as dst:
            for info in src.infolist():
                data = src.read(info)
                twin = info.filename.endswith("/data/1")
                if twin and first:
                    dst.writestr(info.filename, bytes(len(data)))
                dst.writestr(info, data)
                if twin and not first:
                    dst.writestr(info.filename, bytes(len(data)))
    path.with_suffix(".new").replace(path)


FORGERIES = {
    "listed twice, zeros first": lambda p: _list_twice(p, True),
    "listed twice, zeros last": lambda p: _list_twice(p, False),
    "entry led to another record": _misdirect,
}


@pytest.mark.filterwarnings("ignore:.*sidecar does not describe:RuntimeWarning")
@pytest.mark.parametrize("sidecars", [True, False], ids=["sidecar", "no sidecar"])
@pytest.mark.parametrize("forge", FORGERIES.values(), ids=FORGERIES.keys())
def test_an_archive_readers_would_read_differently_is_refused_naming_it(tmp_path, capsys, forge, sidecars):
    path = _dump(tmp_path / "forged", sidecars)
    record_dump(tmp_path / "ref", PASS)
    forge(path)
    assert set(torch.load(path, weights_only=True)) == set(PASS[0])  # torch.load takes it
    match = rf"{path.name}: damaged archive: its directory .*data/1"
    with pytest.raises(DumpFormatError, match=match):
        load_pass(path)
    with pytest.raises(DumpFormatError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sidecar of a rewritten archive is ignored
        DumpSet.open(tmp_path / "forged").diff(tmp_path / "ref").first_divergence()
    capsys.readouterr()
    assert main(["first-divergence", str(tmp_path / "ref"), str(tmp_path / "forged")]) == 2
    err = capsys.readouterr().err
    assert path.name in err and "damaged archive" in err and "Traceback" not in err


def test_a_misdirected_entry_keeps_the_sidecar_bound(tmp_path):
    """The forgery the record reader alone would have read: the sidecar still describes the
    file (its binding digests names, CRCs and sizes, not offsets)."""
    path = _dump(tmp_path, sidecars=True)
    _misdirect(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "sidecar ... ignored"
        ds = DumpSet.open(tmp_path)
    with pytest.raises(
        DumpFormatError, match="sends the record '[^']*data/1' to the local header of '[^']*data/2'"
    ):
        ds.tensor("m.b")


def _flip(path: Path, record: str) -> None:
    """Flip one bit of a record's data, as a disk or a copy might (the directory untouched:
    the sidecar's binding still holds)."""
    data = bytearray(path.read_bytes())
    entry = _directory(bytes(data))[next(n for n in _directory(bytes(data)) if n.endswith(record))]
    offset = struct.unpack_from("<L", data, entry + 42)[0]
    nlen, elen = struct.unpack_from("<HH", data, offset + 26)
    data[offset + 30 + nlen + elen + 7] ^= 0x01  # element 1 (2.0) becomes 8.0
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("sidecars", [True, False], ids=["sidecar", "no sidecar"])
@pytest.mark.parametrize("side", ["reference", "compared"])
def test_a_divergence_read_from_a_damaged_record_is_a_dump_format_error(tmp_path, capsys, side, sidecars):
    """Neither torch.load nor the record reader checks CRCs: the bit flipped in m.b's record
    was answered as ``m.b pass 0: rel_diff 1``."""
    damaged = _dump(tmp_path / side, sidecars)
    other = "compared" if side == "reference" else "reference"
    record_dump(tmp_path / other, PASS)
    _flip(damaged, "/data/1")
    assert not torch.equal(torch.load(damaged, weights_only=True)["m.b"], PASS[0]["m.b"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the sidecar is still bound: nothing else says it
        d = DumpSet.open(tmp_path / "reference").diff(tmp_path / "compared")
        with pytest.raises(
            DumpFormatError,
            match=rf"{damaged.name}: record '[^']*data/1' "
            r"\(holding 'm\.b'\) does not match its CRC-32",
        ):
            d.first_divergence()
    assert main(["first-divergence", str(tmp_path / "reference"), str(tmp_path / "compared")]) == 2
    assert "does not match its CRC-32" in capsys.readouterr().err
    # an undamaged record's divergence is answered as before
    _dump(tmp_path / "fresh", sidecars)
    record_dump(tmp_path / "changed", [{**PASS[0], "m.c": PASS[0]["m.c"] + 1}])
    found = DumpSet.open(tmp_path / "fresh").diff(tmp_path / "changed").first_divergence()
    assert found.key == "m.c"


def test_an_entry_held_by_an_earlier_pass_is_not_blamed_on_this_pass_file(tmp_path):
    """A parameter unchanged since pass 0 is a reference in pass 1: its bytes are in pass 0's
    file. Pass 1's own damage (its output's record) was reported for the parameter too (its
    layout names no record, so every record of pass 1 was checked)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with tdinspect.capture(model, tmp_path, record="outputs,params") as dump:
        for _ in range(2):
            model(torch.ones(2, 4))
            dump.step()
    second = only_folder(tmp_path) / "pass00001.pt"
    _flip(second, "/data/0")
    pi = DumpSet.open(tmp_path).get_pass(1)
    assert pi.ref[pi.position["model.0.weight"]]["pass"] == 0
    assert pi.damaged("model.0").endswith("/data/0")
    assert pi.damaged("model.0.weight") is None
    assert DumpSet.open(tmp_path).get_pass(0).damaged("model.0.weight") is None
