"""Sidecars are checked caches: bound to their pass file, and validated column by column.

A sidecar holds facts about its pass file (keys, shapes, statistics...) so
that a dump opens without reading tensors. A stale or hand-edited sidecar must
never give a wrong answer, and no sidecar, however forged, may make the reader
do more than read the pass file's own records or fail other than with a
:class:`~tdinspect.store.format.DumpFormatError` naming the file:

- **Binding.** When the writer saves a pass, the sidecar gets a ``binding``
  (its last field): the pass file's size, a digest of the archive's records
  (name, CRC-32 and size of every record, read from the zip's central
  directory without reading tensor data) and a digest of the sidecar's own
  bytes before the binding. On open, any mismatch (a pass file rewritten
  since, a sidecar edited by hand, a sidecar of another run, a forged
  ``stats_only``) makes the reader ignore the sidecar, warn naming it, and
  recompute the facts from the tensors, as for a dump written without
  sidecars. A statistics-only pass (or one whose pass file is gone) has no
  tensors to recompute from: its sidecar's own digest is checked, and an
  edited one is a ``DumpFormatError`` (it was read as written: a hand edit
  of a statistic became a divergence, without a word). The binding detects
  stale and edited sidecars; it is not a signature (anyone can recompute it), which is why reading never
  does more than read tensors, whatever a sidecar says. A forged sidecar
  bound anew can still place an entry at other bytes of its own record or
  give it another dtype or shape than the pickle does: the diff then reads
  those bytes of the file, where ``torch.load`` reads others (as a forged
  pass file can hold any values). Checking every entry's layout against the
  pickle would cost 200-380 ms a pass of 20,000 entries on open, against
  25-35 ms now (measured), for no gain against a forger who can rewrite the
  tensors themselves.
- **Validation.** Every column the reader uses is checked for type and
  shape before use: deep nesting, malformed rows, non-string keys or refs
  pointing nowhere raise ``DumpFormatError``.

Examples
--------
>>> sealed = seal(b'{"format":"tdinspect.pass"}', None)
>>> b'"binding"' in sealed
True
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from itertools import chain
from pathlib import Path
from typing import Any

from tdinspect.errors import DumpFormatError
from tdinspect.store.zipindex import ZipIndex, read_index
from tdinspect.util.terminal import warn

_BINDING = b',"binding":'


def records_digest(pass_file: str | os.PathLike) -> str | None:
    """SHA-256 of (name, CRC-32, size) of every record of a zip pass file; ``None`` if unreadable.

    Only the central directory is read (:func:`tdinspect.store.zipindex.read_index`).
    """
    index = read_index(pass_file)
    return None if index is None else index.digest


def seal(data: bytes, pass_file: str | os.PathLike | None) -> bytes:
    """Append the ``binding`` field to a sidecar's JSON bytes (a ``{...}`` object)."""
    binding = {"sidecar": hashlib.sha256(data).hexdigest()}
    if pass_file is not None:
        binding["pass_bytes"] = os.path.getsize(pass_file)
        binding["pass_records"] = records_digest(pass_file)
    return data[:-1] + _BINDING + json.dumps(binding, separators=(",", ":")).encode() + b"}"


def mismatch(raw: bytes, doc: dict, pass_file: Path, index: ZipIndex | None = None) -> str | None:
    """Why the sidecar ``raw`` (parsed: ``doc``) does not describe ``pass_file``; ``None`` if it does.

    ``index``: the pass file's zip index when the caller has read it (else it is read here).
    """
    binding = doc.get("binding")
    if not isinstance(binding, dict):
        return "has no binding to its pass file (written by an older tdinspect or another tool)"
    if edited(raw, doc):
        return "was edited after it was written"
    if index is None:
        index = read_index(pass_file)
    size, digest = (None, None) if index is None else (index.size, index.digest)
    if binding.get("pass_bytes") != size or binding.get("pass_records") != digest:
        return f"does not describe {pass_file.name} (stale, or the pass file was replaced)"
    if doc.get("stats_only") is not False:
        return f"says statistics only, but {pass_file.name} holds tensors"
    return None


