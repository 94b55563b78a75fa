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
``raw`` column (:mod:`tdinspect.rawpass`), whose reader then checks every claim
against the archive. Any opcode, global or structure outside that program
(another protocol's object, a sparse or quantized tensor, a float8 tensor
saved with ``_rebuild_tensor_v3``, a subclass...) gives ``None`` and the
caller uses ``torch.load(weights_only=True)``.

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

import struct
from typing import Any

import torch

# the storage types torch.save names for each dtype (torch/storage.py's legacy classes)
_STORAGES = {f"torch {name}": str(dtype) for name, dtype in (
    ("DoubleStorage", torch.float64), ("FloatStorage", torch.float32),
    ("HalfStorage", torch.float16), ("BFloat16Storage", torch.bfloat16),
    ("LongStorage", torch.int64), ("IntStorage", torch.int32), ("ShortStorage", torch.int16),
    ("CharStorage", torch.int8), ("ByteStorage", torch.uint8), ("BoolStorage", torch.bool),
    ("ComplexDoubleStorage", torch.complex128), ("ComplexFloatStorage", torch.complex64))}
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
            items = tuple(stack[i + 1:])
            del stack[i:]
            return items
    raise _Refused


def _tensor(args: Any) -> list[Any]:
    """``[record, offset, shape, strides, dtype]`` from ``_rebuild_tensor_v2``'s arguments."""
    if not isinstance(args, tuple) or len(args) not in (6, 7):
        raise _Refused
    storage, offset, size, stride, requires_grad, hooks = args[:6]
    if not (isinstance(storage, tuple) and len(storage) == 3 and storage[0] == "storage"
            and type(offset) is int and isinstance(size, tuple) and isinstance(stride, tuple)
            and type(requires_grad) is bool and hooks is _NO_HOOKS
            and (len(args) == 6 or args[6] is _NO_HOOKS)):
        raise _Refused
    _, dtype, record = storage
    if not all(type(v) is int for v in size + stride):
        raise _Refused
    return [record, offset, list(size), list(stride), dtype]


_FIXED = {  # opcode: (name, argument bytes, struct format or None)
    b"\x80": ("PROTO", 1, "<B"), b"K": ("BININT1", 1, "<B"), b"M": ("BININT2", 2, "<H"),
    b"J": ("BININT", 4, "<i"), b"q": ("BINPUT", 1, "<B"), b"r": ("LONG_BINPUT", 4, "<I"),
    b"h": ("BINGET", 1, "<B"), b"j": ("LONG_BINGET", 4, "<I"), b"}": ("EMPTY_DICT", 0, None),
    b"(": ("MARK", 0, None), b")": ("EMPTY_TUPLE", 0, None), b"t": ("TUPLE", 0, None),
    b"\x85": ("TUPLE1", 0, None), b"\x86": ("TUPLE2", 0, None), b"\x87": ("TUPLE3", 0, None),
    b"\x88": ("NEWTRUE", 0, None), b"\x89": ("NEWFALSE", 0, None), b"Q": ("BINPERSID", 0, None),
    b"R": ("REDUCE", 0, None), b"s": ("SETITEM", 0, None), b"u": ("SETITEMS", 0, None),
    b".": ("STOP", 0, None), b"\x94": ("MEMOIZE", 0, None)}


def _opcodes(data: bytes):
    """``(name, argument)`` of each opcode of the subset above (``_Refused`` for any other)."""
    i, n = 0, len(data)
    fixed = _FIXED
    while i < n:
        code = data[i:i + 1]
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
            size = int.from_bytes(data[i:i + width], "little")
            i += width
            if i + size > n:
                raise _Refused
            yield "BINUNICODE", data[i:i + size].decode("utf-8", "surrogatepass")
            i += size
        elif code == b"\x8a":  # LONG1
            size = data[i] if i < n else 0
            yield "LONG1", int.from_bytes(data[i + 1:i + 1 + size], "little", signed=True)
            i += 1 + size
        elif code == b"c":  # GLOBAL: "module\nname\n"
            first = data.find(b"\n", i)
            second = data.find(b"\n", first + 1) if first >= 0 else -1
            if second < 0:
                raise _Refused
            yield "GLOBAL", (data[i:first] + b" " + data[first + 1:second]).decode("ascii")
            i = second + 1
        else:
            raise _Refused
    raise _Refused  # no STOP


_PUSHED = frozenset(("BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1"))


def layout_of_pickle(pickled: bytes) -> tuple[list[str], list[list[Any]]] | None:
    """``(keys, raw layout)`` of a ``torch.save`` of a dict of plain tensors, or ``None``."""
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
                if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                        and isinstance(pid[1], _Global) and pid[1] in _STORAGES
                        and isinstance(pid[2], str) and pid[3] == "cpu" and type(pid[4]) is int):
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
                items = [stack.pop(), stack.pop()][::-1] if name == "SETITEM" \
                    else list(_tuple_until_mark(stack))
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
