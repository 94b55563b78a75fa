"""The on-disk format: names, atomic writes, sidecars, :func:`load_pass`, layout discovery.

Layout (the documented one, kept exactly)::

    <dump_dir>/rank<R>_pid<P>/pass00000.pt     torch.save of {key: cpu_tensor}, in execution order
                              pass00000.json   sidecar: per entry order, shape, dtype, statistics...
                              pass00001.pt     one pass per step(), numbered by step

Any tool that can ``torch.load`` a pass file keeps working: what tdinspect adds
lives in the sidecar. A ``stats_only`` capture writes the sidecar alone.

Sidecar schema (``"format": "tdinspect.pass"``, ``"version": 1``), columnar so
that a 1,500-entry pass parses fast; the list index is the execution order::

    {"format", "version", "pass", "rank", "pid", "level": "module"|"op", "stats_only",
     "stat_names": [...],
     "entries": {"key": [...], "module_type": [...], "shape": [[...]], "dtype": [...],
                 "stats": [[min, max, mean, std, absmax, l2, nan, inf, numel] | null],
                 "stored": [bool],                      # tensor present in the .pt file
                 # module level with capture(record=...) beyond outputs:
                 "kind": [null | "input"|"output"|"param"|"buffer"|"grad"],
                 "ref": [null | {"kind": "same", "of": key, "pass": N}],  # unchanged since pass N
                 # op level only:
                 "uninitialized": [bool],               # output of empty/empty_like/...
                 "module_call": [null | int],           # which call of its module, this pass
                                                        # (null in backward, outside modules)
                 "ref": [null | {"kind": "same", "of": key}
                         | {"kind": "view", "of": stored_key, "base": geometry, "view": geometry}],
                 # geometry = [sizes, strides, storage_offset] in the storage they shared;
                 # a view is rebuilt by indexing the stored tensor (tdinspect.store.reindex), never
                 # by running an operator
                 "call_args": [null | {"aten": name, "spec": treespec, "leaves": [...]}],
                 # capture(checksum=True): a 64-bit fingerprint per tensor, 16 hex digits
                 "checksum": [null | "0123456789abcdef"],
                 # capture(checksum=True, checksum_dim=d): one fingerprint per index along d
                 # (the row's own checksum, tdinspect.numerics.checksum.row_checksums)
                 "checksum_rows": [null | {"dim": d, "rows": ["0123456789abcdef", ...]}]},
     # a pass recorded with step(tokens=...) (tdinspect.store.tokenlayout):
     "tokens": {"shape": [lead dims], "segments": [[request | null, first_position, length], ...]},
     # module level, when the model is torch.compile'd (absent otherwise):
     "compile": {"mode": "graph"|"eager"|"mixed", "graphs": N, "graph_breaks": N, "recompiles": N}}

Columns are added where they apply; a reader ignores those it does not know, so dumps
written without them open as before.

Writes are atomic: a temporary name in the same folder, then ``os.replace``.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import pickle
import re
import secrets
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tdinspect.errors import DumpFormatError
from tdinspect.store.restore import check_sparse
from tdinspect.util.gcpause import paused
from tdinspect.util.regularfile import check_regular, open_regular

SIDECAR_FORMAT = "tdinspect.pass"
SIDECAR_VERSION = 1
MAX_SIDECAR_BYTES = 256 << 20  # a pass of 100,000 op-level entries writes ~50 MB
PASS_RE = re.compile(r"^pass(\d{5,})\.pt\Z")
SIDECAR_RE = re.compile(r"^pass(\d{5,})\.json\Z")
RANK_DIR_RE = re.compile(r"^rank(\d+)_pid(\d+)(?:_run(\d+))?\Z")  # _runN: a later run, same pid


def pass_number(name: str) -> int | None:
    """42 for ``pass00042.pt`` or ``pass00042.json``; ``None`` for any other file name."""
    m = PASS_RE.match(name) or SIDECAR_RE.match(name)
    return int(m.group(1)) if m else None


def pass_filename(index: int) -> str:
    """``pass00042.pt`` for pass 42."""
    return f"pass{index:05d}.pt"


def sidecar_filename(index: int) -> str:
    """``pass00042.json`` for pass 42."""
    return f"pass{index:05d}.json"


def rank_dirname(rank: int, pid: int) -> str:
    """``rank0_pid3069569``."""
    return f"rank{rank}_pid{pid}"


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[Any], None],
    *,
    fsync: bool = False,
    before_replace: Callable[[str], None] | None = None,
) -> None:
    """Write ``path`` through ``write(fileobj)`` so that it appears whole or not at all.

    The data goes to a temporary file in the same folder, which is renamed over
    ``path`` only once complete; on any error the temporary file is removed and
    an existing ``path`` is left untouched.
    """
    path = Path(path)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if before_replace is not None:
            before_replace(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new file beside ``path``, created with mode 0o666 so that the umask applies as it
    does to ``torch.save`` and ``open`` (``mkstemp`` would make it ``-rw-------``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.path.join(path.parent, f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: could not create a temporary file for {path.name}")


def stats_row(row: list[float]) -> list[Any]:
    """A statistics row for JSON: 9 significant digits (float32 resolution and then some),
    counts as integers, NaN/Inf as null. Shorter numbers make sidecars faster to parse."""
    out: list[Any] = [None if not math.isfinite(v) else float(f"{v:.9g}") for v in row[:6]]
    out += [int(v) if math.isfinite(v) else None for v in row[6:]]
    return out


def write_sidecar(
    path: str | os.PathLike, meta: dict, *, fsync: bool = False, pass_file: str | os.PathLike | None = None
) -> None:
    """Atomically write a sidecar (NaN statistics become ``null``), bound to ``pass_file``
    (the pass file it describes, see :mod:`tdinspect.store.sidecars`)."""
    from tdinspect.store.sidecars import seal

    data = seal(sidecar_json(meta), pass_file)
    atomic_write(path, lambda f: f.write(data), fsync=fsync)


def sidecar_json(meta: dict) -> bytes:
    """A pass's facts as its sidecar's JSON bytes, before the binding (NaN statistics ``null``)."""
    entries = dict(meta["entries"])
    entries["stats"] = [None if s is None else stats_row(list(s)) for s in entries["stats"]]
    doc = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, **meta, "entries": entries}
    doc.pop("binding", None)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def sidecar_in_memory(meta: dict, where: str) -> dict:
    """The sidecar document a pass's facts make, as :func:`read_sidecar` returns it once
    written and read back (JSON types, checked, ``null`` statistics as NaN): a pass held in
    memory opens exactly as its saved copy does. ``where`` names it in errors."""
    from tdinspect.numerics.stats import STAT_NAMES
    from tdinspect.store.sidecars import validate

    doc = json.loads(sidecar_json(meta))
    validate(Path(where), doc, len(STAT_NAMES))
    return _stats_as_read(doc)


def _stats_as_read(doc: dict) -> dict:
    from tdinspect.numerics.stats import STAT_NAMES

    entries = doc["entries"]
    n = len(entries["key"])
    nan_row = [math.nan] * len(STAT_NAMES)
    # a null row becomes NaNs here; null values inside a row become NaN when the loader makes
    # a float array of them (numpy converts None to NaN), which keeps opening fast
    entries["stats"] = [nan_row if s is None else s for s in entries.get("stats", [None] * n)]
    return doc


def read_sidecar(
    path: str | os.PathLike, pass_file: str | os.PathLike | None = None, *, index: Any = None
) -> dict | None:
    """Read and validate a sidecar; ``null`` statistics come back as NaN.

    With ``pass_file``, a sidecar that does not describe it (stale, edited,
    or written without a binding) is ignored with a warning: ``None`` is
    returned and the caller reads the pass file itself. Without one (a
    statistics-only pass), an edited sidecar is refused. ``index``: the pass
    file's :class:`~tdinspect.store.zipindex.ZipIndex` when the caller has read it.

    Raises
    ------
    DumpFormatError
        If the file is not a tdinspect sidecar of a known version, any
        column the reader uses is malformed (see :func:`tdinspect.store.sidecars.validate`),
        or, without ``pass_file``, it was edited since it was sealed.
    """
    from tdinspect.numerics.stats import STAT_NAMES
    from tdinspect.store.sidecars import edited, mismatch, validate, warn_ignored

    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_SIDECAR_BYTES:
                raise DumpFormatError(
                    f"{path}: a sidecar of {size} bytes, more than tdinspect reads ({MAX_SIDECAR_BYTES}): "
                    "not one it wrote"
                )
            raw = f.read()
        with paused():  # tens of thousands of lists and dicts: 0.79 -> 0.34 s for 100 sidecars
            doc = json.loads(raw)
    except DumpFormatError:
        raise
    except (OSError, ValueError, RecursionError, MemoryError) as exc:
        raise DumpFormatError(
            f"{path}: unreadable sidecar ({type(exc).__name__}: {str(exc)[:100]})"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != SIDECAR_FORMAT:
        raise DumpFormatError(f"{path}: not a tdinspect sidecar")
    if doc.get("version") != SIDECAR_VERSION:
        raise DumpFormatError(
            f"{path}: sidecar version {str(doc.get('version'))[:20]!r} is not "
            f"supported (this tdinspect reads version {SIDECAR_VERSION})"
        )
    if pass_file is not None:
        reason = mismatch(raw, doc, Path(pass_file), index)
        if reason is not None:
            alone = _held_by_sidecar_alone(doc)
            if alone:  # ignored, they read as missing: "only in A", a wrong answer
                raise DumpFormatError(
                    f"{path}: sidecar {reason}, and {len(alone)} of its entries ({', '.join(alone[:3])}"
                    f"{', ...' if len(alone) > 3 else ''}) are held by it alone (references to other "
                    "entries, outputs not stored): the pass cannot be read without it; refused (capture again)"
                )
            warn_ignored(path, reason)
            return None
    elif edited(raw, doc):
        raise DumpFormatError(
            f"{path}: sidecar was edited after it was written, and no pass "
            "file holds tensors to recompute its facts from: refused"
        )
    validate(path, doc, len(STAT_NAMES))
    return _stats_as_read(doc)


def _held_by_sidecar_alone(doc: dict) -> list[str]:
    """The keys (shown safely, at most a few hundred checked) of entries a sidecar lists as not
    stored in the pass file: without the sidecar, the pass holds no such entry."""
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        return []
    keys, stored = entries.get("key"), entries.get("stored")
    if not isinstance(keys, list) or not isinstance(stored, list):
        return []
    return [repr(str(k)[:60]) for k, s in zip(keys, stored) if s is False]


def save_pass(
    path: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    *,
    fsync: bool = False,
    before_replace: Callable[[str], None] | None = None,
) -> None:
    """Atomically ``torch.save`` a pass dict; ``before_replace(temporary_path)`` runs once the
    file is complete, before it takes its name (the writer binds the sidecar to it there)."""
    # through a file object: the archive's inner folder is then always "archive", so the
    # same tensors give the same bytes (saving by name would embed the temporary name)
    atomic_write(path, lambda f: torch.save(tensors, f), fsync=fsync, before_replace=before_replace)


def load_pass(path: str | os.PathLike, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Read one pass file: ``{key: cpu_tensor}`` in execution order.

    Reads with ``weights_only=True`` (a file that tries to run code on load is
    refused and nothing runs). By default the tensors are read into memory, so
    they are the caller's to modify and save, even over the same file.

    Parameters
    ----------
    path : str or Path
        A ``passNNNNN.pt`` file.
    mmap : bool
        Memory-map the file instead (falls back to a plain read for legacy
        files): tensors are read from disk only when touched, which is what
        analysis of large dumps wants. **Warning**: mapped tensors share the
        file's pages; modifying them in place and saving over the same file
        (``t[k] *= 2; torch.save(t, path)``) truncates the file under its own
        mapping (a bus error, and a zero-byte file). Copy what you change, or
        keep the default.

    Raises
    ------
    DumpFormatError
        If the file is missing, damaged, refused by ``weights_only`` or is not
        a dict of tensors; the message names the file (and the entry).

    Examples
    --------
    >>> tensors = load_pass("dumps/run_a/rank0_pid1234/pass00000.pt")  # doctest: +SKIP
    >>> tensors["model.layers.0.o_proj"].shape                          # doctest: +SKIP
    torch.Size([8, 128, 256])
    """
    path = Path(path)
    try:
        f = open_regular(path)  # once: every check below and torch.load read this same file
    except FileNotFoundError:
        raise DumpFormatError(f"{path}: no such pass file") from None
    except OSError as exc:
        raise DumpFormatError(f"{path}: unreadable pass file ({exc.strerror})") from None
    source, use_mmap = _load_source(f, path, mmap)
    try:
        obj = torch.load(source, map_location="cpu", weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as exc:
        detail = [ln.strip() for ln in str(exc).splitlines() if "unsupported global" in ln.lower()]
        if detail:
            raise DumpFormatError(
                f"{path}: refused to load: the file holds objects other than "
                f"tensors and plain containers, which could run code "
                f"(read with weights_only=True): {detail[0]}"
            ) from None
        opcode = re.search(r"Unsupported operand (\d+)", str(exc))
        if opcode and not _starts_like_torch_save(path):
            raise DumpFormatError(
                f"{path}: not a torch.save file (neither a zip archive nor a pickle: text, or another format)"
            ) from None
        if opcode:  # torch.save(..., pickle_protocol=4) writes opcodes this reader refuses
            raise DumpFormatError(
                f"{path}: unreadable pass file: torch.load(weights_only=True) does not take "
                f"pickle opcode {opcode.group(1)} (damaged, or saved with a pickle protocol "
                f"above 2, as torch.save(..., pickle_protocol=4) does: save with the default "
                f"protocol)"
            ) from None
        raise DumpFormatError(
            f"{path}: unreadable pass file (damaged, or not written by torch.save)"
        ) from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, zipfile errors...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DumpFormatError(f"{path}: unreadable pass file ({type(exc).__name__}: {first})") from None
    finally:
        f.close()  # a mapping made from it stays
    if not isinstance(obj, dict):
        raise DumpFormatError(f"{path}: expected a dict of tensors, found {type(obj).__name__}")
    for key, value in obj.items():
        if not isinstance(key, str):
            raise DumpFormatError(f"{path}: key {key!r} is not a string")
        if not isinstance(value, torch.Tensor):
            raise DumpFormatError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
        if value.layout != torch.strided:  # torch.load leaves a sparse tensor's indices unchecked
            check_sparse(value, f"{path}: entry {key!r}")
    return obj


_EXPANSION = 16  # compressed records may hold at most this many times the file's size


def _starts_like_torch_save(path: Path) -> bool:
    """Whether ``path`` begins as torch.save writes: a zip archive, or a legacy pickle (protocol 2)."""
    try:
        with open_regular(path) as f:
            head = f.read(4)
    except OSError:
        return True  # say nothing new: the caller's message stands
    return head.startswith((b"PK\x03\x04", b"\x80"))


def _load_source(f, path: Path, mmap: bool) -> tuple[Any, bool]:
    """What ``torch.load`` reads for :func:`load_pass` (and whether it maps it), checked:
    the open regular file ``f`` itself. Nothing is opened by ``path`` again: a FIFO put in
    its place after the check blocked the reader forever. ``torch.load`` maps only a file
    it is given by name, so a mapped read gets a name of ``f``'s own descriptor
    (:func:`_name_of_open`). ``f`` is closed if a check fails."""
    try:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise DumpFormatError(f"{path}: empty file (zero bytes), not a pass file")
        is_zip = _refuse_expanding(f, path, size)
        f.seek(0)
        return (_name_of_open(f, path), True) if mmap and is_zip else (f, False)
    except BaseException:
        f.close()
        raise


def _name_of_open(f, path: Path) -> str | Path:
    """A file name that opens the file ``f`` has open, whatever ``path`` names by then:
    ``/proc/self/fd/N`` (Linux) or ``/dev/fd/N``. Where neither exists, ``path`` once it is
    checked to be still that file (a swap after this check is not caught there)."""
    from tdinspect.store.zipindex import identity

    for folder in ("/proc/self/fd", "/dev/fd"):
        name = f"{folder}/{f.fileno()}"
        if os.path.exists(name):
            return name
    if identity(check_regular(path)) != identity(os.fstat(f.fileno())):
        raise DumpFormatError(f"{path}: replaced while it was being opened")
    return path


def _refuse_expanding(f, path: Path, size: int) -> bool:
    """``DumpFormatError`` for an archive (the open file ``f``) whose compressed records claim
    more than :data:`_EXPANSION` times the file's size: ``torch.save`` compresses nothing,
    and ``torch.load`` decompresses a record whole into memory (a 1 MB file whose
    ``data.pkl`` inflated to 1 GB opened, holding 2 GB; a 100 MB one would exhaust the
    machine); and for one that readers would read differently
    (:func:`tdinspect.store.zipindex.disagreement`: ``torch.load`` read a record listed twice as
    its first copy where tdinspect's record reader read the last, and read a record whose
    directory entry leads to another record's bytes without a word). Whether ``f`` is a
    readable zip archive."""
    from tdinspect.store.zipindex import disagreement, index_of

    index = index_of(f)
    if index is None:
        return False  # not a zip archive (torch.load's legacy format), or one torch.load refuses
    packed = sum(n for n, m in zip(index.sizes, index.methods) if m != zipfile.ZIP_STORED)
    if packed > _EXPANSION * size + (1 << 20):
        raise DumpFormatError(
            f"{path}: compressed records would expand to {packed} bytes from a "
            f"{size}-byte file (torch.save compresses nothing): refused, "
            "not decompressed"
        )
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        why = disagreement(mapped, index)
    if why is not None:
        raise DumpFormatError(
            f"{path}: damaged archive: {why}; refused (readers would read different bytes for that record)"
        )
    return True


def encode_arg(value: Any, tensor_key: str | None = None) -> Any:
    """A JSON-safe description of one argument leaf (see :func:`decode_arg`)."""
    if isinstance(value, torch.Tensor):
        return {"t": tensor_key}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return encode_arg({torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)](value))
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    return {"repr": repr(value)}