def edited(raw: bytes, doc: dict) -> bool:
    """Whether the sealed sidecar ``raw`` (parsed: ``doc``) is no longer the bytes its writer
    sealed (``False`` for one without a binding: nothing says what it was)."""
    binding = doc.get("binding")
    if not isinstance(binding, dict):
        return False
    cut = raw.rfind(_BINDING)
    return cut < 0 or hashlib.sha256(raw[:cut] + b"}").hexdigest() != binding.get("sidecar")


def warn_ignored(path: Path, reason: str) -> None:
    warn(
        f"tdinspect: {path}: sidecar {reason}; ignored, facts are recomputed from the tensors",
        RuntimeWarning,
        stacklevel=4,
    )


_INT64 = 1 << 63  # torch and numpy count elements in int64


def _is_int(v: Any) -> bool:
    return type(v) is int and 0 <= v < _INT64


def _shape_ok(v: Any) -> bool:
    """A shape torch could hold: its size and element count fit int64 (a bound sidecar with
    ``[10**30]`` made ``tdinspect ls`` fail with numpy's ``OverflowError``)."""
    return isinstance(v, list) and all(map(_is_int, v)) and math.prod(v) < _INT64


def _is_number(v: Any) -> bool:
    return v is None or type(v) in (int, float)


def _ref_ok(ref: Any) -> bool:
    if ref is None:
        return True
    if not isinstance(ref, dict) or ref.get("kind") not in ("same", "view"):
        return False
    return isinstance(ref.get("of"), str)


def _call_ok(call: Any) -> bool:
    return call is None or (
        isinstance(call, dict)
        and isinstance(call.get("aten"), str)
        and isinstance(call.get("spec"), str)
        and isinstance(call.get("leaves"), list)
    )


_NONE = type(None)
_SCALARS = {
    "key": {str},
    "module_type": {str, _NONE},
    "dtype": {str, _NONE},
    "aten": {str, _NONE},
    "stored": {bool, _NONE},
    "uninitialized": {bool, _NONE},
    "ref": {_NONE},
    "call_args": {_NONE},
    "module_call": {int, _NONE},
}


def _rows_ok(v: Any) -> bool:
    """A ``checksum_rows`` value: ``None`` or ``{"dim": int >= 0, "rows": [16 hex digits, ...]}``."""
    if v is None:
        return True
    return (
        isinstance(v, dict)
        and set(v) == {"dim", "rows"}
        and _is_int(v["dim"])
        and v["dim"] >= 0
        and isinstance(v["rows"], list)
        and all(isinstance(r, str) and len(r) == 16 and all(c in _HEX for c in r) for r in v["rows"])
    )


_HEX = frozenset("0123456789abcdef")


def _all_plain(col: str, values: list, stat_width: int) -> bool:
    """The common case of a column, checked a column at a time (``False``: look row by row,
    which names the bad row). Same rules as the row checks: opening 100 passes of 1,500
    entries spent 0.3 s in them."""
    types = set(map(type, values))
    if col in _SCALARS:
        return types <= _SCALARS[col]
    if col not in ("shape", "stats") or not types <= {list, _NONE}:
        return False
    rows = [v for v in values if v is not None]
    flat = list(chain.from_iterable(rows))
    inner = set(map(type, flat))
    if col == "shape":
        if not inner <= {int} or (flat and min(flat) < 0):
            return False
        # no element count reaches 2^63 when max ** (longest shape) cannot (else check each
        # size and count them, as _shape_ok does: [10**30, 0] counts 0 elements)
        return (
            not flat
            or max(flat).bit_length() * max(map(len, rows)) < 63
            or (max(flat) < _INT64 and max(map(math.prod, rows)) < _INT64)
        )
    return set(map(len, rows)) <= {stat_width} and inner <= {int, float, _NONE}


