"""Reading a pass file's tensors straight from its zip records, without unpickling.

``torch.save`` stores every storage as an uncompressed zip record
(``archive/data/<n>``) and a pickle (``archive/data.pkl``) that says which
record, offset, shape and strides make each tensor. Reading that pickle, even
with ``weights_only=True``, costs a Python-level unpickler step per object and
holds the GIL: for passes of many small entries it was 77% of a diff.

So the writer also records the pickle's facts in the sidecar (column ``raw``:
``[record, storage_offset, shape, strides, dtype]`` per stored entry), as :func:`layout` derives them from the tensors handed to
``torch.save`` (storages are numbered in the order first met, as torch does).
:func:`read_raw` then finds each record through the zip's central directory
(:mod:`tdinspect.store.zipindex`, read once per pass) and local headers, memory-maps the file copy-on-write (writing to a tensor
never reaches the file) and views the bytes, after checking every claim
against the archive: the record exists, is stored uncompressed, holds enough
bytes for the view, the dtype is one of torch's, the byte order is little.
Anything that does not check out returns ``None`` and the caller falls back to
``torch.load(weights_only=True)``: the sidecar can only make reading faster,
never make it read outside the record it names (it is data, and a hostile one
at worst shows other bytes of the same file, which the sidecar's binding to
the pass file then also flags).

Examples
--------
>>> import io, tempfile, os
>>> tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
>>> path = os.path.join(tempfile.mkdtemp(), "pass00000.pt")
>>> torch.save(tensors, path)
>>> raw = layout(tensors)
>>> back = read_raw(path, ["a", "b"], raw)
>>> torch.equal(back["a"], tensors["a"]), back["b"].dtype
(True, torch.bfloat16)
"""

from __future__ import annotations

import math
import mmap
import operator
import os
import struct
import zipfile
import zlib
from typing import Any

import torch

from tdinspect.store.zipindex import LOCAL_HEADER, ZipIndex, identity, index_of, local_start
from tdinspect.util.regularfile import open_regular

_INT64 = 1 << 63
_INT = {int}
# every dtype torch.save can write, by the name the sidecar uses (never getattr on a file's text)
_DTYPES = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex128,
        torch.complex64,
        torch.complex32,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu,
    )
    if isinstance(d, torch.dtype)
}


def layout(tensors: dict[str, torch.Tensor]) -> list[list[Any]] | None:
    """``[record, storage_offset, shape, strides, dtype]`` of each tensor as ``torch.save``
    lays it out, or ``None`` when a tensor is not a plain dense one (sparse, quantized, a
    subclass: torch pickles those differently, so the numbering below would not hold).

    Storages are numbered ``"0"``, ``"1"``, ... in the order the dict first
    meets them (tensors sharing a storage share its record), as
    ``torch.serialization`` numbers them.
    """
    records: dict[int, str] = {}
    out = []
    for t in tensors.values():
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized or t.is_nested:
            return None
        record = records.setdefault(t.untyped_storage()._cdata, str(len(records)))
        out.append([record, int(t.storage_offset()), list(t.shape), list(t.stride()), str(t.dtype)])
    return out


def _data_start(mapped: mmap.mmap, index: ZipIndex, name: str) -> tuple[int, int] | None:
    """``(data start, size)`` of an uncompressed record, from its local header in the map
    (which must name the record: :func:`tdinspect.store.zipindex.disagreement`)."""
    found = index.record(name)
    if found is None or found[2] != zipfile.ZIP_STORED or index.twice is not None:
        return None
    start = local_start(mapped, found[0], name)
    return None if start is None else (start, found[1])


def _small_record(mapped: mmap.mmap, index: ZipIndex, name: str) -> bytes | None:
    """The bytes of a small record (``data.pkl``, ``byteorder``), CRC-checked as ``zipfile``
    checks what it reads."""
    located = _data_start(mapped, index, name)
    if located is None or located[0] + located[1] > len(mapped):
        return None
    data = bytes(mapped[located[0] : located[0] + located[1]])  # a map's slice is bytes already
    return data if zlib.crc32(data) == index.record(name)[3] else None


def _valid_view(shape: Any, strides: Any, offset: Any, numel: int) -> bool:
    if not (
        type(shape) is list
        and type(strides) is list
        and len(shape) == len(strides)
        and type(offset) is int
        and offset >= 0
    ):
        return False
    dims = shape + strides  # non-negative ints (bool is not one), checked a list at a time
    if not set(map(type, dims)) <= _INT or (dims and min(dims) < 0):
        return False
    if math.prod(d for d in shape if d) >= _INT64 or (dims and max(dims) >= _INT64):
        # torch counts elements in int64, multiplying the sizes in turn (a 0 after them does
        # not save it): as_strided raised (not refused) on these
        return False
    if 0 in shape:
        return offset <= numel
    # the last element: offset + Σ (size - 1)·stride, as two sums of a map (no generator:
    # 1.45 -> 0.92 µs a 1-D entry, and a pass of 10⁵ small entries checks 2·10⁵)
    return offset + sum(map(operator.mul, shape, strides)) - sum(strides) < numel


