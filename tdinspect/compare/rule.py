"""The per-pair rule: the row of one A entry against one B entry, the one definition.

:func:`compare_pair` fills a row of :data:`COLUMNS` from two sides (:class:`Side`, the
reference first): metrics, or the reason the pair is structural (shapes,
NaN/Inf on one side, arguments, an entry that cannot be assembled) or was
never compared. A :class:`~tdinspect.Diff` builds its sides from pass files
(:func:`side_of`), live comparison one side from the tensor just produced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tdinspect.align.args import arg_difference
from tdinspect.align.logical import LogicalPass, matching_slices
from tdinspect.align.tokens import NOT_TOKEN_MAJOR, RequestPass
from tdinspect.compare.pairing import layout_shapes
from tdinspect.compare.rows import differing_rows, paired_rows
from tdinspect.errors import AlignError
from tdinspect.naming import split_call
from tdinspect.numerics.metrics import TENSOR_METRICS, compare_tensors, stats_rel
from tdinspect.numerics.metrics_split import compare_pieces
from tdinspect.numerics.slices import SLICE_COLUMNS, SLICE_METRICS
from tdinspect.store.passindex import PassIndex
from tdinspect.store.restore import oversized

ROW_METRICS = TENSOR_METRICS + ("stats_rel",)
# the reason of numbers, not structure: a row that says it is judged by its metric
# (Diff._layout_rows, live comparison's structural="report")
NONFINITE = "NaN/Inf on one side"
STRUCTURAL_COLUMNS = ["rank", "pass", "order", "key", "key_b", "reason"]
COLUMNS = [
    "rank",
    "pass",
    "op",
    "call",
    "order",
    "key",
    "key_b",
    "dtype_a",
    "dtype_b",
    "shape",
    "structural",
    "reason",
    *ROW_METRICS,
    # the worst slice's value of each metric a slice can be worse in (NaN: not made of slices)
    *SLICE_COLUMNS,
]

# what a side says of an entry capture recorded without its tensor (dumper/kinds.py)
NOT_STORED = "tensor not stored at capture: "


def new_row(
    rank: int, pass_: int, key: str, key_b: str, order: float, dtype_a, dtype_b, shape
) -> dict[str, Any]:
    """A row of :data:`COLUMNS` before comparison (metrics NaN, no reason)."""
    op, call = split_call(key)
    row: dict[str, Any] = {
        "rank": rank,
        "pass": pass_,
        "op": op,
        "call": call,
        "key": key,
        "key_b": key_b,
        "order": order,
        "reason": "",
        "structural": False,
        "dtype_a": dtype_a or "",
        "dtype_b": dtype_b or "",
        "shape": str(shape),
    }
    for m in ROW_METRICS:
        row[m] = math.nan
    for c in SLICE_COLUMNS:
        row[c] = math.nan
    return row


@dataclass
class Side:
    """One side of a matched pair: metadata now, statistics and tensor when asked for."""

    shape: Any
    uninitialized: bool
    stats: Any  # () -> {stat: value}
    tensor: Any  # () -> torch.Tensor (AlignError: a structural problem)
    problem: str = ""  # why an assembled entry cannot be built, naming the side
    call_args: Any = None  # the recorded op call (op level with inputs)
    checksum: Any = None  # the sidecar's bitwise fingerprint
    dtype: Any = None
    pieces: Any = None  # () -> a concatenation's parts (align.logical.pieces), or None
    replica: bool = False  # an unsharded entry without dims: every rank's copy, checked equal
    rows: Any = None  # capture(checksum_dim=...): {"dim": d, "rows": [fingerprint per index]}
    fused: Any = None  # a fused entry's layout (align.logical.LogicalPass.fused_layout), or None
    rank_pieces: Any = None  # () -> a fused entry's shards in rank order
    token_rows: int | None = None  # a request's tokens (tokens=True): elements a token row


def _replica_problem(a: Side, b: Side, mode: str) -> str:
    """Why a replicated side of a shape mismatch is no replica (a shard whose dims were not
    given: the ranks' copies differ), or ``""``; the shapes alone would hide that."""
    if mode != "tensor":
        return ""
    for side in (a, b):
        if side.replica:
            try:
                side.tensor()
            except AlignError as exc:
                return str(exc)
    return ""


def compare_pair(row: dict[str, Any], a: Side, b: Side, transform, mode: str, chunk: int) -> None:
    """Fill ``row`` for the pair (``a`` the reference): metrics, or the reason it is structural
    or was never compared. The one per-pair rule of :class:`Diff` and of live comparison."""
    if a.uninitialized or b.uninitialized:
        row["reason"] = "uninitialized (never compared)"
        return
    if a.problem or b.problem:
        if NOT_STORED in a.problem and NOT_STORED in b.problem:  # nothing to compare, alike
            row["reason"] = a.problem.split(": ", 1)[1]
            return
        if NOT_TOKEN_MAJOR in a.problem and NOT_TOKEN_MAJOR in b.problem:
            # neither side's rows are tokens (weights, rotary tables, rows gathered by routing):
            # not lined up by tokens, never compared (an incomplete verdict), alike on both sides
            row["reason"] = f"set aside, not compared: {a.problem}"
            return
        row.update(structural=True, reason=a.problem or b.problem)
        return
    paired = paired_rows(a.shape, b.shape, a.rows, b.rows) if transform is None else None
    if paired is not None:  # a batch of 4 against a batch of 1: their common rows
        _compare_rows(row, a, b, *paired, mode, chunk)
        return
    why, _ = layout_shapes(a.shape, b.shape, transform)
    if why:
        row.update(structural=True, reason=_replica_problem(a, b, mode) or why)
        return
    if mode == "stats" and transform is not None:
        row["reason"] = f"transform {transform.spec!r} needs tensors (statistics-only dump)"
        return
    args_why = arg_difference(a.call_args, b.call_args)  # "" unless both recorded
    if mode == "stats":
        sa, sb = a.stats(), b.stats()
        row["stats_rel"] = stats_rel(sb, sa)
        row["equal"] = _same_checksum(a, b)
        if (sa["nan"] + sa["inf"] > 0) != (sb["nan"] + sb["inf"] > 0):
            row.update(structural=True, reason=NONFINITE)
    else:
        try:
            found = _tensor_metrics(a, b, transform, chunk)
        except AlignError as exc:
            row.update(structural=True, reason=str(exc))
            return
        if isinstance(found, str):
            row.update(structural=True, reason=found)
            return
        row.update(found)
        bad = row.pop("nonfinite_mismatch", 0)
        if bad:
            row.update(structural=True, reason=f"{NONFINITE} ({int(bad)} elements)")
    if args_why:  # the metrics stay in the row: how much the other argument changed
        row.update(structural=True, reason=args_why)


def _compare_rows(row: dict[str, Any], a: Side, b: Side, dim: int, n: int, mode: str, chunk: int) -> None:
    """Fill ``row`` for a pair whose shapes differ only along its checksum dim
    (:func:`tdinspect.compare.rows.paired_rows`): ``equal`` from the first ``n`` rows'
    fingerprints; in tensor mode the other metrics from those rows of both tensors, each row
    judged too (``slice_<metric>``, a second read of those rows: this road is rare) (statistics
    of whole tensors of other shapes say nothing: ``stats_rel`` stays NaN)."""
    if mode == "tensor":
        try:
            ya, xb = a.tensor().narrow(dim, 0, n), b.tensor().narrow(dim, 0, n)
        except AlignError as exc:
            row.update(structural=True, reason=str(exc))
            return
        row.update(compare_tensors(xb, ya, chunk=chunk))
        # each row judged too (numerics/slices.py): a batch's rows are requests of their own
        row.update(_worst_apart(list(zip(xb.unbind(dim), ya.unbind(dim))), chunk))
        bad = row.pop("nonfinite_mismatch", 0)
        if bad:
            row.update(structural=True, reason=f"{NONFINITE} ({int(bad)} elements)")
    if mode == "stats":
        row["equal"] = float(not differing_rows(a.rows, b.rows, n) and a.dtype == b.dtype)


def _tensor_metrics(a: Side, b: Side, transform, chunk: int) -> dict[str, float] | str:
    """The metrics of the pair's tensors (``a`` the reference), or why the transform failed.

    A concatenated side (unshard, concat) is compared part by part against the
    matching slices of the other, without assembling it, where
    :func:`~tdinspect.numerics.metrics_split.compare_pieces` can be exact. A pair made of
    slices (those parts; a request's token rows) is judged slice by slice too
    (:mod:`tdinspect.numerics.slices`): the worst slice's metrics, from the sums of the same
    read; where the pair takes the whole road (two dtypes, NaN/Inf), from its slices compared
    one by one.
    """
    rows = a.token_rows if transform is None and a.token_rows and a.token_rows == b.token_rows else None
    cut = None
    if transform is None and a.fused is not None and a.fused == b.fused:  # shard meets shard
        shards = matching_slices(a.rank_pieces(), b.rank_pieces())
        found = compare_pieces([(x, y) for y, x in shards], chunk=chunk, slices="pieces")
        if found is not None:
            return found
    if transform is None and (a.pieces is not None or b.pieces is not None):
        pa, pb = (s.pieces() if s.pieces is not None else None for s in (a, b))
        if pa is not None or pb is not None:
            if pa is None:
                pa = (pb[0], [(0, a.tensor())])
            if pb is None:
                pb = (pa[0], [(0, b.tensor())])
            slices = matching_slices(pa, pb)
            if slices is not None:
                cut = [(x, y) for y, x in slices]
                found = compare_pieces(cut, chunk=chunk, slices=rows or "pieces")
                if found is not None:
                    return found
    ya, xb = a.tensor(), b.tensor()
    if transform is not None:
        xb, why = apply_transform(transform, xb, ya)
        if why:
            return why
    if rows and cut is None:
        found = compare_pieces([(xb, ya)], chunk=chunk, slices=rows)
        if found is not None:
            return found
    out = compare_tensors(xb, ya, chunk=chunk)
    if rows:
        out.update(_worst_apart(_rows_of(xb, ya, rows), chunk))
    elif cut is not None and len(cut) > 1:
        out.update(_worst_apart(cut, chunk))
    return out


def _rows_of(x: torch.Tensor, y: torch.Tensor, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(x row, y row)`` of each token row (``width`` elements) of a pair of one shape."""
    if x.shape != y.shape or not width or x.numel() % width:
        return []
    return list(zip(x.reshape(-1, width), y.reshape(-1, width)))


def _worst_apart(pairs: list[tuple[torch.Tensor, torch.Tensor]], chunk: int) -> dict[str, float]:
    """The worst slice's metrics (``slice_<metric>``) of slices compared one by one: the road
    of pairs whose sums do not settle in one read (two dtypes, NaN/Inf masked)."""
    if len(pairs) < 2:
        return {}
    found = [compare_tensors(x, y, chunk=chunk) for x, y in pairs]
    # relative metrics at least at the pair's scale (tdinspect.numerics.slices.floored): from
    # each slice's rel_diff and energy, as the one-read road's sums give them
    energy = [float(x.double().square().sum() + y.double().square().sum()) for x, y in pairs]
    counts = [y.numel() for _, y in pairs]
    mean = sum(energy) / max(sum(counts), 1)
    for f, e, n in zip(found, energy, counts):
        floor = n * mean
        if e < floor and not math.isnan(f["rel_diff"]):
            for name in ("rel_diff", "rel_diff_cast"):
                f[name] = f[name] * e / floor
            if floor > 0 and f["sqnr_db"] != math.inf:
                f["sqnr_db"] = f["sqnr_db"] + 10 * math.log10(floor / max(e, 1e-300))
    out = {}
    for name in SLICE_METRICS:
        values = [f[name] for f in found if not math.isnan(f[name])]
        worse = max if name not in ("cosine", "sqnr_db") else min
        out[f"slice_{name}"] = float(worse(values)) if values else math.nan
    return out


def side_of(pi: PassIndex, i: int, loaded, side: str) -> Side:
    """The :class:`Side` of entry ``i`` of a pass (``side``: "A" or "B", named in problems);
    ``loaded()`` gives its open pass file."""
    pieces = (lambda: _read(pi, i, loaded(), side, pi.pieces)) if isinstance(pi, LogicalPass) else None
    return Side(
        pi.shape[i],
        pi.uninitialized[i],
        lambda: pi.stat_dict(i),
        lambda: _read(pi, i, loaded(), side),
        problem_of(pi, i, side),
        pi.call_args[i],
        pi.checksum[i] if pi.checksum else None,
        pi.dtype[i],
        pieces,
        isinstance(pi, LogicalPass) and pi.plans[pi.keys[i]]["op"] == "same",
        pi.checksum_rows[i] if pi.checksum_rows else None,
        pi.fused_layout(pi.keys[i]) if isinstance(pi, LogicalPass) else None,
        (lambda: _read(pi, i, loaded(), side, pi.rank_pieces)) if isinstance(pi, LogicalPass) else None,
        _row_width(pi, i) if isinstance(pi, RequestPass) else None,
    )


def _row_width(pi: PassIndex, i: int) -> int | None:
    """Elements of one token row of a request's entry ``[positions, ...]``."""
    shape = pi.shape[i]
    return math.prod(shape[1:]) if isinstance(shape, list) and len(shape) >= 1 else None


def apply_transform(transform, xb, ya):
    """``(transformed B tensor, structural reason or "")``; a callable may fail or change the shape."""
    big = oversized(xb)  # a transform such as flatten() makes an expanded view whole
    if big:
        return None, f"transform {transform.spec!r} not applied: B is {big}"
    try:
        out = transform(xb)
    except Exception as exc:  # a user's callable: any error is this pair's answer, not the diff's
        return None, f"transform {transform.spec!r} failed: {type(exc).__name__}: {exc}"
    if not isinstance(out, torch.Tensor):
        return None, f"transform {transform.spec!r} returned {type(out).__name__}, not a tensor"
    if out.shape != ya.shape:
        return None, f"shape {list(ya.shape)} vs {list(out.shape)} (B after {transform.spec!r})"
    return out, ""


def _same_checksum(a: Side, b: Side) -> float:
    """``equal`` from the sidecars' checksums (1 or 0); NaN when a side has none."""
    if not (isinstance(a.checksum, str) and isinstance(b.checksum, str)):
        return math.nan
    return float(a.checksum == b.checksum and a.dtype == b.dtype)


def problem_of(pi: PassIndex, i: int, side: str) -> str:
    """Why entry ``i`` of a side cannot be compared: a logical entry (unshard, concat) that
    cannot be assembled, or a tensor capture did not store (:data:`NOT_STORED`); naming the
    side, or ``""``."""
    problem = pi.problem(i) if isinstance(pi, LogicalPass) else ""
    if not problem and pi.skipped and isinstance(pi.skipped[i], str):  # dumper/kinds.py
        problem = f"{NOT_STORED}{pi.skipped[i]}"
    return f"{side}: {problem}" if problem else ""


def _read(pi: PassIndex, i: int, loaded, side: str, how=None):
    try:
        return (how or pi.tensor)(pi.keys[i], loaded)
    except AlignError as exc:
        raise AlignError(f"{side}: {exc}") from None
