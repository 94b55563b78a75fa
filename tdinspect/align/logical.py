"""Logical passes: entries assembled from other passes' tensors by a plan of plain data.

:func:`tdinspect.align.unshard.unshard` and :func:`tdinspect.align.concat.concat`
each write, per logical entry, a small tree of dicts (readable, picklable,
printable in a notebook) that :func:`evaluate` applies when the tensor is
read. Nodes::

    {"op": "read", "src": S, "key": K}                 source pass S's entry K
    {"op": "cat", "dim": d, "parts": [...], "zigzag": bool, "labels": [...]}
        (a packed token dim's zigzag also has "seqlens": each sequence's rows per rank,
        cut sequence by sequence: :mod:`tdinspect.align.zigzag`)
        (unshard's also has "axis": the parallel axis its parts are the ranks of;
        a fused dim's "segments": [[name, start, width, rank offset,
        rank width], ...] and "ranks": [rank label, ...]; its parts are narrows)
    {"op": "sum", "parts": [...], "labels": [...]}     partial sums (in the parts' dtype)
    {"op": "same", "parts": [...], "labels": [...]}    replicated: all equal, first one taken
        (unshard's copies of an entry with dims along axes they do not shard also have
        "axes": those axes, and "ranks": the ranks of each copy)
    {"op": "narrow", "dim": d, "start": i, "length": n, "part": node}
    {"op": "flat", "end": d, "part": node}             dims 0..d flattened into one (token rows)
    {"op": "error", "reason": text}                    cannot be assembled: why

A :class:`LogicalPass` is a :class:`~tdinspect.store.passindex.PassIndex` whose
tensors come from such plans, so :class:`~tdinspect.compare.diff.Diff`, statistics
and the cube use it unchanged; memory stays at the parts of one entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from tdinspect.align.dims import AXES
from tdinspect.align.zigzag import order as zigzag_order
from tdinspect.errors import AlignError
from tdinspect.numerics.metrics import same_bits
from tdinspect.store.passindex import PassIndex


def read(src: Any, key: str) -> dict:
    return {"op": "read", "src": src, "key": key}


def error(reason: str) -> dict:
    return {"op": "error", "reason": reason}


def shape_of(node: dict, shape) -> list[int] | None:
    """The shape ``node`` produces; ``shape(src, key)`` gives a source entry's shape."""
    op = node["op"]
    if op == "read":
        s = shape(node["src"], node["key"])
        return None if s is None else list(s)
    if op == "error":
        return None
    if op == "narrow":
        s = shape_of(node["part"], shape)
        if s is not None:
            s[node["dim"]] = node["length"]
        return s
    if op == "flat":
        s = shape_of(node["part"], shape)
        return None if s is None else [math.prod(s[: node["end"] + 1])] + s[node["end"] + 1 :]
    shapes = [shape_of(p, shape) for p in node["parts"]]
    if any(s is None for s in shapes):
        return None
    if op == "cat":
        out = list(shapes[0])
        out[node["dim"]] = sum(s[node["dim"]] for s in shapes)
        return out
    return list(shapes[0])


def evaluate(node: dict, fetch, out=None) -> torch.Tensor:
    """Apply a plan; ``fetch(src, key)`` reads a source tensor. Raises :class:`AlignError`.

    ``out(shape, dtype)``, when given, supplies the buffer of the top-level
    ``cat`` or ``sum`` (a reused one spares the page faults of a fresh
    allocation, which cost more than the copy itself).
    """
    op = node["op"]
    if op == "read":
        return fetch(node["src"], node["key"])
    if op == "error":
        raise AlignError(node["reason"])
    if op == "narrow":
        return evaluate(node["part"], fetch).narrow(node["dim"], node["start"], node["length"])
    if op == "flat":
        return evaluate(node["part"], fetch).flatten(0, node["end"])
    if op == "cat":
        dim = node["dim"]
        parts = [t for _, t in pieces(node, fetch)[1]]
        if out is None:
            return torch.cat(parts, dim)
        shape = list(parts[0].shape)
        shape[dim] = sum(t.shape[dim] for t in parts)
        return torch.cat(parts, dim, out=out(shape, parts[0].dtype))
    parts = [evaluate(p, fetch) for p in node["parts"]]
    if op == "sum":  # one pass per part, into the (reused) buffer: never a copy first
        first = parts[0]
        if len(parts) == 1:
            return first
        total = (
            torch.empty_like(first, memory_format=torch.contiguous_format)
            if out is None
            else out(first.shape, first.dtype)
        )
        torch.add(first, parts[1], out=total)
        for t in parts[2:]:
            total += t
        return total
    if op == "same":  # bitwise: NaN meets the same NaN, -0.0 differs from 0.0
        first = parts[0]
        for i, (label, t) in enumerate(zip(node["labels"][1:], parts[1:]), 1):
            if not same_bits(first, t):
                delta = (
                    (first.double() - t.double()).abs().max().item() if first.shape == t.shape else math.nan
                )
                raise AlignError(_not_replicated(node, i, label, delta))
        return first
    raise AlignError(f"unknown plan step {op!r}")