def _pickled_str(text: str) -> bytes:
    """How pickle protocol 2 (``torch.save``'s) writes a string: ``X``, length, UTF-8."""
    data = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def _pickle_agrees(pickled: bytes, keys: list[str], raw: list[list[Any]]) -> bool:
    """Whether the archive's own pickle names ``keys`` in this order, each followed (before
    the next key) by its record's name where that record is first used: a sidecar that
    renames, reorders or swaps entries is caught without unpickling anything."""
    starts, pos = [], 0
    for key in keys:
        pos = pickled.find(_pickled_str(key), pos)
        if pos < 0:
            return False
        starts.append(pos)
        pos += 1
    ends = starts[1:] + [len(pickled)]
    seen: set[str] = set()
    for (record, *_), start, end in zip(raw, starts, ends):
        if record not in seen:
            seen.add(record)
            if pickled.find(_pickled_str(record), start, end) < 0:
                return False
    return True


def read_raw(
    path: str | os.PathLike, keys: list[str], raw: list[Any], index: ZipIndex | None = None
) -> dict[str, torch.Tensor] | None:
    """The tensors of a pass file from its records, or ``None`` when anything does not check out.

    Parameters
    ----------
    path : path-like
        The pass file.
    keys, raw : lists
        Per stored entry, in file order: the sidecar's key and ``raw`` layout
        (see :func:`layout`).
    index : ZipIndex, optional
        The file's zip index, when the caller read it already (it is read
        again if the file is no longer the one it describes).

    Returns
    -------
    dict or None
        ``{key: tensor}`` viewing a private (copy-on-write) map of the file.
    """
    opened = checked_map(path, keys, raw, index)
    return None if opened is None else _views(*opened, keys, raw)


def checked_map(
    path: str | os.PathLike, keys: list[str], raw: list[Any], index: ZipIndex | None
) -> tuple[mmap.mmap, ZipIndex, str] | None:
    """``(private map of the file, its zip index, the records' folder + "/")`` once the file
    is a little-endian archive whose pickle names ``keys`` with ``raw``'s records (see
    :func:`read_raw`; each entry's own claims are checked by the reader), else ``None``."""
    if len(keys) != len(raw) or not all(isinstance(e, list) and e and isinstance(e[0], str) for e in raw):
        return None
    opened = _mapped(path, index)
    if opened is None:
        return None
    mapped, index = opened
    prefix = _little_endian(mapped, index)
    pickled = None if prefix is None else _small_record(mapped, index, prefix + "data.pkl")
    if pickled is None or not _pickle_agrees(pickled, keys, raw):
        return None
    return mapped, index, prefix


def _little_endian(mapped: mmap.mmap, index: ZipIndex) -> str | None:
    """The records' folder + ``"/"`` of an archive whose byte order (if it says one) is
    little-endian, else ``None``."""
    prefix = index.first.split("/", 1)[0] + "/" if index.first else ""
    if (
        prefix + "byteorder" in index.names
        and _small_record(mapped, index, prefix + "byteorder") != b"little"
    ):
        return None
    return prefix


def _mapped(path: str | os.PathLike, index: ZipIndex | None) -> tuple[mmap.mmap, ZipIndex] | None:
    """A private (copy-on-write) map of a pass file and its zip index (``index`` when it still
    describes the file, else read again); ``None`` if it is not a readable archive."""
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            if st.st_size == 0:
                return None
            if index is None or index.identity != identity(st):
                index = index_of(f)
                if index is None:
                    return None
            if mapping_files():
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), index
            data = bytearray(st.st_size)  # writable: tensors viewing it are the caller's
            return (data, index) if f.readinto(data) == st.st_size else None
    except (OSError, ValueError):
        return None


def mapping_files() -> bool:
    """Whether pass files are memory-mapped (the default); ``TDINSPECT_MMAP=0`` reads them into
    memory instead. A mapped file truncated in place by another program while its tensors are
    in use is a SIGBUS that kills the process (tdinspect's writer never does that: each pass
    appears by an atomic rename); read into memory, nothing another program does to the file
    reaches tensors already read, at the cost of holding each pass read in memory."""
    return os.environ.get("TDINSPECT_MMAP", "1") != "0"


def _views(
    mapped: mmap.mmap, index: ZipIndex, prefix: str, keys: list[str], raw: list[Any]
) -> dict[str, torch.Tensor] | None:
    """``{key: tensor}`` viewing the map (its byte order checked: :func:`_little_endian`) as
    ``raw`` lays the records out, every claim checked against the archive; ``None`` if one
    does not hold."""
    storages: dict[tuple[str, torch.dtype], torch.Tensor] = {}
    located: dict[str, Any] = {}
    out = {}
    for key, entry in zip(keys, raw):
        span = entry_span(mapped, index, prefix, entry, located)
        if span is None:
            return None
        dtype, start, size = span
        record, offset, shape, strides = entry[:4]
        storage = storages.get((record, dtype))
        if storage is None:
            storage = storages[(record, dtype)] = record_storage(mapped, dtype, start, size)
        out[key] = storage.as_strided(shape, strides, offset)
    return out


