"""Per-entry dims annotations: which tensor dim is sharded over which parallel axis.

A dims spec names a tensor's dims in order, separated by spaces; a dim may
carry modifiers in parentheses, separated by commas::

    "b s h(tp)"               h is split over tensor-parallel ranks (concatenate in tp order)
    "b s(cp,zigzag) h(tp) d"  s split over context parallel in zigzag order, h over tp
    "b s h(tp,partial)"       every tp rank holds a partial sum of the whole h (sum them)
    "b s h(tp,fused=q:32,k:16,v:16)"
                              h is q, k and v end to end, each split over tp on its own:
                              every rank holds [q_r | k_r | v_r]

Axes: ``tp``, ``cp``, ``ep``, ``sp``, ``dp`` (concatenate shards along this dim in the
rank order of that axis; ``b(dp)``: data-parallel ranks fed other samples). The copies of an
entry along an axis its dims do not name (``dp`` ranks fed the same batch, a ``tp`` it is
replicated over) must agree: unshard compares them. ``partial`` sums over the ranks of the dim's axes
instead. ``zigzag`` (context parallel's load-balanced order): with ``C``
ranks the dim is cut into ``2C`` chunks and rank ``r`` holds chunks ``r`` and
``2C-1-r``.

``fused=NAME:WIDTH,...`` says the dim is named segments end to end, each
sharded over the dim's one axis on its own (a fused ``qkv`` or ``gate_up``
under tensor parallelism): rank ``r`` of ``n`` holds segment by segment its
``1/n`` of each. The widths are the whole model's (``num_heads * head_dim``
from the model's config; the same spec for every tp size). With
``fused_per_rank=`` the widths are what each rank holds (the rank tensor's
own width split up).

This module is stdlib-only (capture checks specs with it).

Examples
--------
>>> spec = parse_dims("b s(cp,zigzag) h(tp)")
>>> spec.names, spec.index("h"), spec.sharded()
(('b', 's', 'h'), 2, [('s', 1, 'cp', 'cat', True), ('h', 2, 'tp', 'cat', False)])
>>> parse_dims("b s h(tp, fused=q:32,k:16,v:16)").dims[2].fused
(('q', 32), ('k', 16), ('v', 16))
>>> zigzag_chunks(rank=1, size=2)
(1, 2)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tdinspect.errors import DimsError

AXES = ("tp", "cp", "ep", "sp", "dp")
FLAGS = ("partial", "zigzag")
FUSED = ("fused", "fused_per_rank")  # full-model widths / each rank's widths
_TOKEN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:\(([^()]*)\))?\Z")
_DIM = re.compile(r"(?:[^\s(]|\([^()]*\)?)+")
SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*:\s*([0-9]{1,15})\Z")


@dataclass(frozen=True)
class Dim:
    """One named dim and what is done to it across ranks."""

    name: str
    axes: tuple[str, ...] = ()
    partial: bool = False
    zigzag: bool = False
    fused: tuple[tuple[str, int], ...] = ()
    per_rank: bool = False  # fused widths are each rank's (fused_per_rank=), not the model's

    def segments(self, size: int, width: int) -> list[tuple[str, int, int]]:
        """``(name, start, width)`` of each fused segment within one rank's ``width``
        along this dim at ``size`` ranks; raises :class:`DimsError` (the caller names the
        entry and spec) where the widths do not make up the rank's."""
        spelled = ",".join(f"{n}:{w}" for n, w in self.fused)
        if self.per_rank:
            if sum(w for _, w in self.fused) != width:
                raise DimsError(
                    f"fused_per_rank={spelled} adds up to {sum(w for _, w in self.fused)}, "
                    f"each rank holds {width} along {self.name!r}"
                )
            widths = [w for _, w in self.fused]
        else:
            if sum(w for _, w in self.fused) != width * size:
                raise DimsError(
                    f"fused={spelled} adds up to {sum(w for _, w in self.fused)}, the {size} "
                    f"rank(s) hold {width} each along {self.name!r} ({width * size} in all; "
                    "fused= takes the whole model's widths, fused_per_rank= each rank's)"
                )
            odd = [n for n, w in self.fused if w % size]
            if odd:
                raise DimsError(f"fused segment {odd[0]!r} does not split into {size} equal shards")
            widths = [w // size for _, w in self.fused]
        out, start = [], 0
        for (name, _), w in zip(self.fused, widths):
            out.append((name, start, w))
            start += w
        return out


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

    def fused(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """``{dim name: ((segment, width), ...)}`` of the fused dims."""
        return {d.name: d.fused for d in self.dims if d.fused}

    def __str__(self) -> str:
        return self.text


def _tokens(text: str) -> list[str]:
    """The dims of a spec: split at spaces outside parentheses (``h(tp, fused=...)`` is one).

    One regex pass (a sidecar's spec may be megabytes): a dim is characters other than
    space and ``(``, or a parenthesised group, which may hold spaces.
    """
    return _DIM.findall(text)


def _modifiers(inner: str, shown: str, token: str) -> tuple[list[str], tuple, bool]:
    """A dim's modifiers: plain ones, and ``fused=`` / ``fused_per_rank=`` segments
    (``name:width`` items, which continue the list after the ``=``)."""
    mods: list[str] = []
    segments: list[tuple[str, int]] = []
    per_rank, kind, in_segments = False, None, False
    for item in (x.strip() for x in inner.split(",")):
        if not item:
            raise DimsError(f"dims {shown!r}: empty modifier in {token!r}")
        head, eq, rest = item.partition("=")
        if eq:
            if head.strip() not in FUSED:
                raise DimsError(
                    f"dims {shown!r}: unknown modifier {head.strip()[:40]!r} in {token!r} "
                    f"(known with '=': {', '.join(FUSED)})"
                )
            if kind is not None:
                raise DimsError(f"dims {shown!r}: {token!r} is fused twice")
            kind, per_rank, in_segments, item = (
                head.strip(),
                head.strip() == "fused_per_rank",
                True,
                rest.strip(),
            )
        seg = SEGMENT.match(item)
        if in_segments and seg:
            segments.append((seg.group(1), int(seg.group(2))))
            continue
        if eq:
            raise DimsError(
                f"dims {shown!r}: cannot read segment {item[:40]!r} in {token!r} "
                f"(write {kind}=name:width,name:width, e.g. fused=q:32,k:16,v:16)"
            )
        in_segments = False
        mods.append(item)
    if kind is not None:
        names = [n for n, _ in segments]
        if len(segments) < 2:
            raise DimsError(
                f"dims {shown!r}: {kind}= in {token!r} names one segment (a fused dim has two or more)"
            )
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise DimsError(f"dims {shown!r}: segment {dup!r} appears twice in {token!r}")
        zero = [n for n, w in segments if w == 0]
        if zero:
            raise DimsError(f"dims {shown!r}: segment {zero[0]!r} in {token!r} has width 0")
    return mods, tuple(segments), per_rank


def parse_dims(text: str) -> DimsSpec:
    """Parse a dims spec such as ``"b s(cp,zigzag) h(tp)"``.

    Raises
    ------
    DimsError
        Naming the spec and the token at fault: an unknown modifier, a repeated
        dim name or axis, ``zigzag`` without ``cp``, ``partial`` without an axis,
        a ``fused=`` list that does not read as two or more ``name:width`` segments
        with distinct names on a dim with exactly one axis.
    """
    if not isinstance(text, str) or not text.strip():
        raise DimsError(
            f"dims spec {str(text)[:80]!r}: expected space-separated dim names such as 'b s h(tp)'"
        )
    shown = text if len(text) <= 120 else text[:120] + "..."  # a sidecar's text: any length
    dims, used_axes, names = [], {}, set()
    for token in _tokens(text):
        m = _TOKEN.match(token)
        if not m:
            raise DimsError(
                f"dims {shown!r}: cannot read {token[:80]!r} (a dim is a name with optional "
                "modifiers in parentheses, e.g. h(tp) or s(cp,zigzag))"
            )
        name, inner = m.group(1), m.group(2)
        mods, fused, per_rank = _modifiers(inner, shown, token[:80]) if inner is not None else ([], (), False)
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
        if fused and (len(axes) != 1 or partial or zigzag):
            raise DimsError(
                f"dims {shown!r}: fused {token[:80]!r} needs exactly one axis, neither partial nor "
                f"zigzag (write e.g. {name}(tp,fused=q:32,k:16,v:16))"
            )
        dims.append(Dim(name, axes, partial, zigzag, fused, per_rank))
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
