"""Tokens: two runs lined up by (request, position), whatever their packing, padding or passes.

An engine packs the tokens of many requests into ``[total_tokens, ...]`` and batches
them differently at every step (a prefill beside others' decode steps); a reference runs
padded ``[batch, seq, ...]`` or one request at a time. Each pass's
:class:`~tdinspect.store.tokenlayout.TokenLayout` (``dump.step(tokens=...)``) says which
request and position each of its token rows holds. :func:`plan_tokens` maps every
``(request, position)`` to ``(pass, row)`` on each side (:class:`TokenPlan`: plain data,
printable before any tensor is read); :func:`request_passes` turns one side into a
logical pass per request (the pass number is the request id) whose entries are that
request's rows gathered in position order, ``[positions, ...]``: pads are never read,
and the two sides compare entry by entry with the diff's metrics.

Entries whose leading dims are not the pass's token rows (weights, logits of the last
position only) cannot be gathered: they become structural entries with that reason,
set aside and listed, never dropped. Tokens one side computed and the other did not are
listed in :attr:`TokenPlan.one_sided`.

Examples
--------
>>> d = DumpSet.open("dumps/hf").diff("dumps/engine", tokens=True)   # doctest: +SKIP
>>> print(d.tokens)                                                  # doctest: +SKIP
request 0: positions 0..4 (5): A pass 0 rows 0..4 | B pass 0 rows 0..2, pass 1 row 0, pass 2 row 0
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tdinspect.align.logical import LogicalPass, error, read
from tdinspect.errors import AlignError
from tdinspect.store.passindex import PassIndex
from tdinspect.store.rawpass import mapping_files
from tdinspect.store.rawspans import element_starts
from tdinspect.util.gcpause import paused


@dataclass(frozen=True)
class Run:
    """Consecutive positions of one request in consecutive rows of one pass."""

    pass_: int
    row: int
    position: int
    length: int

    def __str__(self) -> str:
        rows = f"row {self.row}" if self.length == 1 else f"rows {self.row}..{self.row + self.length - 1}"
        return f"pass {self.pass_} {rows}"


@dataclass
class RequestPlan:
    """Where one request's tokens are on each side; ``positions``: those both hold (compared)."""

    request: int
    positions: list[int]
    a: list[Run]
    b: list[Run]
    only_a: list[int] = field(default_factory=list)
    only_b: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"request {self.request}: positions {spans(self.positions) or 'none'} ({len(self.positions)})"
        text = f"{head}: A {', '.join(map(str, self.a)) or '-'} | B {', '.join(map(str, self.b)) or '-'}"
        for side, only in (("A", self.only_a), ("B", self.only_b)):
            if only:
                text += f"; positions {spans(only)} in {side} only"
        return text


@dataclass
class TokenPlan:
    """Every request's tokens on both sides: :attr:`requests` ``{request: RequestPlan}``."""

    requests: dict[int, RequestPlan]

    @property
    def one_sided(self) -> list[str]:
        """Tokens only one side computed, one line per request (never compared)."""
        out = []
        for rp in self.requests.values():
            for side, only in (("A", rp.only_a), ("B", rp.only_b)):
                if only:
                    out.append(f"request {rp.request} positions {spans(only)} in {side} only")
        return out

    def rows(self) -> list[dict]:
        """One dict per compared token: ``request``, ``position``, ``a_pass``, ``a_row``, ``b_pass``, ``b_row``."""
        out = []
        for rp in self.requests.values():
            a = [(r.pass_, r.row + k) for r in rp.a for k in range(r.length)]
            b = [(r.pass_, r.row + k) for r in rp.b for k in range(r.length)]
            for pos, (pa, ra), (pb, rb) in zip(rp.positions, a, b):
                out.append(
                    {
                        "request": rp.request,
                        "position": pos,
                        "a_pass": pa,
                        "a_row": ra,
                        "b_pass": pb,
                        "b_row": rb,
                    }
                )
        return out

    def __str__(self) -> str:
        return "\n".join(map(str, self.requests.values()))

    def __repr__(self) -> str:
        n = sum(len(rp.positions) for rp in self.requests.values())
        text = f"TokenPlan({len(self.requests)} requests, {n} tokens compared"
        return text + (f"; {'; '.join(self.one_sided)}" if self.one_sided else "") + ")"