def record_storage(buffer, dtype: torch.dtype, start: int, size: int) -> torch.Tensor:
    """A record's ``size`` bytes from ``start`` as a 1-D ``dtype`` tensor viewing ``buffer``."""
    return (
        torch.frombuffer(buffer, dtype=dtype, count=size // dtype.itemsize, offset=start)
        if size
        else torch.empty(0, dtype=dtype)
    )


def entry_span(
    mapped: mmap.mmap, index: ZipIndex, prefix: str, entry: Any, located: dict[str, Any]
) -> tuple[torch.dtype, int, int] | None:
    """``(dtype, start, size)`` of one raw entry's record in the map once the entry's claims
    hold (five fields, a dtype torch knows, a stored record whose size fits the map and is a
    whole number of items, a view inside it), else ``None``. ``located`` caches each record's
    ``(start, size)`` across the entries of a pass; the one check for :func:`read_raw` and
    :func:`tdinspect.store.rawspans.element_starts`."""
    if not (
        isinstance(entry, list)
        and len(entry) == 5
        and isinstance(entry[0], str)
        and isinstance(entry[4], str)
        and entry[4] in _DTYPES
    ):
        return None
    record, offset, shape, strides, name = entry
    dtype = _DTYPES[name]
    where = located.get(record)
    if where is None:
        where = located[record] = _data_start(mapped, index, f"{prefix}data/{record}")
        if where is None:
            return None
    start, size = where
    item = dtype.itemsize
    if size % item or start + size > len(mapped) or not _valid_view(shape, strides, offset, size // item):
        return None
    return dtype, start, size


def crc_failure(path: str | os.PathLike, records: list[str] | None = None) -> str | None:
    """The first record of the archive at ``path`` (of ``records``, names under its records'
    folder such as ``"data/3"``; every record when ``None``) whose bytes do not give the
    CRC-32 its directory lists, else ``None`` (also for a file that is not a readable archive:
    its readers say so). Stored records only: ``torch.save`` compresses nothing.

    Neither ``torch.load`` nor the record reader checks CRCs (a full check would cost a
    second read of every byte, about half a diff's time), so a damaged record reads as
    values; this checks the few records an answer rests on.
    """
    try:
        with open_regular(path) as f:
            index = index_of(f)
            if index is None:
                return None
            prefix = index.first.split("/", 1)[0] + "/" if index.first else ""
            names = list(index.names) if records is None else [prefix + r for r in records]
            return next((name for name in names if not _crc_holds(f.fileno(), index, name)), None)
    except OSError:
        return None


_CRC_CHUNK = 1 << 24


def _crc_holds(fd: int, index: ZipIndex, name: str) -> bool:
    """Whether the stored record ``name`` (absent or compressed: not checked) gives its CRC-32.
    Read with ``pread``, not mapped: a file cut short meanwhile reads short (a mapped read of
    it would be a SIGBUS)."""
    found = index.record(name)
    if found is None or found[2] != zipfile.ZIP_STORED:
        return True
    offset, size, _, crc = found
    head = os.pread(fd, LOCAL_HEADER.size, offset)  # the local header, then its name
    if len(head) == LOCAL_HEADER.size:
        head += os.pread(fd, LOCAL_HEADER.unpack(head)[9], offset + LOCAL_HEADER.size)
    start = local_start(head, 0, name)
    if start is None:
        return False
    from tdinspect.store.crc import crc32  # analysis only: the capture side imports this module too

    done, value = 0, 0
    while done < size:
        chunk = os.pread(fd, min(_CRC_CHUNK, size - done), offset + start + done)
        if not chunk:
            return False
        value = crc32(chunk, value)
        done += len(chunk)
    return value == crc


def read_plain(path: str | os.PathLike) -> tuple[list[str], list[list[Any]], dict[str, torch.Tensor]] | None:
    """``(keys, raw layout, tensors)`` of a pass file without a sidecar, its layout read from
    its pickle's opcodes (:func:`tdinspect.store.picklelayout.layout_of_pickle`, nothing unpickled)
    and checked against the archive as a sidecar's is; ``None`` for anything but a plain
    ``torch.save`` of ``{name: tensor}`` (the caller then uses ``torch.load``).
    """
    from tdinspect.store.picklelayout import layout_of_pickle

    opened = _mapped(path, None)  # one open and one map: for the pickle, then the tensors
    if opened is None or not opened[1].first:
        return None
    mapped, index = opened
    prefix = _little_endian(mapped, index)
    pickled = None if prefix is None else _small_record(mapped, index, prefix + "data.pkl")
    parsed = None if pickled is None else layout_of_pickle(pickled)
    if parsed is None:
        return None
    keys, raw = parsed
    tensors = _views(mapped, index, prefix, keys, raw)
    return None if tensors is None else (keys, raw, tensors)