def _not_replicated(node: dict, i: int, label: str, delta: float) -> str:
    """Why copy ``i`` of a ``same`` node is no copy of the first: an entry without dims, or
    one whose dims do not shard an axis its copies lie along (``"axes"``: ``dp rank 1``)."""
    first = node["labels"][0]
    if not node.get("axes"):
        return (
            f"no dims and not replicated: {first} and {label} differ (max |Δ| {delta:.3g}); "
            "give the entry dims, e.g. dims={regex: 'b s h(tp)'}"
        )
    ranks = node.get("ranks") or [[]] * len(node["labels"])
    axes = " and ".join(node["axes"])
    named = [a for a in node["axes"] if a in AXES]
    example = "b(dp) s h" if "dp" in named else f"b s h({named[0]})" if named else ""
    hint = f"; if they hold other data, name the axis in its dims, e.g. {example!r}" if named else ""
    return (
        f"replicas differ: {label} differs from {first} (ranks {ranks[i]} against {ranks[0]}, "
        f"max |Δ| {delta:.3g}): its dims do not shard {axes}, so its copies along it agree{hint}"
    )


def pieces(node: dict, fetch) -> tuple[int, list[tuple[int, torch.Tensor]]]:
    """A ``cat`` plan as ``(dim, [(start, part), ...])``, its parts in the logical order
    along ``dim`` and not copied together (nested ``cat`` along the same dim flattened).

    The parts' metrics combine into the whole's
    (:func:`tdinspect.numerics.metrics_split.compare_pieces`) without the copy that assembling costs.
    """
    dim = node["dim"]
    parts: list[torch.Tensor] = []
    for p in node["parts"]:
        if p["op"] == "cat" and p["dim"] == dim and not (p.get("zigzag") or node.get("zigzag")):
            parts.extend(t for _, t in pieces(p, fetch)[1])
        else:
            parts.append(evaluate(p, fetch))
    if node.get("seqlens"):  # packed: chunks r and 2C-1-r of every sequence
        parts = [parts[r].narrow(dim, start, n) for r, start, n in zigzag_order(node["seqlens"], len(parts))]
    elif node.get("zigzag"):  # rank r holds chunks r and 2C-1-r: put the halves in place
        halves = [h for t in parts for h in t.chunk(2, dim)]
        c = len(parts)
        order = [None] * (2 * c)
        for r in range(c):
            order[r], order[2 * c - 1 - r] = halves[2 * r], halves[2 * r + 1]
        parts = order
    out, start = [], 0
    for t in parts:
        out.append((start, t))
        start += t.shape[dim]
    return dim, out


