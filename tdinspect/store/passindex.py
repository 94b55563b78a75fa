"""What one pass holds: keys in execution order, metadata, statistics, and its tensors on demand.

A :class:`PassIndex` reads the sidecar when there is one, else the pass file's
keys, shapes and dtypes (a memory-mapped ``torch.load`` reads no tensor data).
Tensors are read only when asked for, references (op-level de-duplication)
are resolved, and statistics of dumps without sidecars are computed with the
same :func:`tdinspect.numerics.stats.tensor_stats` that capture uses.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_unflatten

from tdinspect.errors import DumpFormatError
from tdinspect.naming import parse_key
from tdinspect.numerics.stats import STAT_NAMES, tensor_stats
from tdinspect.store.format import (
    PassFiles,
    decode_arg,
    load_call_spec,
    load_pass,
    pass_filename,
    read_sidecar,
    sidecar_filename,
)
from tdinspect.store.rawpass import crc_failure, mapping_files, read_plain, read_raw
from tdinspect.store.reindex import reindex
from tdinspect.store.restore import restore, restored_shape
from tdinspect.store.tokenlayout import TokenLayout
from tdinspect.store.zipindex import ZipIndex, identity, read_index


@dataclass
class PassIndex:
    """Metadata of one pass of one rank; tensors stay on disk."""

    rank: int
    index: int
    files: PassFiles
    keys: list[str]
    shape: list[Any]
    dtype: list[Any]
    module_type: list[Any]
    stored: list[bool]
    stats: np.ndarray | None
    uninitialized: list[bool]
    ref: list[Any]
    call_args: list[Any]
    aten: list[Any]
    level: str = "module"
    stats_only: bool = False
    partial: bool = False
    position: dict[str, int] = field(default_factory=dict)
    kind: list[Any] | None = None  # "input", "output", "param", "buffer", "grad"; None: output
    parallel: dict[str, list[int]] = field(default_factory=dict)  # {axis: [index, size]}
    dims: list[str | None] = field(default_factory=list)  # dims spec per entry (or None)
    checksum: list[Any] | None = None  # 16 hex digits (tdinspect.numerics.checksum) or None
    failed: str | None = None  # the error that cut this pass short (a failed notebook cell)
    storage: list[Any] | None = None  # how a non-plain tensor was stored (dumper/kinds.py)
    skipped: list[Any] | None = None  # why a tensor was not stored (meta, FakeTensor...)
    raw: list[Any] | None = None  # where stored tensors lie in the archive (tdinspect.store.rawpass)
    module_call: list[Any] | None = None  # op level: which call of its module ran the op
    # capture(checksum_dim=d): per entry {"dim": d, "rows": [16 hex digits per index]} or None
    checksum_rows: list[Any] | None = None
    tokens: TokenLayout | None = None  # which request and position each token row holds

    def __post_init__(self) -> None:
        self.position = {k: i for i, k in enumerate(self.keys)}
        if len(self.dims) != len(self.keys):
            self.dims = [None] * len(self.keys)
        self._zip: ZipIndex | None = None  # the pass file's zip index, read at open
        # (file identity, tensors) loaded at open (no sidecar)
        self._held: tuple[tuple, dict[str, torch.Tensor]] | None = None

    def __getstate__(self) -> dict:
        # what the open read stays in this process: a worker reads the file itself
        return {k: v for k, v in self.__dict__.items() if k not in ("_zip", "_held")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _zip=None, _held=None)

    # -- reading -----------------------------------------------------------------------
    @classmethod
    def read(cls, rank: int, files: PassFiles) -> PassIndex:
        """Index one pass from its sidecar, or from the pass file's metadata.

        Each pass file is read once here: with a sidecar, its zip index (the
        binding check) is kept for the first read of its tensors; without
        one, a plain ``torch.save`` file's layout is read from its pickle's
        opcodes (:mod:`tdinspect.store.picklelayout`: nothing unpickled, later reads
        go to its records), other files are loaded with ``torch.load``, and
        the tensors read for their keys, shapes and dtypes are kept for the
        first :meth:`load` (at most :data:`HELD_PASSES` passes at a time in
        a process).
        """
        index = read_index(files.tensors) if files.sidecar is not None and files.tensors is not None else None
        doc = read_sidecar(files.sidecar, files.tensors, index=index) if files.sidecar is not None else None
        if doc is not None:
            pi = cls.from_sidecar(rank, files, doc)
            if pi.raw is not None:
                pi._zip = index
            return pi
        return cls._from_pass_file(rank, files)

    @classmethod
    def from_sidecar(cls, rank: int, files: PassFiles, doc: dict) -> PassIndex:
        """A pass indexed from its sidecar document (as :func:`~tdinspect.store.format.read_sidecar`
        returns it: checked, ``null`` statistics as NaN)."""
        e = doc["entries"]
        n = len(e["key"])
        stats = np.asarray(e["stats"], dtype=np.float64).reshape(n, len(STAT_NAMES))

        def col(name, default=None):
            return e.get(name) or [default] * n

        pi = cls(
            rank,
            files.index,
            files,
            list(e["key"]),
            col("shape"),
            col("dtype"),
            col("module_type", ""),
            [bool(v) for v in col("stored", True)],
            stats,
            [bool(v) for v in col("uninitialized", False)],
            col("ref"),
            col("call_args"),
            col("aten"),
            doc.get("level", "module"),
            bool(doc.get("stats_only")),
            bool(doc.get("partial")),
            kind=col("kind"),
            parallel=_parallel(doc.get("parallel"), files),
            dims=col("dims"),
            checksum=col("checksum"),
            failed=str(doc["failed"]) if doc.get("failed") else None,
            storage=e.get("storage"),
            skipped=e.get("skipped"),
            raw=e.get("raw") if _raw_agrees(e) else None,
            module_call=e.get("module_call"),
            checksum_rows=e.get("checksum_rows"),
            tokens=None
            if doc.get("tokens") is None
            else TokenLayout.from_json(doc["tokens"], str(files.sidecar)),
        )
        return pi

    @classmethod
    def _from_pass_file(cls, rank: int, files: PassFiles) -> PassIndex:
        """A pass without a sidecar, indexed from its pass file (see :meth:`read`)."""
        opened = _identity(files.tensors)  # what the tensors kept below map
        plain = read_plain(files.tensors)  # a plain torch.save: its layout, nothing unpickled
        raw = None
        if plain is not None:  # plain dense tensors: their layout says their shapes and dtypes
            keys, raw, loaded = plain
            shapes, dtypes = [list(e[2]) for e in raw], [e[4] for e in raw]
        else:
            loaded = load_pass(files.tensors, mmap=mapping_files())
            keys = list(loaded)
            # as analysis reads them, checked, without making them
            read = [restored_shape(t, f"{files.tensors}: entry {k!r}") for k, t in loaded.items()]
            shapes, dtypes = [s for s, _ in read], [d for _, d in read]
        n = len(keys)
        aten = [_op_of(k) for k in keys]
        pi = cls(
            rank,
            files.index,
            files,
            keys,
            shapes,
            dtypes,
            [""] * n,
            [True] * n,
            None,
            [False] * n,
            [None] * n,
            [None] * n,
            aten,
            "op" if any(a is not None for a in aten) else "module",
            raw=raw,
        )
        _hold(pi, opened, loaded)
        return pi

    @property
    def path(self):
        """The file that names this pass in messages."""
        return self.files.tensors or self.files.sidecar

    def load(self) -> dict[str, torch.Tensor]:
        """The pass file's tensors (memory-mapped), checked against the sidecar."""
        if self.files.tensors is None:
            raise DumpFormatError(f"{self.files.sidecar}: statistics-only pass, no tensors were saved")
        expected = {k for k, s in zip(self.keys, self.stored) if s}
        with _HELD_LOCK:
            held, self._held = self._held, None
        # the tensors kept from the open map the file as it was then: used only if it is
        # still that file (rewritten in place since, reading them was a SIGBUS; replaced,
        # they were the old file's)
        tensors = held[1] if held is not None and held[0] == _identity(self.files.tensors) else None
        if tensors is None and self.raw is not None:
            tensors = self._read_records()
        if tensors is None:
            tensors = load_pass(self.files.tensors, mmap=mapping_files())
        if expected != tensors.keys():
            missing = sorted(expected - tensors.keys())[:3]
            extra = sorted(tensors.keys() - expected)[:3]
            opened = "sidecar" if self.files.sidecar is not None else "file when opened"
            raise DumpFormatError(
                f"{self.files.tensors}: {opened} and pass file disagree "
                f"(in {opened} only: {missing}; in pass file only: {extra}; "
                "rewritten since it was opened?)"
            )
        return tensors

    def _read_records(self) -> dict[str, torch.Tensor] | None:
        """The stored tensors read from the archive's records as the sidecar lays them out
        (no unpickling); ``None`` when the layout does not check out against the file."""
        rows = [i for i, s in enumerate(self.stored) if s]
        index, self._zip = self._zip, None  # it describes the file as opened: used once
        return read_raw(self.files.tensors, [self.keys[i] for i in rows], [self.raw[i] for i in rows], index)

    def damaged(self, key: str) -> str | None:
        """The record holding ``key``'s tensor (every record of the pass file when the layout
        is not known) whose bytes fail their CRC-32, else ``None``
        (:func:`tdinspect.store.rawpass.crc_failure`). An entry held by an earlier pass's file (a
        parameter unchanged since) is not checked here."""
        i = self.position.get(key)
        if self.files.tensors is None or i is None:
            return None
        for _ in range(2):  # a reference: the entry it names (a "same" of a view: its base)
            ref = self.ref[i]
            if self.stored[i] or not isinstance(ref, dict) or ref.get("of") not in self.position:
                break
            if ref.get("pass") is not None:
                return None
            i = self.position[ref["of"]]
        row = self.raw[i] if self.raw is not None and self.stored[i] else None
        records = [f"data/{row[0]}"] if isinstance(row, list) and row and isinstance(row[0], str) else None
        return crc_failure(self.files.tensors, records)

    def tensor(self, key: str, loaded: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """One entry's tensor, references resolved; ``loaded`` reuses an open pass file."""
        i = self.position.get(key)
        if i is None:
            raise KeyError(f"{self.path}: no entry {key!r}")
        if self.uninitialized[i]:
            raise DumpFormatError(
                f"{self.path}: entry {key!r} is the output of an uninitialised "
                "allocation (empty/empty_like): its values mean nothing and were "
                "not saved"
            )
        if loaded is None:
            loaded = self.load()
        where = f"{self.path}: entry {key!r}"
        if self.stored[i]:
            return self._as_read(i, loaded[key], where)
        if self.skipped and isinstance(self.skipped[i], str):
            raise DumpFormatError(f"{where} was not stored: {self.skipped[i]}")
        ref = self.ref[i]
        if not isinstance(ref, dict) or not isinstance(ref.get("of"), str):
            raise DumpFormatError(f"{where} has no stored tensor")
        if ref.get("pass") is not None:  # unchanged since an earlier pass (a parameter)
            return self.earlier(ref["pass"], key).tensor(ref["of"])
        j = self.position.get(ref["of"])
        if j is None or j == i:
            raise DumpFormatError(f"{where} refers to {ref['of']!r}, which is not another entry of this pass")
        if ref.get("kind") == "same" and self.stored[j]:
            return self._as_read(j, loaded[ref["of"]], where)
        if ref.get("kind") == "same" and isinstance(self.ref[j], dict) and self.ref[j].get("kind") == "view":
            i, ref, where = j, self.ref[j], f"{self.path}: entry {self.keys[j]!r}"
            j = self.position.get(ref["of"]) if isinstance(ref.get("of"), str) else None
        if ref.get("kind") != "view" or j is None or not self.stored[j]:
            raise DumpFormatError(f"{where}: its reference {str(ref)[:120]} does not lead to a stored tensor")
        if "view" not in ref:
            raise DumpFormatError(
                f"{where}: a view recorded by an older tdinspect (rebuilt by "
                "running an operator, which is no longer done); capture again"
            )
        base = self._as_read(j, loaded[self.keys[j]], where)
        if self.dtype[i] != str(base.dtype):
            raise DumpFormatError(
                f"{where}: dtype {self.dtype[i]} differs from the stored tensor's ({base.dtype})"
            )
        return reindex(base, ref.get("base"), ref["view"], where)

    def _as_read(self, i: int, t: torch.Tensor, where: str) -> torch.Tensor:
        """A stored tensor as analysis sees it: sparse, quantized and nested tensors made
        plain (:func:`tdinspect.store.restore.restore`), an expanded one re-viewed."""
        t = restore(t, where)
        storage = self.storage[i] if self.storage else None
        if isinstance(storage, dict) and isinstance(storage.get("expand"), dict):
            view = storage["expand"]
            return reindex(t, view.get("base"), view.get("view"), where)
        return t

    def earlier(self, index: Any, key: str) -> PassIndex:
        """The earlier pass of this folder that an entry of this pass refers to."""
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.index:
            raise DumpFormatError(
                f"{self.path}: entry {key!r} refers to pass {index!r}, which is not an earlier pass"
            )
        folder = self.path.parent
        files = PassFiles(index, folder / pass_filename(index), folder / sidecar_filename(index))
        if not files.sidecar.is_file():
            raise DumpFormatError(
                f"{self.path}: entry {key!r} refers to pass {index}, whose sidecar {files.sidecar} is missing"
            )
        if not files.tensors.is_file():
            files.tensors = None
        return PassIndex.read(self.rank, files)

    def rebuild_args(self, i: int, loaded, cast=None) -> tuple[str, tuple, dict]:
        """``(op name, args, kwargs)`` of the op call recorded at entry ``i``.

        The operator is only named, never resolved or run here: see
        :func:`tdinspect.replay`, which decides whether it is safe to run.
        """
        spec = self.call_args[i]
        where = f"{self.path}: entry {self.keys[i]!r}"
        if not spec:
            raise DumpFormatError(
                f"{where} has no recorded call (capture_ops(..., inputs=True) records them)"
            )
        if (
            not isinstance(spec, dict)
            or not isinstance(spec.get("aten"), str)
            or not isinstance(spec.get("leaves"), list)
            or not isinstance(spec.get("spec"), str)
        ):
            raise DumpFormatError(f"{where}: malformed recorded call")

        def fetch(key):
            t = self.tensor(key, loaded)
            return cast(t) if cast is not None else t

        leaves = [decode_arg(v, fetch, where) for v in spec["leaves"]]
        structure = load_call_spec(spec["spec"], where)
        try:
            args, kwargs = tree_unflatten(leaves, structure)
        except Exception as exc:  # noqa: BLE001 - leaves and structure disagree
            raise DumpFormatError(
                f"{where}: recorded call does not fit its structure ({type(exc).__name__})"
            ) from None
        return spec["aten"], args, kwargs

    # -- statistics --------------------------------------------------------------------
    def ensure_stats(self) -> np.ndarray:
        """Statistics of every entry (computed from the tensors when no sidecar had them;
        NaN for an entry without a tensor of its own)."""
        if self.stats is None:
            loaded = self.load()
            nan = [math.nan] * len(STAT_NAMES)
            rows = [
                nan if t is None else tensor_stats(t).tolist()
                for t in (self._stats_tensor(i, loaded) for i in range(len(self.keys)))
            ]
            self.stats = np.asarray(rows, dtype=np.float64).reshape(len(self.keys), len(STAT_NAMES))
        return self.stats

    def _stats_tensor(self, i: int, loaded) -> torch.Tensor | None:
        """Entry ``i``'s tensor for :meth:`ensure_stats` (as analysis reads it), or ``None``
        (not stored)."""
        return self.tensor(self.keys[i], loaded) if self.stored[i] else None

    def stat_dict(self, i: int) -> dict[str, float]:
        return dict(zip(STAT_NAMES, self.ensure_stats()[i].tolist()))


HELD_PASSES = 64  # passes whose tensors, loaded at open, wait for their first read
_HELD: deque = deque()
_HELD_LOCK = threading.Lock()


def _identity(path) -> tuple | None:
    """The file's :func:`tdinspect.store.zipindex.identity` now (``None``: gone)."""
    try:
        return identity(os.stat(path))
    except OSError:
        return None


def _hold(pi: PassIndex, opened: tuple | None, tensors: dict[str, torch.Tensor]) -> None:
    """Keep the tensors an open loaded for ``pi``'s first :meth:`~PassIndex.load` (a pass
    without a sidecar is then unpickled once), forgetting the oldest beyond
    :data:`HELD_PASSES` (they are memory-mapped: address space, not memory)."""
    with _HELD_LOCK:
        pi._held = None if opened is None else (opened, tensors)
        _HELD.append(weakref.ref(pi))
        while len(_HELD) > HELD_PASSES:
            old = _HELD.popleft()()
            if old is not None:
                old._held = None


def _raw_agrees(e: dict) -> bool:
    """Whether a sidecar's record layout (``raw``) gives each plain stored entry (no
    ``storage`` or ``kind`` of its own) the shape and dtype its own columns give. One that
    contradicts itself (edited, then sealed again) is not used: the entries are read with
    ``torch.load``, whose tensors are the file's, rather than as views the columns disagree
    with (a token diff's ``torch.cat`` of an int32 view into float32 rows raised TypeError).
    """
    raw = e.get("raw")
    if not isinstance(raw, list):
        return True
    n = len(raw)
    shapes, dtypes, storage, kind = (e.get(c) or [None] * n for c in ("shape", "dtype", "storage", "kind"))
    stored = e.get("stored") or [True] * n
    return all(
        not isinstance(r, list)
        or len(r) != 5
        or not st
        or own is not None
        or k is not None
        or (r[2] == shape and r[4] == dtype)
        for r, shape, dtype, st, own, k in zip(raw, shapes, dtypes, stored, storage, kind)
    )


def _parallel(value, files: PassFiles) -> dict[str, list[int]]:
    """The sidecar's ``parallel`` header, checked (``{axis: [index, size]}``)."""
    if value is None:
        return {}
    ok = isinstance(value, dict) and all(
        isinstance(c, list) and len(c) == 2 and all(type(v) is int for v in c) and 0 <= c[0] < c[1]
        for c in value.values()
    )
    if not ok:
        raise DumpFormatError(
            f"{files.sidecar}: malformed 'parallel' header {value!r} (expected {{axis: [rank, size]}})"
        )
    return {str(k): list(v) for k, v in value.items()}


@functools.lru_cache(maxsize=1 << 16)  # every pass of a dump without sidecars names the same keys
def _op_of(key: str) -> str | None:
    """The aten op a key names (op level), else ``None``."""
    try:
        return parse_key(key).op
    except ValueError:
        return None