# the reason of an entry whose leading dims are not the pass's token rows (it cannot be lined up)
NOT_TOKEN_MAJOR = "not token-major"


def spans(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][1] + 1 == v:
            out[-1][1] = v
        else:
            out.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in out)


def token_map(passes: dict[tuple[int, int], PassIndex], where) -> dict[int, list[tuple[int, int, int, int]]]:
    """``{request: [(first position, length, pass, first row), ...]}`` of one side, sorted by
    position (runs of the layouts, never token by token); :class:`AlignError` saying what is
    missing, or naming a token computed twice."""
    ranks = sorted({r for r, _ in passes})
    if len(ranks) > 1:
        raise AlignError(
            f"{where}: tokens=True lines up one rank, this dump has ranks {ranks}: add unshard=True "
            "(ranks reassembled first), or select one rank"
        )
    out: dict[int, list[tuple[int, int, int, int]]] = {}
    for (_, p), pi in sorted(passes.items(), key=lambda kv: kv[0][1]):
        if pi.tokens is None:
            raise AlignError(
                f"{where}: pass {p} has no token layout: record it with "
                "dump.step(tokens=tdinspect.tokens(...)) (request ids, positions, cu_seqlens or an attention mask)"
            )
        held = held_bytes(pi)
        if held is not None and pi.tokens.rows > held:  # before a position is listed
            raise AlignError(
                f"{where}: pass {p} ({pi.path}): its token layout claims {pi.tokens.rows} token rows, but "
                f"its pass file holds {held} bytes (a stored token row takes one at least): a damaged "
                "or forged layout"
            )
        for row, request, position, length in pi.tokens.runs():
            if request is not None:
                out.setdefault(request, []).append((position, length, p, row))
    for request, found in out.items():
        found.sort()
        for (p0, n0, pass0, row0), (p1, _, pass1, row1) in zip(found, found[1:]):
            if p0 + n0 > p1:
                raise AlignError(
                    f"{where}: request {request} position {p1} is in pass {pass0} row "
                    f"{row0 + p1 - p0} and pass {pass1} row {row1}: a token computed twice"
                )
    return out


def held_bytes(pi: PassIndex) -> int | None:
    """The bytes of the pass files that hold ``pi``'s tensors (a logical pass: its sources'),
    which bound the token rows it can hold; ``None`` where they are not files."""
    if isinstance(pi, LogicalPass):
        sizes = [held_bytes(src) for src in pi.sources.values()]
        return None if None in sizes else sum(sizes)
    path = pi.files.tensors
    try:
        return None if path is None else os.path.getsize(path)
    except OSError:
        return None


def _add(runs: list[Run], p: int, row: int, position: int, length: int) -> None:
    """Append a run, joined to the last where it goes on in the same pass's next rows."""
    last = runs[-1] if runs else None
    if last and last.pass_ == p and last.row + last.length == row and last.position + last.length == position:
        runs[-1] = Run(p, last.row, last.position, last.length + length)
    else:
        runs.append(Run(p, row, position, length))


def _request_plan(request: int, a: list[tuple], b: list[tuple]) -> RequestPlan:
    """Both sides' runs of one request (each sorted by position) cut where either side's
    change: the positions both hold, and where each side holds them."""
    positions: list[int] = []
    runs_a: list[Run] = []
    runs_b: list[Run] = []
    i = j = 0
    while i < len(a) and j < len(b):
        (pa, na, sa, ra), (pb, nb, sb, rb) = a[i], b[j]
        lo, hi = max(pa, pb), min(pa + na, pb + nb)
        if lo < hi:
            positions.extend(range(lo, hi))
            _add(runs_a, sa, ra + lo - pa, lo, hi - lo)
            _add(runs_b, sb, rb + lo - pb, lo, hi - lo)
        if pa + na <= pb + nb:
            i += 1
        else:
            j += 1
    only = [[], []]
    for k, side in enumerate((a, b)):
        if sum(n for _, n, _, _ in side) != len(positions):
            common = set(positions)
            only[k] = [q for p, n, _, _ in side for q in range(p, p + n) if q not in common]
    return RequestPlan(request, positions, runs_a, runs_b, only[0], only[1])


