"""Transforms: how a B tensor is reshaped or sliced to meet its A partner.

A transform is a Python callable ``tensor -> tensor`` or, in mapping files and
on the command line, a string in a small language: a chain of tensor methods
drawn from an allow-list, with integer literals (or tuples of them) as the
only arguments::

    chunk(3, -1)[0]
    reshape(2, 16, 4, 16).transpose(1, 2)
    narrow(-1, 64, 32).float()

The string is parsed with :mod:`ast` and checked node by node; nothing in it
is evaluated, and a name, an attribute, a keyword, an expression or a method
outside the list is refused with an error that quotes the spec.

Examples
--------
>>> t = parse_transform("chunk(3, -1)[1]")
>>> t(torch.arange(6.0).reshape(1, 6)).tolist()
[[2.0, 3.0]]
>>> t.out_shape([2, 9])
[2, 3]
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tdinspect.errors import TransformError

MAX_SPEC_CHARS = 500
MAX_STEPS = 16
MAX_DEPTH = 64  # of the syntax tree: 16 steps of a chain, each a call with a subscript, nest ~50
MAX_INT = 1 << 31

# method -> (least, most) positional arguments; "ints" = the arguments may also be one tuple
_ARITY = {
    "permute": (1, 8),
    "transpose": (2, 2),
    "reshape": (1, 8),
    "flatten": (0, 2),
    "unflatten": (2, 2),
    "squeeze": (0, 1),
    "unsqueeze": (1, 1),
    "narrow": (3, 3),
    "select": (2, 2),
    "chunk": (2, 2),
    "float": (0, 0),
}
_TUPLE_OK = {"permute", "reshape", "unflatten"}  # the only methods that take a tuple


@dataclass(frozen=True)
class Step:
    """One method call of a chain; ``index`` is set for ``chunk(...)[i]``."""

    name: str
    args: tuple
    index: int | None = None

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        out = getattr(t, self.name)(*self.args)
        return out[self.index] if self.name == "chunk" else out

    def __str__(self) -> str:
        args = ", ".join(str(a) for a in self.args)
        return f"{self.name}({args})" + (f"[{self.index}]" if self.index is not None else "")


@dataclass(frozen=True)
class Transform:
    """A parsed transform (or a wrapped callable): apply it with ``t(tensor)``.

    Attributes
    ----------
    spec : str
        The text it was parsed from (a callable's name for a callable).
    steps : tuple of Step
        The parsed chain (empty for a callable).
    """

    spec: str
    steps: tuple = ()
    fn: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.fn is not None:
            return self.fn(t)
        for step in self.steps:
            t = step.apply(t)
        return t

    def out_shape(self, shape) -> list[int] | None:
        """The shape a tensor of ``shape`` has after the transform, computed on a
        meta tensor (no data). ``None`` when a callable cannot run on one.

        Raises
        ------
        TransformError
            When a parsed spec does not fit ``shape`` (wrong reshape size, dim
            out of range...).
        """
        if self.fn is None:
            return list(_shape_after(self.spec, self.steps, tuple(shape or ())))
        try:
            out = self.fn(torch.empty(list(shape or []), device="meta"))
        except Exception:  # a callable that needs data (numpy, item...): shape known once read
            return None
        return list(out.shape) if isinstance(out, torch.Tensor) else None

    def __str__(self) -> str:
        return self.spec


@functools.lru_cache(maxsize=4096)
def _shape_after(spec: str, steps: tuple, shape: tuple) -> tuple:
    """The shape after ``steps`` (a meta tensor: no data), cached: one call per pair and pass."""
    t = torch.empty(shape, device="meta")
    try:
        for step in steps:
            t = step.apply(t)
    except Exception as exc:  # torch raises RuntimeError, IndexError, TypeError...
        raise TransformError(
            f"transform {spec!r} does not fit shape {list(shape)}: {_first_line(exc)}"
        ) from None
    return tuple(t.shape)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _int(node: ast.AST, spec: str) -> int:
    value = None
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) is int
    ):
        value = -node.operand.value
    if value is None:
        raise TransformError(
            f"transform {spec!r}: only integer literals (or tuples of them) are "
            f"allowed as arguments, not {ast.unparse(node)!r}"
        )
    if abs(value) > MAX_INT:
        raise TransformError(f"transform {spec!r}: integer {value} is too large")
    return value


def _arg(node: ast.AST, spec: str, allow_tuple: bool):
    if isinstance(node, ast.Tuple):
        if not allow_tuple:
            raise TransformError(f"transform {spec!r}: a tuple is not allowed here ({ast.unparse(node)!r})")
        return tuple(_int(e, spec) for e in node.elts)
    return _int(node, spec)


def _call(node: ast.AST, spec: str) -> tuple[ast.AST | None, Step]:
    """``(inner expression or None, step)`` of one ``[x.]name(args)[[i]]`` link."""
    index = None
    if isinstance(node, ast.Subscript):
        index = _int(node.slice, spec)
        node = node.value
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "chunk"
        ):
            raise TransformError(f"transform {spec!r}: indexing [i] is only allowed after chunk(...)")
    if not isinstance(node, ast.Call):
        raise TransformError(
            f"transform {spec!r}: expected a chain of calls such as "
            f"'chunk(3, -1)[0]', found {ast.unparse(node)!r}"
        )
    if isinstance(node.func, ast.Name):
        inner, name = None, node.func.id
    elif isinstance(node.func, ast.Attribute):
        inner, name = node.func.value, node.func.attr
    else:
        raise TransformError(f"transform {spec!r}: {ast.unparse(node.func)!r} is not a method name")
    if name not in _ARITY:
        raise TransformError(
            f"transform {spec!r}: {name!r} is not an allowed operation (allowed: {', '.join(sorted(_ARITY))})"
        )
    if node.keywords:
        raise TransformError(f"transform {spec!r}: {name}() takes positional arguments only")
    lo, hi = _ARITY[name]
    if not lo <= len(node.args) <= hi:
        raise TransformError(
            f"transform {spec!r}: {name}() takes {lo}"
            + (f" to {hi}" if hi != lo else "")
            + f" arguments, got {len(node.args)}"
        )
    args = tuple(_arg(a, spec, name in _TUPLE_OK) for a in node.args)
    if name == "unflatten" and not (isinstance(args[0], int) and isinstance(args[1], tuple)):
        raise TransformError(f"transform {spec!r}: unflatten(dim, (sizes)) expects an int and a tuple")
    if name in ("permute", "reshape") and any(isinstance(a, tuple) for a in args) and len(args) > 1:
        raise TransformError(f"transform {spec!r}: {name}() takes ints or one tuple")
    if name == "chunk":
        if index is None:
            raise TransformError(f"transform {spec!r}: chunk(n, dim) must be followed by [i]")
        if args[0] < 1 or not -args[0] <= index < args[0]:
            raise TransformError(f"transform {spec!r}: chunk({args[0]}, ...)[{index}] is out of range")
    return inner, Step(name, args, index)


def _depth(tree: ast.AST) -> int:
    """How deep ``tree`` nests, walked without recursion (``-(-(...1))`` 400 deep ended in
    ``RecursionError``)."""
    deepest, todo = 0, [(tree, 1)]
    while todo:
        node, d = todo.pop()
        deepest = max(deepest, d)
        todo.extend((child, d + 1) for child in ast.iter_child_nodes(node))
    return deepest


def parse_transform(spec: str) -> Transform:
    """Parse a transform string (never evaluated); see the module docstring.

    Raises
    ------
    TransformError
        For anything outside the language, quoting the spec.

    Examples
    --------
    >>> [str(s) for s in parse_transform("reshape(2, 16, 4, 16).transpose(1, 2)").steps]
    ['reshape(2, 16, 4, 16)', 'transpose(1, 2)']
    """
    if not isinstance(spec, str):
        raise TransformError(f"transform must be a string or a callable, not {type(spec).__name__}")
    text = spec.strip()
    if not text:
        raise TransformError("empty transform spec")
    if len(text) > MAX_SPEC_CHARS:
        raise TransformError(f"transform spec of {len(text)} characters (at most {MAX_SPEC_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise TransformError(f"transform {spec!r}: not valid syntax ({exc.msg})") from None
    except (RecursionError, MemoryError):  # the parser's own stack
        raise TransformError(f"transform {spec!r}: nested too deeply to parse") from None
    depth = _depth(tree)
    if depth > MAX_DEPTH:  # the checks below (ast.unparse in their messages) recurse
        raise TransformError(f"transform {spec!r}: nested {depth} deep (at most {MAX_DEPTH})")
    steps = []
    node: ast.AST | None = tree.body
    while node is not None:
        node, step = _call(node, spec)
        steps.append(step)
        if len(steps) > MAX_STEPS:
            raise TransformError(f"transform {spec!r}: more than {MAX_STEPS} steps")
    return Transform(text, tuple(reversed(steps)))


def as_transform(value: Any) -> Transform | None:
    """``None`` for no transform, a :class:`Transform` from a spec string or a callable."""
    if value is None or isinstance(value, Transform):
        return value
    if isinstance(value, str):
        return parse_transform(value) if value.strip() else None
    if callable(value):
        return Transform(getattr(value, "__name__", repr(value)), (), value)
    raise TransformError(f"transform must be a string or a callable, not {type(value).__name__}")
