"""Per-entry dims annotations: which tensor dim is sharded over which parallel axis.

A dims spec names a tensor's dims in order, separated by spaces; a dim may
carry modifiers in parentheses, separated by commas::

    "b s h(tp)"               h is split over tensor-parallel ranks (concatenate in tp order)
    "b s(cp,zigzag) h(tp) d"  s split over context parallel in zigzag order, h over tp
    "b s h(tp,partial)"       every tp rank holds a partial sum of the whole h (sum them)

Axes: ``tp``, ``cp``, ``ep``, ``sp`` (concatenate shards along this dim in the
rank order of that axis). ``partial`` sums over the ranks of the dim's axes
instead. ``zigzag`` (context parallel's load-balanced order): with ``C``
ranks the dim is cut into ``2C`` chunks and rank ``r`` holds chunks ``r`` and
``2C-1-r``.

This module is stdlib-only (capture checks specs with it).

Examples
--------
>>> spec = parse_dims("b s(cp,zigzag) h(tp)")
>>> spec.names, spec.index("h"), spec.sharded()
(('b', 's', 'h'), 2, [('s', 1, 'cp', 'cat', True), ('h', 2, 'tp', 'cat', False)])
>>> zigzag_chunks(rank=1, size=2)
(1, 2)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tdinspect.errors import DimsError

AXES = ("tp", "cp", "ep", "sp")
FLAGS = ("partial", "zigzag")
_TOKEN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:\(([^()]*)\))?\Z")


@dataclass(frozen=True)
class Dim:
    """One named dim and what is done to it across ranks."""

    name: str
    axes: tuple[str, ...] = ()
    partial: bool = False
    zigzag: bool = False


@dataclass(frozen=True)
class DimsSpec:
    """A parsed dims spec (see :func:`parse_dims`)."""

    text: str
    dims: tuple[Dim, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    def index(self, name: str) -> int:
        """Position of dim ``name``; a clear error when the spec has no such dim."""
        try:
            return self.names.index(name)
        except ValueError:
            names = ", ".join(self.names[:16]) + (", ..." if len(self.names) > 16 else "")
            raise DimsError(f"dims {self.text[:120]!r} has no dim {name[:80]!r} (dims: {names})") from None

    def sharded(self) -> list[tuple[str, int, str, str, bool]]:
        """``(dim name, dim index, axis, "cat" | "sum", zigzag)`` for each axis a dim names."""
        return [
            (d.name, i, axis, "sum" if d.partial else "cat", d.zigzag)
            for i, d in enumerate(self.dims)
            for axis in d.axes
        ]

    def __str__(self) -> str:
        return self.text


def parse_dims(text: str) -> DimsSpec:
    """Parse a dims spec such as ``"b s(cp,zigzag) h(tp)"``.

    Raises
    ------
    DimsError
        Naming the spec and the token at fault: an unknown modifier, a repeated
        dim name or axis, ``zigzag`` without ``cp``, ``partial`` without an axis.
    """
    if not isinstance(text, str) or not text.strip():
        raise DimsError(
            f"dims spec {str(text)[:80]!r}: expected space-separated dim names such as 'b s h(tp)'"
        )
    shown = text if len(text) <= 120 else text[:120] + "..."  # a sidecar's text: any length
    dims, used_axes, names = [], {}, set()
    for token in text.split():
        m = _TOKEN.match(token)
        if not m:
            raise DimsError(
                f"dims {shown!r}: cannot read {token[:80]!r} (a dim is a name with optional "
                "modifiers in parentheses, e.g. h(tp) or s(cp,zigzag))"
            )
        name, inner = m.group(1), m.group(2)
        mods = [x.strip() for x in inner.split(",")] if inner is not None else []
        if inner is not None and not all(mods):
            raise DimsError(f"dims {shown!r}: empty modifier in {token[:80]!r}")
        unknown = [x for x in mods if x not in AXES + FLAGS]
        if unknown:
            raise DimsError(
                f"dims {shown!r}: unknown modifier {unknown[0]!r} in {token[:80]!r} "
                f"(known: {', '.join(AXES + FLAGS)})"
            )
        if len(set(mods)) != len(mods):
            raise DimsError(f"dims {shown!r}: repeated modifier in {token[:80]!r}")
        if name in names:  # a set: a list made 8,000 dims take 1 s, 80,000 would take 100
            raise DimsError(f"dims {shown!r}: dim {name!r} appears twice")
        axes = tuple(x for x in mods if x in AXES)
        for axis in axes:
            if axis in used_axes:
                raise DimsError(f"dims {shown!r}: axis {axis!r} shards both {used_axes[axis]!r} and {name!r}")
            used_axes[axis] = name
        partial, zigzag = "partial" in mods, "zigzag" in mods
        if partial and not axes:
            raise DimsError(
                f"dims {shown!r}: {token[:80]!r} is partial over no axis (write e.g. {name}(tp,partial))"
            )
        if zigzag and axes != ("cp",):
            raise DimsError(f"dims {shown!r}: zigzag in {token[:80]!r} needs cp as the dim's only axis")
        if zigzag and partial:
            raise DimsError(f"dims {shown!r}: {token[:80]!r} cannot be both partial and zigzag")
        dims.append(Dim(name, axes, partial, zigzag))
        names.add(name)
    return DimsSpec(text, tuple(dims))


def zigzag_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of ``2 * size``) that context-parallel rank ``rank`` holds in zigzag order."""
    return rank, 2 * size - 1 - rank


class DimsRules:
    """``{regex: spec}`` rules resolved per entry name (first ``re.search`` match wins).

    Examples
    --------
    >>> rules = DimsRules({r"\\.q_proj$": "b s h(tp)"})
    >>> rules.lookup("model.layers.0.q_proj"), rules.lookup("model.norm")
    ('b s h(tp)', None)
    """

    def __init__(self, rules: dict[str, str] | None, *, what: str = "dims"):
        self.rules = []
        for pattern, spec in (rules or {}).items():
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise DimsError(f"{what}: invalid regex {pattern!r}: {exc}") from None
            try:
                parse_dims(spec)
            except DimsError as exc:
                raise DimsError(f"{what} rule {pattern!r}: {exc}") from None
            self.rules.append((compiled, spec))
        self._cache: dict[str, str | None] = {}

    def __bool__(self) -> bool:
        return bool(self.rules)

    def lookup(self, name: str) -> str | None:
        """The spec of the first rule whose regex ``re.search``-matches ``name``."""
        if name not in self._cache:
            self._cache[name] = next((s for p, s in self.rules if p.search(name)), None)
        return self._cache[name]