def validate(path: Path, doc: Any, stat_width: int) -> dict:
    """Check every header field and column the reader uses; returns ``doc``.

    Raises
    ------
    DumpFormatError
        Naming ``path``, the column and the first bad row.
    """
    if not isinstance(doc, dict):
        raise DumpFormatError(f"{path}: not a tdinspect sidecar")
    for name, kinds in (("level", str), ("stats_only", bool), ("partial", bool), ("compile", dict)):
        if name in doc and not isinstance(doc[name], kinds):
            raise DumpFormatError(
                f"{path}: sidecar field {name!r} is {doc[name]!r}, expected {kinds.__name__}"
            )
    entries = doc.get("entries")
    if not isinstance(entries, dict) or not isinstance(entries.get("key"), list):
        raise DumpFormatError(f"{path}: sidecar has no entries.key column")
    keys = entries["key"]
    n = len(keys)
    for col, values in entries.items():
        if not isinstance(values, list) or len(values) != n:
            length = len(values) if isinstance(values, list) else type(values).__name__
            raise DumpFormatError(f"{path}: sidecar column {col!r} has {length} values for {n} keys")
    checks = {
        "key": lambda v: isinstance(v, str),
        "module_type": lambda v: v is None or isinstance(v, str),
        "dtype": lambda v: v is None or isinstance(v, str),
        "aten": lambda v: v is None or isinstance(v, str),
        "shape": lambda v: v is None or _shape_ok(v),
        "stored": lambda v: v is None or isinstance(v, bool),
        "uninitialized": lambda v: v is None or isinstance(v, bool),
        "stats": lambda v: (
            v is None or (isinstance(v, list) and len(v) == stat_width and all(map(_is_number, v)))
        ),
        "ref": _ref_ok,
        "call_args": _call_ok,
        "module_call": lambda v: v is None or type(v) is int,
        "checksum_rows": _rows_ok,
    }
    for col, ok in checks.items():
        if _all_plain(col, entries.get(col, ()), stat_width):
            continue
        for i, value in enumerate(entries.get(col, ())):
            if not ok(value):
                where = repr(keys[i]) if isinstance(keys[i], str) else f"row {i}"
                raise DumpFormatError(
                    f"{path}: sidecar column {col!r}, entry {where}: malformed value {str(value)[:80]!r}"
                )
    if len(set(keys)) != n:
        raise DumpFormatError(f"{path}: sidecar lists a key twice")
    for key, ref in zip(keys, entries.get("ref", ())):
        if isinstance(ref, dict) and ref.get("of") == key and ref.get("pass") is None:
            raise DumpFormatError(f"{path}: sidecar entry {key[:80]!r} refers to itself")
    _rows_fit_shapes(path, keys, entries)
    _tokens_lead_an_entry(path, doc.get("tokens"), entries.get("shape"))
    return doc


def _tokens_lead_an_entry(path: Path, tokens: Any, shapes: list | None) -> None:
    """The ``tokens`` layout's shape must lead some entry's shape, as ``step(tokens=...)``
    checks when it writes it: a layout of 10**12 rows with no tensor of that many made the
    token aligner allocate per-token arrays until memory ran out. A malformed layout is left
    to :meth:`~tdinspect.store.tokenlayout.TokenLayout.from_json`."""
    lead = tokens.get("shape") if isinstance(tokens, dict) else None
    if not isinstance(lead, list) or not shapes:
        return
    known = [s for s in shapes if s is not None]
    if known and not any(s[: len(lead)] == lead for s in known):
        raise DumpFormatError(
            f"{path}: sidecar field 'tokens': its shape {str(lead)[:80]} leads no entry's shape"
        )


def _rows_fit_shapes(path: Path, keys: list, entries: dict) -> None:
    """Each entry's ``checksum_rows``: one fingerprint per index of its dim (a dim its shape
    has). Else a forged or mangled list paired rows by a count the tensor does not have, or
    was dropped without a word (a shape mismatch reported instead)."""
    rows, shapes = entries.get("checksum_rows"), entries.get("shape")
    if not rows or not shapes:
        return
    for key, r, shape in zip(keys, rows, shapes):
        if r is None or shape is None:
            continue
        if r["dim"] >= len(shape) or len(r["rows"]) != shape[r["dim"]]:
            raise DumpFormatError(
                f"{path}: sidecar column 'checksum_rows', entry {key!r}: {len(r['rows'])} "
                f"fingerprints along dim {r['dim']} of shape {shape}"
            )