def matching_slices(
    a: tuple[int, list[tuple[int, torch.Tensor]]], b: tuple[int, list[tuple[int, torch.Tensor]]]
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Views of two sides' pieces cut at every boundary of either side, pair by pair.

    ``a`` and ``b`` as :func:`pieces` gives them (a whole tensor is ``(dim, [(0, t)])``);
    ``None`` when they are cut along different dims or do not cover one length.
    """
    (da, pa), (db, pb) = a, b
    ndim = pa[0][1].dim()
    if ndim == 0 or da % ndim != db % ndim:
        return None
    dim = da % ndim
    length = pa[-1][0] + pa[-1][1].shape[dim]
    if length != pb[-1][0] + pb[-1][1].shape[dim]:
        return None
    if [s for s, _ in pa] == [s for s, _ in pb]:  # cut alike (the same calls or ranks): as they are
        return [(ta, tb) for (_, ta), (_, tb) in zip(pa, pb)]
    out = []
    for start, n, (sa, ta), (sb, tb) in common_cuts(pa, pb, length):
        out.append((ta.narrow(dim, start - sa, n), tb.narrow(dim, start - sb, n)))
    return out


def common_cuts(pa: list[tuple[int, Any]], pb: list[tuple[int, Any]], length: int):
    """``(start, length, a's piece, b's piece)`` for each stretch between consecutive
    boundaries of either side's pieces (``[(start, piece)]``, end to end from 0 to ``length``).

    Examples
    --------
    >>> [(s, n, a[1], b[1]) for s, n, a, b in common_cuts([(0, "a0"), (2, "a1")], [(0, "b0")], 5)]
    [(0, 2, 'a0', 'b0'), (2, 3, 'a1', 'b0')]
    """
    cuts = sorted({s for s, _ in pa} | {s for s, _ in pb} | {length})
    i = j = 0
    for start, stop in zip(cuts, cuts[1:]):
        while i + 1 < len(pa) and pa[i + 1][0] <= start:
            i += 1
        while j + 1 < len(pb) and pb[j + 1][0] <= start:
            j += 1
        yield start, stop - start, pa[i], pb[j]


def primary(node: dict) -> dict:
    """The copy a replicated plan (``same``) is read from, its first; any other plan itself."""
    while node["op"] == "same":
        node = node["parts"][0]
    return node


def slices_of(node: dict, shape) -> list[tuple[str, list[tuple[int, int]], int]]:
    """``(label, [(start, length), ...], dim)`` of each part of a top-level ``cat``.

    Lets a divergence be traced to the shard (rank) whose slice differs; replicas
    (``same``) are read through their first copy, the one compared.
    """
    node = primary(node)
    if node["op"] != "cat":
        return []
    dim, out, start = node["dim"], [], 0
    sizes = [shape_of(p, shape)[dim] for p in node["parts"]]
    if node.get("seqlens"):
        spans: list[list[tuple[int, int]]] = [[] for _ in sizes]
        for r, _, n in zigzag_order(node["seqlens"], len(sizes)):
            spans[r].append((start, n))
            start += n
        return [(label, s, dim) for label, s in zip(node["labels"], spans)]
    if node.get("zigzag"):
        c, total = len(sizes), sum(sizes)
        chunk = total // (2 * c)
        return [
            (label, [(r * chunk, chunk), ((2 * c - 1 - r) * chunk, chunk)], dim)
            for r, label in enumerate(node["labels"])
        ]
    for label, size in zip(node["labels"], sizes):
        out.append((label, [(start, size)], dim))
        start += size
    return out


def describe(node: dict) -> str:
    """A one-line reading of a plan, e.g. ``cat(dim 2: rank 0 (tp 0 of 2), rank 1 (tp 1 of 2))``.

    Examples
    --------
    >>> describe({"op": "sum", "labels": ["rank 0", "rank 1"],
    ...           "parts": [read(0, "o"), read(1, "o")]})
    'sum(rank 0, rank 1)'
    """
    op = node["op"]
    if op == "read":
        return f"{node['key']} of {node['src']}"
    if op == "error":
        return f"cannot: {node['reason']}"
    if op == "narrow":
        return (
            f"narrow(dim {node['dim']}, {node['start']}..{node['start'] + node['length']}: "
            f"{describe(node['part'])})"
        )
    if op == "cat" and node.get("segments"):
        return _describe_fused(node)
    if op == "flat":
        return f"flat(dims 0..{node['end']}: {describe(node['part'])})"
    parts = [
        label if part["op"] == "read" else f"{label} [{describe(part)}]"
        for label, part in zip(node["labels"], node["parts"])
    ]
    zz = ", zigzag per sequence" if node.get("seqlens") else ", zigzag" if node.get("zigzag") else ""
    head = f"dim {node['dim']}{zz}: " if op == "cat" else ""
    return f"{op}({head}{', '.join(parts)})"


def _describe_fused(node: dict) -> str:
    """``fused(dim 2: q 0..32 = rank 0 (tp 0 of 2) 0..16 + rank 1 (tp 1 of 2) 0..16; k ...)``."""
    ranks = node["ranks"]
    inner = [p["part"] for p in node["parts"][: len(ranks)]]
    who = [
        label if part["op"] == "read" else f"{label} [{describe(part)}]" for label, part in zip(ranks, inner)
    ]
    segs = [
        f"{name} {start}..{start + width} = " + " + ".join(f"{r} {off}..{off + w}" for r in who)
        for name, start, width, off, w in node["segments"]
    ]
    return f"fused(dim {node['dim']}: {'; '.join(segs)})"


class _Loaded:
    """What :meth:`LogicalPass.load` returns: source passes opened on first use, entries on demand.

    With ``scratch``, assembled tensors are written into buffers reused by
    shape and dtype: a tensor read through it is valid until the next one of
    the same shape (what a diff, which compares one entry at a time, needs).
    """

    def __init__(self, owner: LogicalPass, scratch: bool = False):
        self.owner = owner
        self.scratch = scratch
        self._open: dict[Any, Any] = owner.opened_sources()
        self._buffers: dict[tuple, torch.Tensor] | None = {} if scratch else None

    def buffer(self, shape, dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(key[0], dtype=dtype)
        return buf

    def fetch(self, src, key) -> torch.Tensor:
        pi = self.owner.sources[src]
        opened = self._open.get(src)
        if opened is None:
            opened = self._open[src] = pi.load()
        return pi.tensor(key, opened)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.owner.tensor(key, self)

    def keys(self):
        return self.owner.plans.keys()


@dataclass
class LogicalPass(PassIndex):
    """A pass whose entries are plans over ``sources`` (a dict of :class:`PassIndex`)."""

    sources: dict[Any, PassIndex] = field(default_factory=dict)
    plans: dict[str, dict] = field(default_factory=dict)
    what: str = ""

    @classmethod
    def build(
        cls,
        rank: int,
        index: int,
        sources: dict[Any, PassIndex],
        plans: dict[str, dict],
        first: dict[str, tuple[Any, int]],
        *,
        dims: dict[str, str | None] | None = None,
        what: str = "",
        shapes: dict[str, list[int] | None] | None = None,
    ) -> LogicalPass:
        """A logical pass with entries ``plans`` (in order); ``first[key] = (src, i)``
        is a source entry whose metadata (dtype, module type) the logical entry takes;
        ``shapes``, where the caller knows them, the entries' shapes (else worked out from
        the plans)."""
        keys = list(plans)

        def shape(src, key):
            pi = sources[src]
            return pi.shape[pi.position[key]]

        def meta(attr, key):
            src, i = first[key]
            return getattr(sources[src], attr)[i]

        n = len(keys)
        some = next(iter(sources.values()))
        return cls(
            rank,
            index,
            some.files,
            keys,
            [shape_of(plans[k], shape) for k in keys] if shapes is None else [shapes[k] for k in keys],
            [meta("dtype", k) for k in keys],
            [meta("module_type", k) for k in keys],
            [True] * n,
            None,
            [False] * n,
            [None] * n,
            [None] * n,
            [meta("aten", k) for k in keys],
            some.level,
            False,
            False,
            parallel={},
            dims=[(dims or {}).get(k) for k in keys],
            sources=sources,
            plans=plans,
            what=what,
        )

    def opened_sources(self) -> dict:
        """Where a :meth:`load` keeps its opened sources: a fresh dict (a subclass may share one
        between logical passes that read the same sources)."""
        return {}

    def load(self, scratch: bool = False) -> _Loaded:
        """Open the sources lazily; ``scratch``: reuse output buffers (see :class:`_Loaded`)."""
        return _Loaded(self, scratch)

    def tensor(self, key: str, loaded=None) -> torch.Tensor:
        if key not in self.plans:
            raise KeyError(f"{self.path}: no entry {key!r} ({self.what})")
        if not isinstance(loaded, _Loaded):
            loaded = self.load()
        return evaluate(self.plans[key], loaded.fetch, loaded.buffer if loaded._buffers is not None else None)

    def pieces(self, key: str, loaded=None) -> tuple[int, list[tuple[int, torch.Tensor]]] | None:
        """Entry ``key`` as :func:`pieces` when it is a concatenation, else ``None``."""
        node = self.plans.get(key)
        if node is None or node["op"] != "cat":
            return None
        if not isinstance(loaded, _Loaded):
            loaded = self.load()
        return pieces(node, loaded.fetch)

    def fused_layout(self, key: str) -> tuple | None:
        """A fused entry's layout (dim, segments, ranks): two sides fused alike compare
        shard by shard (:meth:`rank_pieces`); ``None`` for any other entry."""
        node = self.plans.get(key)
        if node is None or node["op"] != "cat" or not node.get("segments"):
            return None
        return node["dim"], tuple(map(tuple, node["segments"])), len(node["ranks"])

    def rank_pieces(self, key: str, loaded=None) -> tuple[int, list[tuple[int, torch.Tensor]]]:
        """A fused entry's shards whole, rank after rank (as :func:`pieces` gives parts, but
        not in the logical order): where both sides are fused alike (:meth:`fused_layout`)
        each element meets its partner at the same place, and the shards are contiguous."""
        node = self.plans[key]
        if not isinstance(loaded, _Loaded):
            loaded = self.load()
        dim, out, start = node["dim"], [], 0
        for part in node["parts"][: len(node["ranks"])]:
            t = evaluate(part["part"], loaded.fetch)
            out.append((start, t))
            start += t.shape[dim]
        return dim, out

    def problem(self, i: int) -> str:
        """Why entry ``i`` cannot be assembled (known before reading), or ``""``."""
        node = self.plans[self.keys[i]]
        return node["reason"] if node["op"] == "error" else ""

    def source_shape(self, src, key):
        pi = self.sources[src]
        return pi.shape[pi.position[key]]

    def _stats_tensor(self, i: int, loaded) -> torch.Tensor | None:
        """The assembled tensor, or ``None`` (NaN statistics) when it cannot be assembled."""
        try:
            return self.tensor(self.keys[i], loaded)
        except AlignError:
            return None