def plan_tokens(passes_a, passes_b, where_a="A", where_b="B") -> TokenPlan:
    """Map each ``(request, position)`` to ``(pass, row)`` on both sides, from the token layouts alone.

    Parameters
    ----------
    passes_a, passes_b : dict
        ``{(rank, pass): PassIndex}`` of each side (:attr:`tdinspect.DumpSet.pass_map`), one rank each.
    where_a, where_b : str or Path
        The dumps, named in errors.

    Raises
    ------
    AlignError
        A pass without a token layout, several ranks, a token computed twice on one side.

    Examples
    --------
    >>> plan = plan_tokens(hf.pass_map, engine.pass_map)   # doctest: +SKIP
    >>> plan.requests[1].b                                 # doctest: +SKIP
    [Run(pass_=0, row=3, position=0, length=6), Run(pass_=1, row=1, position=6, length=1), ...]
    """
    ma, mb = token_map(passes_a, where_a), token_map(passes_b, where_b)
    return TokenPlan({r: _request_plan(r, ma.get(r, []), mb.get(r, [])) for r in sorted(set(ma) | set(mb))})


# a part of a concatenation this large is compared where it lies (a view of its pass file, its
# metrics combined with the others'); the smaller parts between are copied together into one
# buffer and compared at once: a decode step's row is a few KB, and a metric call per row cost
# 2.5x the plain diff of the same bytes (bench/tokens.py --decode 16), while copying a prefill's
# rows (most of the bytes) cost 1.8x
PIECE_BYTES = 1 << 18


class OpenedPasses(dict):
    """Source passes opened by the request passes of one side, shared between them: a pass that
    holds the tokens of many requests is opened once, not once per request (pass files are
    memory-mapped: their pages are the page cache's). The first ``limit`` opened stay open;
    later ones are opened per request. (Not least recently used: the requests of a decode run
    read its passes in the same cycle, which an LRU smaller than the cycle misses every time:
    8.2x the plain diff with 16 kept of 19.)"""

    def __init__(self, limit: int | None = None):
        super().__init__()
        # a mapped pass holds a file descriptor (1,024 is a common limit), one read into memory
        # (TDINSPECT_MMAP=0) its bytes
        self.limit = limit if limit is not None else (512 if mapping_files() else 4)
        self.views: dict[Any, dict[str, tuple]] = {}  # src -> {key: (dtype, bytes)}
        self.files: dict[Any, tuple | None] = {}  # src -> located()
        self.locating: dict[Any, threading.Lock] = {}

    def __setitem__(self, key, value) -> None:
        if len(self) < self.limit:
            super().__setitem__(key, value)

    def raw(self, src, key: str, fetch, keep: bool = True, source=None) -> tuple[torch.dtype, Any]:
        """Entry ``key`` of source ``src`` as ``(dtype, its bytes as a numpy view)``; with ``keep``
        (a view of a pass file, not a tensor assembled in memory), kept for every request whose
        tokens it holds while its pass stays open. ``source`` (its :class:`PassIndex`): a stored
        entry is read straight from the mapped file (:func:`located`), its pass never loaded."""
        per = self.views.get(src)
        hit = None if per is None else per.get(key)
        if hit is None:
            hit = self._from_file(src, key, source) if keep and source is not None else None
            if hit is None:
                t = fetch(src, key)
                keep = keep and t.is_contiguous()  # else a copy: not kept
                t = t if t.is_contiguous() else t.contiguous()
                hit = (t.dtype, t.view(-1).view(torch.uint8).numpy())
            if keep and (src in self or src in self.files):
                self.views.setdefault(src, {})[key] = hit
        return hit

    def mapped(self, src, key: str, source) -> tuple[torch.dtype, Any] | None:
        """Entry ``key`` of source ``src`` as :meth:`raw` gives it, where it is read straight
        from its mapped pass file (``source``: its :class:`PassIndex`); else ``None``, never a
        load."""
        per = self.views.get(src)
        hit = None if per is None else per.get(key)
        if hit is None and not isinstance(source, LogicalPass):
            hit = self._from_file(src, key, source)
            if hit is not None and (src in self or src in self.files):
                self.views.setdefault(src, {})[key] = hit
        return hit

    def _from_file(self, src, key: str, source) -> tuple[torch.dtype, Any] | None:
        found = self.files.get(src, self)
        if found is self:
            # one thread locates a pass's records; the others, which need the same decode
            # passes at the same time, wait for it rather than do it again
            with self.locating.setdefault(src, threading.Lock()):
                found = self.files.get(src, self)
                if found is self:
                    found = located(source)
                    if len(self.files) < self.limit:
                        self.files[src] = found
        where = None if found is None else found[1].get(key)
        if where is None:
            return None
        first, nbytes, dtype = where
        return dtype, found[0][first : first + nbytes]


