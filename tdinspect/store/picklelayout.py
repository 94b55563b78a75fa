"""Where each tensor of a plain ``torch.save`` pass file lies, read from its pickle's opcodes.

A pass file written by another tool has no sidecar to say where its tensors'
bytes are, so opening it meant ``torch.load(weights_only=True)``: a Python
unpickler step per object, most of the open of a dump without sidecars, then
paid again to read the tensors. Yet ``torch.save`` of ``{name: tensor}``
writes one simple program: a dict whose values are
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` with
``storage`` a persistent id ``('storage', torch.<Type>Storage, record, 'cpu', n)``.

:func:`layout_of_pickle` reads that program opcode by opcode (the subset of
pickle protocol 2 such a file uses, decoded here as ``pickletools`` documents
it; ``pickletools.genops`` took 3.5 us an opcode, most of an open): nothing is
imported, called or built but strings, numbers, tuples and this module's own
markers, and it returns the keys and their
``[record, offset, shape, strides, dtype]`` layout, the same as a sidecar's
``raw`` column (:mod:`tdinspect.store.rawpass`), whose reader then checks every claim
against the archive. Any opcode, global or structure outside that program
(another protocol's object, a sparse or quantized tensor, a float8 tensor
saved with ``_rebuild_tensor_v3``, a subclass...) gives ``None`` and the
caller uses ``torch.load(weights_only=True)``.

That opcode reader (:func:`_exact_layout`, about 15 us an entry) decides;
the usual program is first read by :func:`_template_layout`, one compiled
pattern an entry (about 4 us), which only answers where its answer is the
opcode reader's (tested on memo tricks, token edits and byte mutations) and
otherwise hands the pickle on.

Examples
--------
>>> import io, zipfile, torch
>>> buf = io.BytesIO()
>>> torch.save({"a": torch.ones(2, 3)}, buf)
>>> pickled = zipfile.ZipFile(buf).read("archive/data.pkl")
>>> layout_of_pickle(pickled)
(['a'], [['0', 0, [2, 3], [3, 1], 'torch.float32']])
"""

from __future__ import annotations

import operator
import re
import struct
from typing import Any

import numpy as np
import torch

# the storage types torch.save names for each dtype (torch/storage.py's legacy classes)
_STORAGES = {
    f"torch {name}": str(dtype)
    for name, dtype in (
        ("DoubleStorage", torch.float64),
        ("FloatStorage", torch.float32),
        ("HalfStorage", torch.float16),
        ("BFloat16Storage", torch.bfloat16),
        ("LongStorage", torch.int64),
        ("IntStorage", torch.int32),
        ("ShortStorage", torch.int16),
        ("CharStorage", torch.int8),
        ("ByteStorage", torch.uint8),
        ("BoolStorage", torch.bool),
        ("ComplexDoubleStorage", torch.complex128),
        ("ComplexFloatStorage", torch.complex64),
    )
}
_REBUILD = "torch._utils _rebuild_tensor_v2"
_ORDERED_DICT = "collections OrderedDict"


class _Global(str):
    """A ``module name`` the pickle names (kept as text, never looked up)."""


class _Mark:
    pass


_MARK = _Mark()
_NO_HOOKS = object()  # an empty OrderedDict() (the backward hooks argument)


class _Refused(Exception):
    pass


def _tuple_until_mark(stack: list) -> tuple:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is _MARK:
            items = tuple(stack[i + 1 :])
            del stack[i:]
            return items
    raise _Refused


def _tensor(args: Any) -> list[Any]:
    """``[record, offset, shape, strides, dtype]`` from ``_rebuild_tensor_v2``'s arguments."""
    if not isinstance(args, tuple) or len(args) not in (6, 7):
        raise _Refused
    storage, offset, size, stride, requires_grad, hooks = args[:6]
    if not (
        isinstance(storage, tuple)
        and len(storage) == 3
        and storage[0] == "storage"
        and type(offset) is int
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and type(requires_grad) is bool
        and hooks is _NO_HOOKS
        and (len(args) == 6 or args[6] is _NO_HOOKS)
    ):
        raise _Refused
    _, dtype, record = storage
    if not all(type(v) is int for v in size + stride):
        raise _Refused
    return [record, offset, list(size), list(stride), dtype]


