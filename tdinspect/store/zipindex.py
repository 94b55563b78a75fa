"""A pass file's zip index (its central directory), read once and shared.

Two readers need the index of a pass file: the sidecar's binding check when a
dump is opened (:mod:`tdinspect.store.sidecars`: a digest of every record's name,
CRC-32 and size) and the record reader when its tensors are read
(:mod:`tdinspect.store.rawpass`: where each record's bytes start). :func:`read_index`
reads it once; a :class:`~tdinspect.store.passindex.PassIndex` keeps what its open
read until its first read of tensors uses it.

``zipfile`` builds a Python object per record and was half the cost of
opening a dump of 1,500-entry passes (150,000 records in 1.2 s), so the usual
layout (what ``torch.save`` writes: no zip64 fields in the records, nothing
before the archive) is parsed here with ``struct`` over one read of the
directory. Anything else goes through ``zipfile``, which gives the same
answer slowly (tested).

Examples
--------
>>> import os, tempfile, torch
>>> path = os.path.join(tempfile.mkdtemp(), "pass00000.pt")
>>> torch.save({"a": torch.ones(3)}, path)
>>> index = read_index(path)
>>> sorted(n.split("/", 1)[1] for n in index.names)[:2]
['.data/serialization_id', '.format_version']
"""

from __future__ import annotations

import hashlib
import os
import struct
import zipfile
from array import array
from dataclasses import dataclass

from tdinspect.util.regularfile import open_regular

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory
_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory
# central directory file header (46 bytes), the fields read: signature, flags, method,
# CRC-32, compressed size, size, name / extra / comment lengths, local header offset
_CENTRAL = struct.Struct("<4s4xHH4xLLLHHH8xL")
_TAIL = 1 << 16  # bytes read from the end: the end records (and most directories)
_FULL = 0xFFFFFFFF


@dataclass
class ZipIndex:
    """What the central directory of one archive says.

    Attributes
    ----------
    identity : tuple
        ``(st_dev, st_ino, st_size, st_mtime_ns)`` of the file read: an index
        only describes that file.
    size : int
        The file's size in bytes.
    names : dict
        ``{record name: row}`` (a name listed twice: the last, as ``zipfile``
        reads it); the row indexes ``offsets`` (of local headers), ``sizes``,
        ``methods`` (of compression) and ``crcs`` (arrays: an index of 10^5
        records stays a few objects, not 10^5 tuples for the garbage collector).
    digest : str
        SHA-256 of ``name \\0 CRC \\0 size \\n`` of every record in directory
        order (the sidecar binding's ``pass_records``).
    first : str
        The first record's name (``torch.save`` puts every record in one folder).
    twice : str or None
        A record name the directory lists more than once (``None``: none is).
        Readers disagree on which such a record is (``torch.load`` reads the
        first, ``zipfile`` the last), so no reader reads an archive that has one.
    """

    identity: tuple
    size: int
    names: dict[str, int]
    offsets: array
    sizes: array
    methods: array
    crcs: array
    digest: str
    first: str
    twice: str | None = None

    @property
    def records(self) -> dict[str, tuple[int, int, int, int]]:
        """``{name: (local header offset, size, compression method, CRC-32)}`` (for tests)."""
        return {name: self.record(name) for name in self.names}

    def record(self, name: str) -> tuple[int, int, int, int] | None:
        """``(local header offset, size, compression method, CRC-32)`` of a record, or ``None``."""
        i = self.names.get(name)
        if i is None:
            return None
        return self.offsets[i], self.sizes[i], self.methods[i], self.crcs[i]