_ENUMS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


def decode_arg(
    value: Any, tensors: Callable[[str], torch.Tensor] | None = None, where: str = "recorded call"
) -> Any:
    """Rebuild one argument leaf written by :func:`encode_arg`.

    ``tensors(key)`` supplies recorded tensors; a tensor that was not recorded
    (or an argument only kept as its ``repr``) raises ``DumpFormatError``, as
    does anything that is not plain data (a name that is not a torch dtype,
    layout or memory format...); ``where`` names the file in messages.
    """
    if value is None or type(value) in (bool, int, float, str):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise DumpFormatError(f"{where}: malformed argument {str(value)[:80]!r}")
    ((tag, data),) = value.items()
    try:
        if tag == "t":
            if data is None or tensors is None:
                raise DumpFormatError(
                    f"{where}: this op's tensor argument was not recorded; "
                    "capture with inputs=True to rebuild it"
                )
            if not isinstance(data, str):
                raise TypeError
            return tensors(data)
        if tag == "f" and data in ("nan", "inf", "-inf"):
            return float(data)
        if tag in _ENUMS and isinstance(data, str) and data.isidentifier():
            found = getattr(torch, data, None)
            if isinstance(found, _ENUMS[tag]):
                return found
        if tag == "device" and isinstance(data, str):
            return torch.device(data)
        if (
            tag == "complex"
            and isinstance(data, list)
            and len(data) == 2
            and all(type(v) in (int, float) for v in data)
        ):
            return complex(*data)
    except (TypeError, ValueError, RuntimeError, KeyError):
        pass
    if tag == "repr":
        raise DumpFormatError(f"{where}: argument {str(data)[:80]!r} was recorded only as text")
    raise DumpFormatError(f"{where}: malformed argument {str(value)[:80]!r}")