_FIXED = {  # opcode: (name, argument bytes, struct format or None)
    b"\x80": ("PROTO", 1, "<B"),
    b"K": ("BININT1", 1, "<B"),
    b"M": ("BININT2", 2, "<H"),
    b"J": ("BININT", 4, "<i"),
    b"q": ("BINPUT", 1, "<B"),
    b"r": ("LONG_BINPUT", 4, "<I"),
    b"h": ("BINGET", 1, "<B"),
    b"j": ("LONG_BINGET", 4, "<I"),
    b"}": ("EMPTY_DICT", 0, None),
    b"(": ("MARK", 0, None),
    b")": ("EMPTY_TUPLE", 0, None),
    b"t": ("TUPLE", 0, None),
    b"\x85": ("TUPLE1", 0, None),
    b"\x86": ("TUPLE2", 0, None),
    b"\x87": ("TUPLE3", 0, None),
    b"\x88": ("NEWTRUE", 0, None),
    b"\x89": ("NEWFALSE", 0, None),
    b"Q": ("BINPERSID", 0, None),
    b"R": ("REDUCE", 0, None),
    b"s": ("SETITEM", 0, None),
    b"u": ("SETITEMS", 0, None),
    b".": ("STOP", 0, None),
    b"\x94": ("MEMOIZE", 0, None),
}


def _opcodes(data: bytes):
    """``(name, argument)`` of each opcode of the subset above (``_Refused`` for any other)."""
    i, n = 0, len(data)
    fixed = _FIXED
    while i < n:
        code = data[i : i + 1]
        i += 1
        known = fixed.get(code)
        if known is not None:  # the common case first: most opcodes are fixed-size
            name, width, fmt = known
            if i + width > n:
                raise _Refused
            yield name, struct.unpack_from(fmt, data, i)[0] if fmt else None
            i += width
        elif code == b"X" or code == b"\x8c":  # BINUNICODE, SHORT_BINUNICODE
            width = 4 if code == b"X" else 1
            size = int.from_bytes(data[i : i + width], "little")
            i += width
            if i + size > n:
                raise _Refused
            yield "BINUNICODE", data[i : i + size].decode("utf-8", "surrogatepass")
            i += size
        elif code == b"\x8a":  # LONG1
            size = data[i] if i < n else 0
            yield "LONG1", int.from_bytes(data[i + 1 : i + 1 + size], "little", signed=True)
            i += 1 + size
        elif code == b"c":  # GLOBAL: "module\nname\n"
            first = data.find(b"\n", i)
            second = data.find(b"\n", first + 1) if first >= 0 else -1
            if second < 0:
                raise _Refused
            yield "GLOBAL", (data[i:first] + b" " + data[first + 1 : second]).decode("ascii")
            i = second + 1
        else:
            raise _Refused
    raise _Refused  # no STOP


_PUSHED = frozenset(("BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1"))


def layout_of_pickle(pickled: bytes) -> tuple[list[str], list[list[Any]]] | None:
    """``(keys, raw layout)`` of a ``torch.save`` of a dict of plain tensors, or ``None``.

    The usual program is read by :func:`_template_layout` (a compiled pattern
    per entry); whatever it does not recognise goes to the opcode reader
    :func:`_exact_layout`, which decides.
    """
    found = _template_layout(pickled)
    return found if found is not None else _exact_layout(pickled)


