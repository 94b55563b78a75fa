"""Mapping files that are not what they claim: a FIFO, a device, a folder, bytes that are not
UTF-8, nesting past the stack, a few bytes of YAML aliases standing for millions of values.
Each is a ``MappingError`` naming the file, through the API and the CLI: before, ``/dev/zero``
filled memory until the process was killed, a FIFO blocked forever, undecodable bytes and
deep nesting were a ``UnicodeDecodeError`` or a ``RecursionError`` naming no file, and a
310-byte alias file took 14 s and 1.9 GB to say it was malformed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tdinspect import DumpSet
from tdinspect.align.mapping import Mapping
from tdinspect.cli import main
from tdinspect.errors import MappingError

from .recorded import record_dump
from .test_hostile_files import _within


def _aliases(levels: int) -> str:
    """One rule whose value nests ``levels`` lists, each 9 aliases of the one before."""
    parts = ["&l0 [" + ",".join(['"lol"'] * 9) + "]"]
    parts += [f"&l{n} [" + ",".join([f"*l{n - 1}"] * 9) + "]" for n in range(1, levels)]
    return '"a.*": [b, null, [' + ", ".join(parts) + "]]\n"


def _make(kind: str, path: Path) -> str:
    """Put a hostile mapping file of ``kind`` at ``path``; what its error says."""
    if kind == "fifo":
        os.mkfifo(path)
        return "not a regular file"
    if kind == "device":
        os.symlink("/dev/zero", path)
        return "not a regular file"
    if kind == "folder":
        path.mkdir()
        return "not a regular file"
    if kind == "not utf-8":
        path.write_bytes(b'"a": "b"\n\xff\xfe')
        return "not UTF-8 at byte 9"
    if kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
        return "nested too deeply"
    path.write_text(_aliases(8))  # 9**8 strings behind 310 bytes
    return "aliases"


KINDS = ["fifo", "device", "folder", "not utf-8", "deep", "aliases"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_mapping_file_is_a_mapping_error_naming_it(tmp_path, capsys, kind):
    path = tmp_path / "rules.yaml"
    says = _make(kind, path)
    with pytest.raises(MappingError) as caught:
        _within(30, lambda: Mapping.from_file(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and says in message and len(message) < 300
    for run in ("a", "b"):
        record_dump(tmp_path / run, [{"m.x": torch.ones(3)}])
    with pytest.raises(MappingError, match=says):
        _within(30, lambda: DumpSet.open(tmp_path / "a").diff(tmp_path / "b", mapping=str(path)))
    capsys.readouterr()
    code = _within(
        30, lambda: main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--mapping", str(path)])
    )
    err = capsys.readouterr().err
    assert code == 2 and str(path) in err and says in err and "Traceback" not in err


def test_values_quoted_in_rule_errors_are_cut_short():
    """A wrong rule is quoted in its error, at most a few items of it (a value that is one
    big list made the message as big)."""
    with pytest.raises(MappingError) as caught:
        Mapping({"a": ["b", None, list(range(10**6))]})
    assert "expected b_template or [b_template, transform]" in str(caught.value)
    assert len(str(caught.value)) < 300