def located(pi: PassIndex) -> tuple[Any, dict[str, tuple[int, int, torch.dtype]]] | None:
    """``(the pass file's bytes, {key: (first byte, bytes, dtype)})`` of its plain stored
    contiguous entries (:func:`tdinspect.store.rawspans.element_starts`: the checks of a load),
    or ``None`` (read its tensors instead)."""
    if isinstance(pi, LogicalPass) or pi.raw is None or pi.files.tensors is None or pi.stats_only:
        return None
    rows = [
        i
        for i, stored in enumerate(pi.stored)
        if stored and not pi.uninitialized[i] and not (pi.storage and pi.storage[i] is not None)
    ]
    found = element_starts(pi.files.tensors, [pi.keys[i] for i in rows], [pi.raw[i] for i in rows])
    if found is None or not found.data.flags.writeable:
        return None
    out = {}
    for i, where in zip(rows, found.starts):
        dtype = None if where is None else getattr(torch, str(where[2]).removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            out[pi.keys[i]] = (where[0], where[1] * dtype.itemsize, dtype)
    return found.data, out


@dataclass(eq=False)
class RequestPass(LogicalPass):
    """One request's tokens of one side: a :class:`LogicalPass` whose sources are opened once for
    every request (:class:`OpenedPasses`), and whose concatenations of small parts are assembled."""

    shared: Any = field(default=None, repr=False)
    spans: dict = field(default_factory=dict, repr=False)  # key -> byte_spans()

    def opened_sources(self) -> dict:
        return self.shared if self.shared is not None else {}

    def tensor(self, key: str, loaded=None) -> torch.Tensor:
        """The entry; a concatenation is assembled by plain byte copies (one thread each: torch's
        copies wake its thread pool per part, 20x slower on a busy machine for a decode row)."""
        found = self.byte_spans(key)
        if found is None:
            return super().tensor(key, loaded)
        if not hasattr(loaded, "fetch"):
            loaded = self.load()
        shared = self.shared if self.shared is not None else OpenedPasses()
        shape, dtype, spans = found
        out = loaded.buffer(shape, dtype) if loaded.scratch else torch.empty(shape, dtype=dtype)
        dst = out.view(-1).view(torch.uint8).numpy()
        at = 0
        for src, k, b0, b1, nbytes in spans:
            got, data = shared.raw(
                src, k, loaded.fetch, not isinstance(self.sources[src], LogicalPass), self.sources[src]
            )
            if got != dtype or data.size != nbytes:  # not as the sidecar says: the general road
                return super().tensor(key, loaded)
            dst[at : at + b1 - b0] = data[b0:b1]
            at += b1 - b0
        return out

    def byte_spans(self, key: str) -> tuple[list[int], torch.dtype, list[tuple]] | None:
        """The entry's token rows as ``(shape, dtype, [(src, key, first byte, end byte, source
        bytes)])`` from the sidecars (worked out once an entry): the rows of a run read from
        one source entry, or a concatenation of such runs; ``None`` for anything else."""
        hit = self.spans.get(key)
        if hit is None:
            node = self.plans.get(key)
            i = self.position.get(key)
            dtype = None if i is None else getattr(torch, str(self.dtype[i]).removeprefix("torch."), None)
            if (
                node is None
                or node["op"] not in ("cat", "narrow", "flat", "read")
                or not isinstance(dtype, torch.dtype)
            ):
                return None
            spans = []
            for part in node["parts"] if node["op"] == "cat" else [node]:
                start = length = None
                if part["op"] == "narrow":
                    if part["dim"] != 0:
                        return None
                    start, length, part = part["start"], part["length"], part["part"]
                end = 0
                if part["op"] == "flat":
                    end, part = part["end"], part["part"]
                if part["op"] != "read":
                    return None
                shape = self.source_shape(part["src"], part["key"])
                row = math.prod(shape[end + 1 :]) * dtype.itemsize
                b0 = (start or 0) * row
                b1 = b0 + (math.prod(shape[: end + 1]) if start is None else length) * row
                spans.append((part["src"], part["key"], b0, b1, math.prod(shape) * dtype.itemsize))
            hit = self.spans[key] = (list(self.shape[i]), dtype, spans)
        return hit

    def byte_pieces(self, key: str) -> tuple[torch.dtype, list[tuple[int, Any]]] | None:
        """The entry's bytes as ``(dtype, [(first byte, uint8 array)])`` in row order: its spans
        of at least :data:`PIECE_BYTES` as views of their mapped pass files, each run of smaller
        spans copied into one array (a single one: a view). ``None`` where a source is not a
        mapped pass file, or not as its sidecar says (:meth:`pieces` reads those)."""
        found = self.byte_spans(key)
        if found is None or self.shared is None:
            return None
        _, dtype, spans = found
        mapped, sources = self.shared.mapped, self.sources
        out, small, small_at, at = [], [], 0, 0
        for src, k, b0, b1, nbytes in spans:  # a decode run's thousands of rows: kept lean
            hit = mapped(src, k, sources[src])
            if hit is None or hit[0] != dtype or hit[1].size != nbytes:
                return None
            if b1 - b0 >= PIECE_BYTES:
                if small:
                    out.append((small_at, small[0] if len(small) == 1 else np.concatenate(small)))
                    small = []
                out.append((at, hit[1][b0:b1]))
            else:
                if not small:
                    small_at = at
                small.append(hit[1][b0:b1])
            at += b1 - b0
        if small:
            out.append((small_at, small[0] if len(small) == 1 else np.concatenate(small)))
        return dtype, out

    def pieces(self, key: str, loaded=None):
        """A concatenation as :func:`~tdinspect.align.logical.pieces` gives it: its parts of at
        least :data:`PIECE_BYTES` as views of their pass files, each run of smaller parts between
        them copied into one buffer (the entry's reused one, at their place: never two pieces in
        one memory); ``None`` (compared assembled) where every part is small."""
        found = self.byte_spans(key)
        if found is None:
            return self._general_pieces(key, loaded)
        shape, dtype, spans = found
        row = math.prod(shape[1:]) * dtype.itemsize
        if not row or all(b1 - b0 < PIECE_BYTES for _, _, b0, b1, _ in spans):
            return None
        if not hasattr(loaded, "fetch"):
            loaded = self.load()
        shared = self.shared if self.shared is not None else OpenedPasses()
        out = dst = None
        found, at, small = [], 0, None  # small: where the run of small parts being copied began
        raw, views, sources, fetch = shared.raw, shared.views, self.sources, loaded.fetch
        for src, k, b0, b1, nbytes in spans:  # a decode run's thousands of rows: kept lean
            per = views.get(src)
            hit = None if per is None else per.get(k)
            if hit is None:
                pi = sources[src]
                hit = raw(src, k, fetch, not isinstance(pi, LogicalPass), pi)
            got, data = hit
            if got != dtype or data.size != nbytes:  # not as the sidecar says: the general road
                return self._general_pieces(key, loaded)
            if b1 - b0 >= PIECE_BYTES:
                if small is not None:
                    found.append((small // row, out.narrow(0, small // row, (at - small) // row)))
                    small = None
                part = torch.from_numpy(data[b0:b1]).view(dtype).view((b1 - b0) // row, *shape[1:])
                found.append((at // row, part))
            else:
                if out is None:
                    out = loaded.buffer(shape, dtype) if loaded.scratch else torch.empty(shape, dtype=dtype)
                    dst = out.view(-1).view(torch.uint8).numpy()
                dst[at : at + b1 - b0] = data[b0:b1]
                small = at if small is None else small
            at += b1 - b0
        if small is not None:
            found.append((small // row, out.narrow(0, small // row, (at - small) // row)))
        return 0, found

    def _general_pieces(self, key: str, loaded=None):
        """:meth:`LogicalPass.pieces`, where the parts average at least :data:`PIECE_BYTES`."""
        node = self.plans.get(key)
        if node is None or node["op"] != "cat":
            return None
        i = self.position[key]
        dtype = getattr(torch, str(self.dtype[i]).removeprefix("torch."), None)
        size = math.prod(self.shape[i]) * (dtype.itemsize if isinstance(dtype, torch.dtype) else 1)
        if size < PIECE_BYTES * len(node["parts"]):
            return None
        return super().pieces(key, loaded)

    def __getstate__(self) -> dict:
        return {k: v for k, v in super().__getstate__().items() if k != "shared"}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.shared = None


def request_passes(plan: TokenPlan, passes: dict[tuple[int, int], PassIndex], side: str) -> dict:
    """One side as a logical pass per request (``{(0, request): LogicalPass}``), each entry that
    request's compared token rows in position order, ``[len(positions), ...]``.

    ``side`` is ``"a"`` or ``"b"``. Requests without a compared token have no pass (they are in
    :attr:`TokenPlan.one_sided`).
    """
    # a dict or two per part, none in a cycle: the collections they would trigger walk every
    # object of both opened dumps (half the time of this function, bench/tokens.py --decode 16)
    with paused():
        return _request_passes(plan, passes, side)


def _request_passes(plan: TokenPlan, passes: dict[tuple[int, int], PassIndex], side: str) -> dict:
    by_pass = {p: pi for (_, p), pi in passes.items()}
    shared = OpenedPasses()
    rows: dict[int, dict[str, Any]] = {}  # pass -> {key: _token_rows()}: the same for every request
    out = {}
    for request, rp in plan.requests.items():
        runs = rp.a if side == "a" else rp.b
        if not runs:
            continue
        sources = {r.pass_: by_pass[r.pass_] for r in runs}
        for p, pi in sources.items():
            if p not in rows:
                rows[p] = {key: _token_rows(pi, p, key) for key in pi.keys}
        order = sorted(sources)
        labels = [f"{side.upper()} {r}" for r in runs]
        count = sum(r.length for r in runs)
        tables = [rows[r.pass_] for r in runs]
        first: dict[str, tuple[int, int]] = {}  # the entries in order, where each is first held
        for p in order:
            for i, key in enumerate(sources[p].keys):
                if key not in first:
                    first[key] = (p, i)
        plans, shapes, located = {}, {}, {}
        for key in first:
            found = [t.get(key) for t in tables]
            plans[key], shapes[key] = _gather(key, runs, found, request, labels, count)
            if plans[key]["op"] == "cat":
                located[key] = _byte_spans(key, runs, found, shapes[key])
        out[(0, request)] = RequestPass.build(
            0,
            request,
            sources,
            plans,
            first,
            shapes=shapes,
            what=f"request {request}, positions {_run_spans(runs)}",
        )
        out[(0, request)].shared = shared
        out[(0, request)].spans = {k: v for k, v in located.items() if v is not None}
    return out


def _byte_spans(key: str, runs: list[Run], found: list, shape: list[int]):
    """:meth:`RequestPass.byte_spans` of a gathered entry, from its runs (``None``: one dtype
    does not hold for all its parts, or it is not a torch one)."""
    dtype = found[0][3]
    if dtype is None or any(f[3] != dtype for f in found):
        return None
    row = math.prod(shape[1:]) * dtype.itemsize
    return (
        shape,
        dtype,
        [
            (run.pass_, key, run.row * row, (run.row + run.length) * row, rows * row)
            for run, (_, rows, _, _) in zip(runs, found)
        ],
    )


def _run_spans(runs: list[Run]) -> str:
    """The positions ``runs`` hold, as :func:`spans` writes them (without listing each one)."""
    out: list[list[int]] = []
    for r in sorted(runs, key=lambda r: r.position):
        if out and out[-1][1] + 1 == r.position:
            out[-1][1] = r.position + r.length - 1
        else:
            out.append([r.position, r.position + r.length - 1])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in out)


def _token_rows(pi: PassIndex, p: int, key: str) -> tuple[dict, int, list[int], torch.dtype | None] | str:
    """Entry ``key`` of pass ``p`` as token rows: ``(plan reading it, its token rows, the shape
    of a row, its torch dtype)``, or the reason it is not (its shape does not lead with the
    pass's token rows). A ``[b, s]`` layout's rows may also lead flattened (``[b*s, ...]``:
    MoE routers and experts flatten the batch): the same rows in the same order."""
    i = pi.position[key]
    shape, lead = pi.shape[i], list(pi.tokens.shape)
    node = read(p, key)
    if shape is not None and list(shape[: len(lead)]) == lead:
        if len(lead) > 1:
            node = {"op": "flat", "end": len(lead) - 1, "part": node}
    elif shape and len(lead) > 1 and shape[0] == math.prod(lead):
        lead = [shape[0]]  # its token rows already flattened, row-major (MoE routers, experts)
    else:
        return (
            f"{NOT_TOKEN_MAJOR}: shape {None if shape is None else list(shape)} in pass {p} "
            f"does not lead with its token rows {lead} (set aside, not compared)"
        )
    dtype = getattr(torch, str(pi.dtype[i]).removeprefix("torch."), None)
    return node, math.prod(lead), list(shape[len(lead) :]), dtype if isinstance(dtype, torch.dtype) else None


def _gather(key: str, runs: list[Run], found: list, request: int, labels: list[str], count: int):
    """The plan of one entry of one request, its rows of each run put end to end, and its
    shape (``None`` where it cannot be gathered); ``found``: :func:`_token_rows` of the entry
    in each run's pass (``None`` where that pass lacks it)."""
    parts, shape = [], found[0][2] if isinstance(found[0], tuple) else None
    for run, f in zip(runs, found):  # a decode run's thousands of rows: one loop, kept lean
        if f is None:
            return error(
                f"not in pass {run.pass_}, which holds request {request}'s positions "
                f"{spans(list(range(run.position, run.position + run.length)))}"
            ), None
        if isinstance(f, str):
            return error(f), None
        node, rows, row_shape, _ = f
        if row_shape != shape:
            seen = ", ".join(f"{r}: {g[2] if isinstance(g, tuple) else g}" for r, g in zip(runs, found))
            return error(f"token rows of different shapes ({seen})"), None
        parts.append(
            node
            if not run.row and run.length == rows
            else {"op": "narrow", "dim": 0, "start": run.row, "length": run.length, "part": node}
        )
    node = (
        parts[0]
        if len(parts) == 1
        else {"op": "cat", "dim": 0, "parts": parts, "zigzag": False, "labels": labels}
    )
    return node, [count, *shape]