def _exact_layout(pickled: bytes) -> tuple[list[str], list[list[Any]]] | None:
    """``(keys, raw layout)`` read opcode by opcode, or ``None``."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    top = None
    try:
        for name, arg in _opcodes(pickled):  # the frequent opcodes tested first
            if name == "BINPUT" or name == "LONG_BINPUT":
                memo[arg] = stack[-1]
            elif name in _PUSHED:
                stack.append(arg)
            elif name == "BINGET" or name == "LONG_BINGET":
                stack.append(memo[arg])
            elif name == "PROTO":
                continue
            elif name == "EMPTY_DICT":
                if top is not None or stack:
                    raise _Refused  # one dict, the outermost object
                top = {}
                stack.append(top)
            elif name == "MARK":
                stack.append(_MARK)
            elif name in ("NEWFALSE", "NEWTRUE"):
                stack.append(name == "NEWTRUE")
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                k = int(name[-1])
                if len(stack) < k:
                    raise _Refused
                items = tuple(stack[-k:])
                del stack[-k:]
                stack.append(items)
            elif name == "TUPLE":
                stack.append(_tuple_until_mark(stack))
            elif name == "GLOBAL":
                if arg != _REBUILD and arg != _ORDERED_DICT and arg not in _STORAGES:
                    raise _Refused
                stack.append(_Global(arg))
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name == "BINPERSID":
                pid = stack.pop()
                if not (
                    isinstance(pid, tuple)
                    and len(pid) == 5
                    and pid[0] == "storage"
                    and isinstance(pid[1], _Global)
                    and pid[1] in _STORAGES
                    and isinstance(pid[2], str)
                    and pid[3] == "cpu"
                    and type(pid[4]) is int
                ):
                    raise _Refused
                stack.append(("storage", _STORAGES[pid[1]], pid[2]))
            elif name == "REDUCE":
                args, fn = stack.pop(), stack.pop()
                if fn == _ORDERED_DICT and isinstance(fn, _Global) and args == ():
                    stack.append(_NO_HOOKS)
                elif fn == _REBUILD and isinstance(fn, _Global):
                    stack.append(_tensor(args))
                else:
                    raise _Refused
            elif name in ("SETITEM", "SETITEMS"):
                items = (
                    [stack.pop(), stack.pop()][::-1] if name == "SETITEM" else list(_tuple_until_mark(stack))
                )
                if not stack or stack[-1] is not top or len(items) % 2:
                    raise _Refused
                for key, value in zip(items[::2], items[1::2]):
                    if type(key) is not str or not isinstance(value, list) or key in top:
                        raise _Refused
                    top[key] = value
            elif name == "STOP":
                break
            else:
                raise _Refused
    except (_Refused, ValueError, IndexError, KeyError, TypeError, UnicodeError, struct.error):
        return None
    if top is None or stack != [top]:
        return None
    return list(top), list(top.values())


# -- the usual program, matched an entry at a time ----------------------------------------------
# What torch.save (pickle protocol 2, memo on) writes for one item of the dict once its key's
# BINUNICODE is read: the key's memo put, then the tensor (or a memo read of a tensor saved under
# an earlier key). A constant (the rebuild function, 'storage', the storage type, the record's
# name, 'cpu', OrderedDict) is written out and memoised the first time, read from the memo after;
# integers are K/M/J, shape and strides EMPTY_TUPLE, TUPLE1-3 or MARK ... TUPLE. Anything else
# (a LONG1 integer, another opcode, a memo read of something not remembered here) is no match,
# and the opcode reader decides.
_PUT = rb"(q.|r....)"
_GET = rb"(h.|j....)"
_INT = rb"(?:K.|M..|J....)"
_INTS = rb"(\)|" + _INT + rb"{1,3}[\x85-\x87]|\(" + _INT + rb"*t)(q.|r....)?"
_ENTRY = re.compile(
    _PUT  # 0: the key's put
    + rb"(?:(?:ctorch\._utils\n_rebuild_tensor_v2\n"
    + _PUT
    + rb"|"
    + _GET
    + rb")\(\("  # 1, 2
    + rb"(?:X\x07\x00\x00\x00storage"
    + _PUT
    + rb"|"
    + _GET
    + rb")"  # 3, 4
    + rb"(?:ctorch\n(\w{1,40})\n"
    + _PUT
    + rb"|"
    + _GET
    + rb")"  # 5: type, 6, 7
    + rb"(?:X(.)\x00\x00\x00(\d{1,20})"
    + _PUT
    + rb"|"
    + _GET
    + rb")"  # 8: size, 9: name, 10, 11
    + rb"(?:X\x03\x00\x00\x00cpu"
    + _PUT
    + rb"|"
    + _GET
    + rb")"  # 12, 13
    + rb"("
    + _INT
    + rb")t"
    + _PUT
    + rb"Q("
    + _INT
    + rb")"  # 14: numel, 15, 16: offset
    + _INTS
    + _INTS
    + rb"[\x88\x89]"  # 17-18 shape, 19-20 strides
    + rb"(?:ccollections\nOrderedDict\n"
    + _PUT
    + rb"|"
    + _GET
    + rb")"  # 21, 22
    + rb"\)R"
    + _PUT
    + rb"t"
    + _PUT
    + rb"R"
    + _PUT  # 23, 24, 25: the tensor's
    + rb"|"
    + _GET
    + rb")",
    re.DOTALL,
)  # 26: an earlier tensor
_PUTS_OF = operator.itemgetter(0, 1, 3, 6, 10, 12, 15, 18, 20, 21, 23, 24, 25)
_CONSTANT_GETS = operator.itemgetter(2, 4, 7, 13, 22)
_INT_TOKEN = re.compile(_INT, re.DOTALL)
_PROLOGUE = b"\x80\x02}q\x00"  # PROTO 2, EMPTY_DICT, BINPUT 0


def _int(token: bytes) -> int:
    return int.from_bytes(token[1:], "little", signed=token[0] == 0x4A)  # J is signed


def _ints(body: bytes) -> tuple[int, ...] | None:
    """The integers of a matched EMPTY_TUPLE / TUPLE1-3 / MARK ... TUPLE (``None``: a TUPLEn
    of another count, whose items the opcode reader would take differently)."""
    if body == b")":
        return ()
    tokens = _INT_TOKEN.findall(body, 1 if body[0] == 0x28 else 0, len(body) - 1)
    if body[0] != 0x28 and len(tokens) != body[-1] - 0x84:
        return None
    return tuple(map(_int, tokens))


def _remember(put: bytes, value: Any, memo: dict) -> Any:
    """``value``, kept in ``memo`` under the memo read (BINGET / LONG_BINGET) of its put."""
    memo[(b"h" if put[0] == 0x71 else b"j") + put[1:]] = value
    return value


def _constant(put: bytes | None, get: bytes | None, value: Any, memo: dict) -> Any:
    """A constant slot's value: written out (remembered) or read from the memo (``None`` if
    the memo read names nothing remembered here)."""
    return memo.get(get) if put is None else _remember(put, value, memo)


def _storage_of(g: tuple, names: dict, strings: dict) -> tuple[str, str] | None:
    """``(dtype, record)`` from an entry's constant slots, read in file order (a memo read
    can only name what came before it); ``None`` if any is not what torch.save writes."""
    if (
        _constant(g[1], g[2], _REBUILD, names) != _REBUILD
        or _constant(g[3], g[4], "storage", strings) != "storage"
    ):
        return None
    dtype = _STORAGES.get(_constant(g[6], g[7], g[5] and "torch " + g[5].decode(), names))
    if g[10] is not None and g[8][0] != len(g[9]):
        return None
    record = _constant(g[10], g[11], g[9] and g[9].decode(), strings)
    if (
        dtype is None
        or record is None
        or _constant(g[12], g[13], "cpu", strings) != "cpu"
        or _constant(g[21], g[22], _ORDERED_DICT, names) != _ORDERED_DICT
    ):
        return None
    return dtype, record


_LOW_PUTS = bytes(b for i in range(1, 256) for b in (0x71, i))  # BINPUT 1 ... BINPUT 255


def _memo_puts(stop: int) -> bytes:
    """BINPUT 1 ... LONG_BINPUT ``stop - 1``: the memo puts as pickle numbers them."""
    low = _LOW_PUTS[: 2 * (min(stop, 256) - 1)]
    high = np.arange(256, max(stop, 256), dtype="<u4")
    rows = np.empty((len(high), 5), dtype=np.uint8)
    rows[:, 0] = 0x72
    rows[:, 1:] = high.view(np.uint8).reshape(-1, 4)
    return low + rows.tobytes()


def _template_layout(pickled: bytes) -> tuple[list[str], list[list[Any]]] | None:
    """``(keys, raw layout)`` of the usual ``torch.save`` program, read an entry at a time with
    :data:`_ENTRY`; ``None`` for anything else (then read by :func:`_exact_layout`).

    Only what this reader remembered is looked up in the memo, and every memo put must
    carry pickle's own sequential number (checked at the end: no index is written twice),
    so an answer is the one the opcode reader gives (tested on mutated pickles).
    """
    if not pickled.startswith(_PROLOGUE):
        return None
    data, pos = pickled, len(_PROLOGUE)
    top: dict[str, list[Any]] = {}
    puts: list[bytes] = []
    names: dict[bytes, str] = {}  # memo read -> a global's name remembered here
    strings: dict[bytes, str] = {}  # memo read -> a string remembered here
    tensors: dict[bytes, list] = {}  # memo read -> a tensor's layout
    steady: dict[tuple, str] = {}  # constant slots' memo reads -> the dtype they resolved to
    ints: dict[bytes, int] = {}
    tuples: dict[bytes, tuple | None] = {}
    match = _ENTRY.match
    try:
        while True:
            op = data[pos : pos + 1]
            if op == b".":
                break
            if op == b"(":  # MARK, up to 1000 items, SETITEMS
                pos, end = pos + 1, b"u"
            elif op == b"X":  # a batch of one item: key, value, SETITEM
                end = b"s"
            else:
                return None
            while data[pos : pos + 1] == b"X":
                size = int.from_bytes(data[pos + 1 : pos + 5], "little")
                m = match(data, pos + 5 + size)
                if m is None:
                    return None
                key = data[pos + 5 : pos + 5 + size].decode("utf-8", "surrogatepass")
                if key in top:
                    return None
                g = m.groups()
                if g[26] is not None:  # the tensor of an earlier key
                    value = tensors.get(g[26])
                else:
                    gets = _CONSTANT_GETS(g)
                    dtype = steady.get(gets)
                    if dtype is not None:  # the constants are memo reads resolved before
                        record = (
                            strings.get(g[11]) if g[10] is None else _remember(g[10], g[9].decode(), strings)
                        )
                    else:
                        found = _storage_of(g, names, strings)
                        if found is None:
                            return None
                        dtype, record = found
                        if None not in gets:
                            steady[gets] = dtype
                    shape = tuples[g[17]] if g[17] in tuples else tuples.setdefault(g[17], _ints(g[17]))
                    stride = tuples[g[19]] if g[19] in tuples else tuples.setdefault(g[19], _ints(g[19]))
                    offset = ints.get(g[16])
                    if offset is None:
                        offset = ints[g[16]] = _int(g[16])
                    if (
                        record is None
                        or shape is None
                        or stride is None
                        or (g[10] is not None and g[8][0] != len(g[9]))
                    ):
                        return None
                    value = _remember(g[25], [record, offset, list(shape), list(stride), dtype], tensors)
                if value is None:
                    return None
                top[key] = value
                puts.extend(filter(None, _PUTS_OF(g)))
                pos = m.end()
                if end == b"s":
                    break
            if data[pos : pos + 1] != end:
                return None
            pos += 1
    except UnicodeError:
        return None
    if pos + 1 != len(data) or b"".join(puts) != _memo_puts(len(puts) + 1):
        return None
    return list(top), list(top.values())