_SPEC_TYPES = {None, "builtins.tuple", "builtins.list", "builtins.dict"}


def load_call_spec(text: str, where: str = "recorded call"):
    """The argument structure of a recorded call: tuples, lists and dicts only.

    A ``treespec_dumps`` string is checked (node types, depth) before it is
    given to ``treespec_loads``, so a file cannot name another pytree type.
    """
    from torch.utils._pytree import treespec_loads

    try:
        doc = json.loads(text)
        todo = [(doc[1], 0)]
        while todo:
            node, depth = todo.pop()
            if (
                not isinstance(node, dict)
                or node.get("type") not in _SPEC_TYPES
                or depth > 32
                or not isinstance(node.get("children_spec"), list)
            ):
                raise ValueError
            todo.extend((child, depth + 1) for child in node["children_spec"])
        return treespec_loads(text)
    except Exception:  # noqa: BLE001 - any failure is a malformed structure
        raise DumpFormatError(f"{where}: malformed argument structure") from None


@dataclass
class PassFiles:
    """The files of one pass: the tensors (may be absent for stats-only) and the sidecar."""

    index: int
    tensors: Path | None = None
    sidecar: Path | None = None


@dataclass
class RankFolder:
    """One process's folder: its rank, pid and passes by number."""

    path: Path
    rank: int
    pid: int | None
    passes: dict[int, PassFiles] = field(default_factory=dict)