def identity(st: os.stat_result) -> tuple:
    """The part of a ``stat`` that says a file is still the one an index was read from."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_index(path: str | os.PathLike) -> ZipIndex | None:
    """The index of the zip archive at ``path``; ``None`` if it is not a readable one."""
    try:
        with open_regular(path) as f:
            return index_of(f)
    except OSError:
        return None


def index_of(f) -> ZipIndex | None:
    """The index of an open archive file (binary, seekable); ``None`` if it is not one."""
    try:
        st = os.fstat(f.fileno())
        found = _fast(f, st.st_size)
        if found is None:
            f.seek(0)
            found = _slow(f)
        names, columns, digest, first = found
        twice = None
        if len(names) != len(columns[0]):  # a name listed twice: which one, from zipfile's list
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                listed = archive.namelist()
            twice = next(n for i, n in enumerate(listed) if n in listed[:i])
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, struct.error):
        return None
    return ZipIndex(identity(st), st.st_size, names, *(array("Q", c) for c in columns), digest, first, twice)


LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # local file header (30 bytes), then name, extra
_LOCAL_SIGNATURE = 0x04034B50


def _local_header(buffer, offset: int) -> tuple | None:
    """The fields of the local header at ``offset`` of ``buffer``, if one starts there."""
    if offset + LOCAL_HEADER.size > len(buffer):
        return None
    fields = LOCAL_HEADER.unpack_from(buffer, offset)
    return fields if fields[0] == _LOCAL_SIGNATURE else None


def local_start(buffer, offset: int, name: str) -> int | None:
    """Where the data of the record ``name`` starts in ``buffer`` (an archive's bytes: a map)
    when the local header at ``offset`` is that record's, else ``None``."""
    fields = _local_header(buffer, offset)
    if fields is None:
        return None
    start = offset + LOCAL_HEADER.size
    # the names torch.save writes are ASCII: one comparison of bytes (decoding every name
    # made reading a pass of 20,000 small entries 13% slower; this, within noise)
    if (
        buffer[start : start + fields[9]] != name.encode("utf-8", "surrogateescape")
        and _local_name(buffer, offset) != name
    ):
        return None
    return start + fields[9] + fields[10]


def _local_name(buffer, offset: int) -> str | None:
    """The record name of the local header at ``offset`` as ``zipfile`` decodes it (the
    ``repr`` of its bytes when they do not decode), if one starts there."""
    fields = _local_header(buffer, offset)
    if fields is None:
        return None
    raw = bytes(buffer[offset + LOCAL_HEADER.size : offset + LOCAL_HEADER.size + fields[9]])
    try:
        return _decoded(raw, fields[2])
    except UnicodeDecodeError:  # flagged UTF-8, and not
        return repr(raw)


def disagreement(buffer, index: ZipIndex) -> str | None:
    """Why the archive in ``buffer`` (its bytes, ``index`` its directory) is not one archive
    every reader reads alike, or ``None``: a record name listed twice, or a directory entry
    that does not lead to a local header of its own name (``torch.load`` reads the bytes
    there without looking at the name; ``zipfile`` refuses)."""
    if index.twice is not None:
        return f"its directory lists the record {index.twice!r} twice"
    for name, row in index.names.items():
        if local_start(buffer, index.offsets[row], name) is None:
            found = _local_name(buffer, index.offsets[row])
            there = "no local header" if found is None else f"the local header of {found!r}"
            return f"its directory sends the record {name!r} to {there}"
    return None


def _fast(f, size: int):
    """``(records, digest, first)`` of the usual layout, or ``None`` to let ``zipfile`` read it."""
    start = max(0, size - _TAIL)
    f.seek(start)
    tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _EOCD.size:
        return None
    _, disk, cd_disk, _, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
    if at + _EOCD.size + comment != len(tail) or disk or cd_disk:
        return None
    end = start + at  # where the directory (and any zip64 end records) stop
    if at >= _LOCATOR.size and tail[at - _LOCATOR.size : at - _LOCATOR.size + 4] == b"PK\x06\x07":
        _, _, eocd64, _ = _LOCATOR.unpack_from(tail, at - _LOCATOR.size)
        if eocd64 < start or eocd64 - start + _EOCD64.size > len(tail):
            return None
        sig, _, _, _, _, _, _, count, cd_size, cd_offset = _EOCD64.unpack_from(tail, eocd64 - start)
        if sig != b"PK\x06\x06":
            return None
        end = eocd64
    if cd_offset + cd_size != end:  # data before the archive, or a gap: zipfile's business
        return None
    if cd_offset >= start:
        directory = tail[cd_offset - start : cd_offset - start + cd_size]
    else:
        f.seek(cd_offset)
        directory = f.read(cd_size)
    if len(directory) != cd_size:
        return None
    names: dict[str, int] = {}
    offsets, sizes, methods, crcs, lines = [], [], [], [], []
    pos = 0
    unpack = _CENTRAL.unpack_from
    for i in range(count):
        sig, flags, method, crc, csize, fsize, nlen, elen, clen, offset = unpack(directory, pos)
        if sig != b"PK\x01\x02" or _FULL in (csize, fsize, offset):
            return None  # zip64 sizes in an extra field: zipfile reads those
        raw = directory[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen]
        if not raw.isascii() or b"\0" in raw:
            name = _decoded(raw, flags)
            raw = name.encode()
        else:
            name = raw.decode("ascii")
        lines.append(b"%s\0%d\0%d\n" % (raw, crc, fsize))
        names[name] = i
        offsets.append(offset)
        sizes.append(fsize)
        methods.append(method)
        crcs.append(crc)
        pos += _CENTRAL.size + nlen + elen + clen
    if pos != cd_size or not lines:
        return None
    return (
        names,
        (offsets, sizes, methods, crcs),
        hashlib.sha256(b"".join(lines)).hexdigest(),
        next(iter(names)),
    )


def _decoded(raw: bytes, flags: int) -> str:
    """A record name as ``zipfile`` decodes it (UTF-8 when flagged, else cp437; cut at NUL)."""
    name = raw.decode("utf-8" if flags & 0x800 else "cp437")
    return name.split("\0", 1)[0]


def _slow(f):
    with zipfile.ZipFile(f) as archive:
        infos = archive.infolist()
    h = hashlib.sha256()
    for info in infos:
        h.update(f"{info.filename}\0{info.CRC}\0{info.file_size}\n".encode())
    names = {info.filename: i for i, info in enumerate(infos)}
    columns = (
        [i.header_offset for i in infos],
        [i.file_size for i in infos],
        [i.compress_type for i in infos],
        [i.CRC for i in infos],
    )
    return names, columns, h.hexdigest(), infos[0].filename if infos else ""