def _refuse_leaving(path: Path, root: str) -> None:
    """A :class:`DumpFormatError` for ``path`` when it is a link whose target lies outside ``root``."""
    if not os.path.islink(path):
        return
    target = os.path.realpath(path)
    if os.path.commonpath([target, root]) != root:
        raise DumpFormatError(
            f"{path}: a link to {target}, outside the dump {root}: refused (a dump is read from its own files)"
        )


def vanished(path: str | os.PathLike) -> str:
    """The message of a dump file or folder that vanished while it was read: a run replaced
    by a capture with ``overwrite=True`` (or removed) under the reader's feet."""
    return (
        f"{path}: vanished while being read (its run was replaced by a capture with "
        "overwrite=True, or removed); open the dump again"
    )


def scan_rank_folder(path: Path, rank: int, pid: int | None) -> RankFolder:
    """List the complete passes of one folder (temporary files are ignored).

    Raises
    ------
    DumpFormatError
        For a folder that is a link leading out of the dump (the folder holding ``path``).
        Links to pass files and sidecars are refused when read
        (:func:`tdinspect.util.regularfile.open_regular`).
    """
    root = os.path.realpath(path.parent)
    _refuse_leaving(path, root)
    folder = RankFolder(path, rank, pid)
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:  # a bare FileNotFoundError reached the reader
        raise DumpFormatError(vanished(path)) from None
    for entry in entries:
        index = pass_number(entry.name)
        if index is None:
            continue
        pf = folder.passes.setdefault(index, PassFiles(index))
        if entry.name.endswith(".pt"):
            pf.tensors = Path(entry.path)
        else:
            pf.sidecar = Path(entry.path)
    folder.passes = dict(sorted(folder.passes.items()))
    return folder
