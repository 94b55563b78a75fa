"""Diff: two dumps compared entry by entry, and the first place they part.

The first run is the reference (``y`` in relative metrics, and the execution
order that "first" refers to). Entries are matched by (rank, pass, op, call),
or, with ``align="sequence"``, by a sequence alignment of their signatures
(op, shape) within each pass, for op streams that do not line up by name
(a fused kernel on one side, its unfused ops on the other).

Structural divergences (present on one side only, shape mismatch, NaN/Inf
where the other side is finite, a rank or pass on one side only) always count
as divergences and carry a ``reason``; a dtype difference does not (that is
what precision comparisons are), and is shown with the ``_cast`` metrics.

Examples
--------
>>> d = DumpSet.open("runs/fp32").diff("runs/bf16")            # doctest: +SKIP
>>> d.first_divergence()                                       # doctest: +SKIP
Divergence(model.layers.2.mlp.down pass 0: rel_diff 0.0321 > 0.00098 (auto: bfloat16))
>>> d.first_divergence(threshold=1e-3)                         # doctest: +SKIP
Divergence(model.layers.2.mlp.down pass 0: rel_diff 0.0321 > 0.001)
"""

from __future__ import annotations

import difflib
import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from tdinspect.align.args import arg_difference
from tdinspect.align.logical import LogicalPass, describe, matching_slices, slices_of
from tdinspect.align.mapping import Mapping
from tdinspect.compare.passframes import PassFrames, typed_columns
from tdinspect.compare.plainpairs import compare_plain, plain_dtypes
from tdinspect.compare.smallpairs import compare_batch, pass_spans, small_plain
from tdinspect.dumpset import DumpSet, call_axis
from tdinspect.errors import (
    AlignError,
    DumpFormatError,
    TransformError,
    UncomparedWarning,
)
from tdinspect.naming import make_key, parse_key, split_call
from tdinspect.numerics.metrics import (
    AUTO,
    TENSOR_METRICS,
    auto_rule,
    auto_threshold,
    compare_tensors,
    dtype_named,
    metric,
    same_bits,
    stats_rel,
    unit_roundoff,
)
from tdinspect.numerics.metrics_split import compare_pieces, compare_positions
from tdinspect.store.passindex import PassIndex
from tdinspect.util.gcpause import paused
from tdinspect.util.parallel import default_wave, map_in_waves
from tdinspect.util.terminal import visible

if TYPE_CHECKING:
    import xarray as xr

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
]


@dataclass
class Divergence:
    """The first entry (in the reference's execution order) past a threshold.

    Attributes
    ----------
    op : str
        Entry name without ``::callN``.
    call, pass_, rank : int
        Where it is (0-based call).
    key : str
        The on-disk key (with ``::callN``).
    metric : str
    value : float
        The metric's value (NaN for a structural divergence without one).
    threshold : float
        The threshold actually used for this entry (``"auto"`` resolved).
    reason : str
        Why it counts: ``"rel_diff 5.08e-05 > 1.49e-08 (auto: float32)"`` (an
        ``"auto"`` threshold and where it came from), ``"rel_diff 0.0158 > 0.001"``
        (a number given), ``"shape [2, 3] vs [3, 2]"``,
        ``"only in B"``, ``"NaN/Inf on one side (12 elements)"``...
    order : float
        Its position in the reference pass.
    before : list of (key, value)
        The entries just before it in the same pass and their metric values.
    """

    op: str
    call: int
    pass_: int
    rank: int
    key: str
    metric: str
    value: float
    threshold: float
    reason: str
    order: float
    structural: bool = False
    before: list[tuple[str, float]] = field(default_factory=list)
    row: dict[str, Any] = field(default_factory=dict, repr=False)
    structural_entries: Any = field(default=None, repr=False)

    def __repr__(self) -> str:
        text = (
            f"Divergence({self.key} pass {self.pass_}"
            + (f" rank {self.rank}" if self.rank else "")
            + f": {self.reason}"
        )
        se = self.structural_entries
        if se is not None and len(se):
            shown = "; ".join(f"{k}: {r}" for k, r in zip(se["key"][:3], se["reason"][:3]))
            text += (
                f"; {len(se)} structural entries set aside ({shown}" + ("; ..." if len(se) > 3 else "") + ")"
            )
        return visible(text + ")")  # names from files: printed by a REPL, never terminal controls

    def _repr_html_(self) -> str:
        from tdinspect.report import divergence_html

        return divergence_html(self)


def _signature(pi: PassIndex, i: int) -> tuple:
    key = pi.keys[i]
    try:
        parts = parse_key(key)
        name = parts.op or (pi.module_type[i] or parts.module.rsplit(".", 1)[-1])
        labels = parts.labels
    except ValueError:
        name, labels = split_call(key)[0], ()
    return (name, labels, tuple(pi.shape[i] or ()))


def _pairs(pa: PassIndex | None, pb: PassIndex | None, keep, align: str, mapping=None):
    """``(i_a, i_b, order)`` triples: matched, A-only (i_b None), B-only (i_a None).

    With a :class:`~tdinspect.align.Mapping`, an A entry meets the B entry its
    rule names (same call); several A entries may meet one B entry.
    """
    ka = [i for i, k in enumerate(pa.keys) if keep(k)] if pa else []
    kb = [j for j, k in enumerate(pb.keys) if keep(k)] if pb else []
    if pa is None or pb is None:
        return [(i, None, float(i)) for i in ka] + [(None, j, float(j)) for j in kb]
    if align == "sequence":
        sa = [_signature(pa, i) for i in ka]
        sb = [_signature(pb, j) for j in kb]
        matcher = difflib.SequenceMatcher(None, sa, sb, autojunk=False)
        matched = {}
        for block in matcher.get_matching_blocks():
            for t in range(block.size):
                matched[kb[block.b + t]] = ka[block.a + t]
        out = [(i, None, float(i)) for i in ka if i not in matched.values()]
        out += [(matched[j], j, float(matched[j])) for j in kb if j in matched]
    elif mapping is not None:
        out = [(i, pb.position.get(_mapped_key(mapping, pa.keys[i])), float(i)) for i in ka]
        matched = {}
        for i, j, _ in out:
            if j is not None:
                matched.setdefault(j, i)
    else:
        out = [(i, pb.position.get(pa.keys[i]), float(i)) for i in ka]
        matched = {pb.position[pa.keys[i]]: i for i in ka if pa.keys[i] in pb.position}
    last = -0.5
    for j in kb:  # B-only entries go just after the reference entry that precedes them in B
        if j in matched:
            last = float(matched[j])
        else:
            out.append((None, j, last + 0.5))
    return sorted(out, key=lambda t: t[2])


def _mapped_key(mapping, a_key: str) -> str:
    base, call = split_call(a_key)
    return make_key(mapping.partner(base)[0], call)


def _missing(job: PassJob, ia, ib) -> str:
    """Why an entry has no partner."""
    if job.missing_reason:
        return job.missing_reason
    side = "A" if ib is None else "B"
    if job.align == "sequence":
        return f"unmatched in {side}"
    if side == "A" and job.mapping is not None:
        base = split_call(job.a.keys[ia])[0]
        rule = job.mapping.rule_of(base)
        if rule:
            return (
                f"only in A (its rule '{rule}' names '{_mapped_key(job.mapping, job.a.keys[ia])}', not in B)"
            )
    return f"only in {side}"


def _layout(pa: PassIndex, ia: int, pb: PassIndex, ib: int, transform) -> tuple[str, Any]:
    """``(structural reason or "", B shape after the transform)`` for a matched pair."""
    return _layout_shapes(pa.shape[ia], pb.shape[ib], transform)


def _layout_shapes(shape_a, shape_b, transform) -> tuple[str, Any]:
    shape_a, shape_b = list(shape_a or []), list(shape_b or [])
    if transform is None:
        return ("" if shape_a == shape_b else f"shape {shape_a} vs {shape_b}"), shape_b
    try:
        after = transform.out_shape(shape_b)
    except TransformError as exc:
        return str(exc), None
    if after is not None and after != shape_a:
        return f"shape {shape_a} vs {after} (B {shape_b} after {transform.spec!r})", after
    return "", after


@dataclass
class PassJob:
    """One pass pair to compare (picklable: it travels to dask workers)."""

    rank: int
    pass_: int
    a: PassIndex | None
    b: PassIndex | None
    pattern: Any
    align: str
    mode: str
    chunk: int
    missing_reason: str = ""
    mapping: Any = None

    def keep(self, key: str) -> bool:
        return self.pattern is None or bool(self.pattern.search(split_call(key)[0]))

    def transform(self, a_key: str):
        return None if self.mapping is None else self.mapping.partner(split_call(a_key)[0])[1]


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
        if _NOT_STORED in a.problem and _NOT_STORED in b.problem:  # nothing to compare, alike
            row["reason"] = a.problem.split(": ", 1)[1]
            return
        row.update(structural=True, reason=a.problem or b.problem)
        return
    why, _ = _layout_shapes(a.shape, b.shape, transform)
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


def _tensor_metrics(a: Side, b: Side, transform, chunk: int) -> dict[str, float] | str:
    """The metrics of the pair's tensors (``a`` the reference), or why the transform failed.

    A concatenated side (unshard, concat) is compared part by part against the
    matching slices of the other, without assembling it, where
    :func:`~tdinspect.numerics.metrics_split.compare_pieces` can be exact.
    """
    if transform is None and (a.pieces is not None or b.pieces is not None):
        pa, pb = (s.pieces() if s.pieces is not None else None for s in (a, b))
        if pa is not None or pb is not None:
            if pa is None:
                pa = (pb[0], [(0, a.tensor())])
            if pb is None:
                pb = (pa[0], [(0, b.tensor())])
            slices = matching_slices(pa, pb)
            found = None if slices is None else compare_pieces([(x, y) for y, x in slices], chunk=chunk)
            if found is not None:
                return found
    ya, xb = a.tensor(), b.tensor()
    if transform is not None:
        xb, why = _apply(transform, xb, ya)
        if why:
            return why
    return compare_tensors(xb, ya, chunk=chunk)


def side_of(pi: PassIndex, i: int, loaded, side: str) -> Side:
    """The :class:`Side` of entry ``i`` of a pass (``side``: "A" or "B", named in problems);
    ``loaded()`` gives its open pass file."""
    pieces = (lambda: _read(pi, i, loaded(), side, pi.pieces)) if isinstance(pi, LogicalPass) else None
    return Side(
        pi.shape[i],
        pi.uninitialized[i],
        lambda: pi.stat_dict(i),
        lambda: _read(pi, i, loaded(), side),
        _problem(pi, i, side),
        pi.call_args[i],
        pi.checksum[i] if pi.checksum else None,
        pi.dtype[i],
        pieces,
        isinstance(pi, LogicalPass) and pi.plans[pi.keys[i]]["op"] == "same",
    )


def compare_pass(job: PassJob) -> list[dict[str, Any]]:
    """Rows (one per matched or unmatched entry) for one pass pair.

    Made with the cyclic garbage collector paused (:mod:`tdinspect.util.gcpause`): a dict and a
    few tuples an entry, no cycles, whose collections walked every object of the opened
    dumps (a pass of 10⁵ small entries of 16 float32, diff().table(): 3.41 -> 2.82 s of
    CPU, medians of 6 interleaved rounds).
    """
    with paused():
        return _compare_pass(job)


def _compare_pass(job: PassJob) -> list[dict[str, Any]]:
    pa, pb = job.a, job.b
    files: dict[str, Any] = {}  # each side's tensors, opened on first use

    def loaded(side: str, pi):
        if side not in files:
            files[side] = _open(pi)
        return files[side]

    def loaded_a():
        return loaded("a", pa)

    def loaded_b():
        return loaded("b", pb)

    rows, single = _plain_first(job, files, (loaded_a, loaded_b))
    for row, ia, ib, transform in single:
        compare_pair(
            row,
            side_of(pa, ia, loaded_a, "A"),
            side_of(pb, ib, loaded_b, "B"),
            transform,
            job.mode,
            job.chunk,
        )
    _hint_concat(rows, pa, pb)
    return rows


def _plain_first(job: PassJob, files: dict[str, Any], loaders) -> tuple[list, list]:
    """A pass's rows, those of its plain pairs filled (the small ones together:
    :mod:`tdinspect.compare.smallpairs`, the larger from the files' bytes: :mod:`tdinspect.compare.plainpairs`;
    same numbers); and the pairs left for ``compare_pair``: ``(row, i_a, i_b, transform)``.
    ``files`` gets each side's tensors where the records were read; ``loaders`` load them."""
    pa, pb = job.a, job.b
    rows, batch, plain, single = [], [], [], []
    plain_a, plain_b = (plain_dtypes(p) if job.mode == "tensor" and p is not None else None for p in (pa, pb))
    small_a, small_b = (
        None if plain is None else small_plain(p, plain) for p, plain in ((pa, plain_a), (pb, plain_b))
    )
    for ia, ib, order in _pairs(pa, pb, job.keep, job.align, job.mapping):
        ref, idx = (pa, ia) if ia is not None else (pb, ib)
        key = ref.keys[idx]
        row = new_row(
            job.rank,
            job.pass_,
            key,
            pb.keys[ib] if ib is not None else "",
            order,
            pa.dtype[ia] if ia is not None else "",
            pb.dtype[ib] if ib is not None else "",
            ref.shape[idx],
        )
        rows.append(row)
        if ia is None or ib is None:
            row.update(structural=True, reason=_missing(job, ia, ib))
            continue
        if not (pa.uninitialized[ia] or pb.uninitialized[ib]):
            same = _unchanged_since(pa, ia, pb, ib)
            if same is not None:
                row["reason"] = f"unchanged since pass {same} (compared there)"
                continue
        transform = job.transform(key)
        if (
            small_a is not None
            and small_a[ia] is not None
            and small_a[ia] == small_b[ib]
            and pa.shape[ia] == pb.shape[ib]
            and transform is None
        ):
            batch.append((row, ia, ib))
        elif (
            plain_a is not None
            and plain_a[ia] is not None
            and plain_a[ia] == plain_b[ib]
            and pa.shape[ia] == pb.shape[ib]
            and transform is None
        ):
            plain.append((row, ia, ib))
        else:
            single.append((row, ia, ib, transform))
    if not (batch or plain):
        return rows, single
    spans = [pass_spans(pa), pass_spans(pb)]
    for side, found in zip("ab", spans):
        if found is not None:  # the other pairs read these records too (no second read)
            files[side] = found[2]
    sources = [s if s is not None else f for s, f in zip(spans, loaders)]
    left = compare_batch(batch, pa, pb, sources) if batch else []
    left += compare_plain(plain, pa, pb, sources)
    single += [(row, ia, ib, None) for row, ia, ib in left]
    return rows, single


def _hint_concat(rows: list[dict[str, Any]], pa: PassIndex, pb: PassIndex) -> None:
    """Say so where a shape mismatch is a decode run against one full forward: the entry is
    called several times on one side (a prefill call, then a call per token) and those
    calls end to end along one dim give the other side's shape (compare with ``concat``)."""
    mismatched = [r for r in rows if r["structural"] and r["reason"].startswith("shape ")]
    if not mismatched:
        return
    calls: dict[tuple[str, str], dict[int, Any]] = {}
    for side, pi in (("A", pa), ("B", pb)):
        for key, shape in zip(pi.keys, pi.shape):
            base, call = split_call(key)
            calls.setdefault((side, base), {})[call] = shape
    for row in mismatched:
        base_a, base_b = split_call(row["key"])[0], split_call(row["key_b"] or row["key"])[0]
        for side, mine, other, theirs in (("A", base_a, "B", base_b), ("B", base_b, "A", base_a)):
            own = calls.get((side, mine), {})
            found = _concat_dim([own[c] for c in sorted(own)], list(calls.get((other, theirs), {}).values()))
            if found is None:
                continue
            dim, total, size = found
            head = f" ({side} calls this entry {len(own)} times: end to end along dim {dim} they"
            if total == size:
                row["reason"] += (
                    f"{head} match {other}; compare after .concat('call', "
                    f"dim={dim}), CLI --concat call:{dim})"
                )
            else:  # generate never feeds its last token back: the forward ran on more
                row["reason"] += (
                    f"{head} give the first {total} of {other}'s {size} positions; "
                    f"compare {other}.narrow({dim}, 0, {total}) with "
                    f"{side}.concat('call', dim={dim}), or capture {other} on those "
                    f"{total} tokens and use CLI --concat call:{dim})"
                )
            break


def _concat_dim(shapes: list, other: list) -> tuple[int, int, int] | None:
    """``(dim, length end to end, the other's length)`` for the dim along which ``shapes``
    (two or more calls) put end to end give the one shape in ``other`` or its first
    positions, else ``None``."""
    if (
        len(shapes) < 2
        or len(other) != 1
        or not isinstance(other[0], list)
        or not all(isinstance(s, list) for s in shapes)
    ):
        return None
    target = other[0]
    for dim in range(len(target)):
        if (
            all(
                len(s) == len(target) and s[:dim] + s[dim + 1 :] == target[:dim] + target[dim + 1 :]
                for s in shapes
            )
            and sum(s[dim] for s in shapes) <= target[dim]
        ):
            return dim, sum(s[dim] for s in shapes), target[dim]
    return None


def _apply(transform, xb, ya):
    """``(transformed B tensor, structural reason or "")``; a callable may fail or change the shape."""
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


def _as_error(name: str, values: pd.Series) -> pd.Series:
    """A metric as an error, larger is worse (``cosine``, ``sqnr_db`` and ``equal`` turned)."""
    v = values.astype(float)
    if name in ("cosine", "equal"):
        return 1 - v
    if name == "sqnr_db":
        return 10 ** (-v / 10)
    return v


def _with_growth(table: pd.DataFrame, metric_name: str) -> pd.DataFrame:
    """``table`` in execution order with ``error`` (the metric as an error), ``prev_max`` (the
    largest error before it in its rank's pass), ``growth`` (their ratio; ``inf`` for a
    pass's first error, 1 with no error) and ``added`` (their difference)."""
    df = table.sort_values(["rank", "pass", "order"]).reset_index(drop=True)
    df["error"] = err = _as_error(metric_name, df[metric_name])
    passes = [df["rank"], df["pass"]]
    prev = err.groupby(passes).cummax().groupby(passes).shift(1).fillna(0.0)
    df["prev_max"] = prev
    df["growth"] = np.where(prev > 0, err / prev.where(prev > 0, 1.0), np.where(err > 0, np.inf, 1.0))
    df["added"] = err - prev
    return df


def _module_of(op: str) -> str:
    try:
        return parse_key(op).module
    except ValueError:
        return op


def _unchanged_since(pa: PassIndex, ia: int, pb: PassIndex, ib: int) -> int | None:
    """The pass both sides say this entry is unchanged since (a parameter), else ``None``."""
    return same_ref_pass(pa.ref[ia], pb.ref[ib])


def same_ref_pass(ra, rb) -> int | None:
    """The pass two sidecar references both point to (same entry), else ``None``."""
    if (
        ra
        and rb
        and ra.get("pass") is not None
        and ra.get("pass") == rb.get("pass")
        and ra.get("of") == rb.get("of")
    ):
        return ra["pass"]
    return None


def _problem(pi: PassIndex, i: int, side: str) -> str:
    """Why a logical entry (unshard, concat) cannot be assembled, naming the side, or ``""``."""
    problem = pi.problem(i) if isinstance(pi, LogicalPass) else ""
    if not problem and pi.skipped and isinstance(pi.skipped[i], str):  # dumper/kinds.py
        problem = f"{_NOT_STORED}{pi.skipped[i]}"
    return f"{side}: {problem}" if problem else ""


_NOT_STORED = "tensor not stored at capture: "


def _assembled(pi: PassIndex | None, i: int | None) -> str:
    """How an entry of an unsharded / concatenated side is put together (``""`` for a stored one)."""
    if not isinstance(pi, LogicalPass) or i is None:
        return ""
    return describe(pi.plans[pi.keys[i]])


def _open(pi: PassIndex):
    """A pass's tensors for comparing entry by entry (assembled ones into reused buffers)."""
    return pi.load(scratch=True) if isinstance(pi, LogicalPass) else pi.load()


def _read(pi: PassIndex, i: int, loaded, side: str, how=None):
    try:
        return (how or pi.tensor)(pi.keys[i], loaded)
    except AlignError as exc:
        raise AlignError(f"{side}: {exc}") from None


def _same_partials(pi: LogicalPass, node: dict) -> bool:
    """Whether the ranks' partial sums of an unsharded entry hold the same bits: an output
    all-reduced inside the module (a row-parallel layer that reduces), not a partial sum."""
    loaded = pi.load()
    parts = [loaded.fetch(p["src"], p["key"]) for p in node["parts"] if p.get("op") == "read"]
    return len(parts) == len(node["parts"]) > 1 and all(
        t.shape == parts[0].shape and same_bits(parts[0], t) for t in parts[1:]
    )


class Diff:
    """Two dumps compared; the first is the reference.

    Parameters
    ----------
    a, b : DumpSet
        Reference and compared dump.
    align : {"name", "sequence"}
        Match entries by name, or by a sequence alignment of (op, shape)
        signatures per pass (honest lists of what did not match).
    client : dask.distributed.Client, optional
        Run the per-pass comparisons on this cluster (default: ``a.client``,
        else a local thread pool, :mod:`tdinspect.util.parallel`).
    chunk : int
        Elements converted at a time when a pair needs a dtype conversion or
        a copy (bounds memory for huge tensors).
    mode : {"auto", "tensor", "stats"}
        ``"stats"`` compares statistics only (the only choice when a side is
        statistics-only): relative difference of min, max, mean (on the
        reference's absmax) and l2 (:func:`tdinspect.numerics.metrics.stats_rel`).
    mapping : dict, path or Mapping, optional
        Pair differently named entries: ``{a_regex: b_template}`` or
        ``{a_regex: [b_template, transform]}`` rules, or a YAML/JSON file of
        them (see :mod:`tdinspect.align.mapping`); :meth:`plan` shows the
        pairs before any tensor is read.
    passes_in_flight : int, optional
        The memory knob: pass pairs computed together (default: twice the
        worker threads). Peak memory is about the imports (~260 MB) plus the
        pass files being compared at once (each worker maps one pair) plus
        a few MB of chunk buffers per worker, whatever the dump's size.
    unshard : bool
        Compare both sides' :meth:`DumpSet.unshard` (ranks reassembled).
    concat : str or (over, dim), optional
        ``"pass:1"``, ``"call:s"`` or ``("call", 1)``: compare both sides'
        :meth:`DumpSet.concat` (decode steps put end to end), after unsharding.

    Examples
    --------
    >>> d = Diff(DumpSet.open("a"), DumpSet.open("b"))   # doctest: +SKIP
    >>> d.first_divergence()                              # doctest: +SKIP
    """

    def __init__(
        self,
        a: DumpSet,
        b: DumpSet,
        *,
        align: str = "name",
        client: Any = None,
        chunk: int = 1 << 18,
        mode: str = "auto",
        passes_in_flight: int | None = None,
        mapping: Any = None,
        unshard: bool = False,
        concat: str | tuple | None = None,
    ):
        if unshard:
            a, b = a.unshard(), b.unshard()
        if concat is not None:
            from tdinspect.align.concat import parse_concat

            over, dim = parse_concat(concat)
            a, b = a.concat(over, dim), b.concat(over, dim)
        if align not in ("name", "sequence"):
            raise ValueError(f"align={align!r}: expected 'name' or 'sequence'")
        self.mapping = Mapping.coerce(mapping)
        if self.mapping is not None and align != "name":
            raise ValueError("mapping= pairs entries by rule: use it with align='name'")
        if mode not in ("auto", "tensor", "stats"):
            raise ValueError(f"mode={mode!r}: expected 'auto', 'tensor' or 'stats'")
        self.a, self.b = a, b
        self.align = align
        self.client = client if client is not None else a.client
        self.chunk = chunk
        self.passes_in_flight = passes_in_flight
        self.mode = "stats" if (a.stats_only or b.stats_only or mode == "stats") else "tensor"
        if self.mode == "stats" and mode == "tensor":
            raise ValueError("a side is statistics-only: tensors cannot be compared (mode='stats')")
        self.default_metric = "stats_rel" if self.mode == "stats" else "rel_diff"
        self._want_stats_rel = False  # tensor mode: statistics compared once that is asked for
        # one DataFrame per pass read, kept as typed columns until asked for (~560 B an
        # entry; row dictionaries took ~1.1 KB)
        self._results = PassFrames()
        self.passes_read: list[tuple[int, int]] = []

    # -- jobs ---------------------------------------------------------------------------
    def _jobs(self) -> list[PassJob]:
        keys = sorted(set(self.a._passes) | set(self.b._passes), key=lambda k: (k[1], k[0]))
        ranks_a, ranks_b = set(self.a.ranks), set(self.b.ranks)
        jobs = []
        for rank, p in keys:
            pa, pb = self.a._passes.get((rank, p)), self.b._passes.get((rank, p))
            reason = ""
            if rank not in ranks_b:
                reason = f"rank {rank} only in A"
            elif rank not in ranks_a:
                reason = f"rank {rank} only in B"
            elif pa is None or pb is None:
                reason = f"pass {p} only in {'A' if pb is None else 'B'}"
            jobs.append(
                PassJob(
                    rank,
                    p,
                    pa,
                    pb,
                    self.a._op_pattern,
                    self.align,
                    self.mode,
                    self.chunk,
                    reason,
                    self.mapping,
                )
            )
        return jobs

    def iter_passes(self, *, growing: bool = False) -> Iterator[tuple[tuple[int, int], pd.DataFrame]]:
        """``((rank, pass), rows)`` in order, computing (in waves) only what is not cached.

        ``rows`` is a DataFrame with :data:`COLUMNS`, in the pass's execution order.
        """
        for k in self._computed(growing):
            if self._want_stats_rel and self.mode == "tensor":
                self._fill_stats_rel(k, self._results[k])
            yield k, self._results[k]

    def _computed(self, growing: bool = False) -> Iterator[tuple[int, int]]:
        """Every ``(rank, pass)`` in order, once its rows are in ``_results`` (computed in
        waves where not cached), without building its frame."""
        jobs = self._jobs()
        todo = [j for j in jobs if (j.rank, j.pass_) not in self._results]
        computed = self._compute(todo, growing)
        for job in jobs:
            k = (job.rank, job.pass_)
            if k not in self._results:
                self._results[k] = _pass_rows(next(computed))
                self.passes_read.append(k)
            yield k

    def _fill_stats_rel(self, k: tuple[int, int], rows: pd.DataFrame) -> None:
        """``stats_rel`` of compared tensor entries (from the sidecars' statistics, or
        computed from the tensors), filled once that metric is asked for."""
        todo = rows.index[
            rows["stats_rel"].isna().to_numpy()
            & ~rows["structural"].to_numpy(bool)
            & (rows["reason"].to_numpy(object) == "")
        ]
        if not len(todo):
            return
        pa, pb = self.a._passes[k], self.b._passes[k]
        for i in todo:
            sa = pa.stat_dict(pa.position[rows.at[i, "key"]])
            sb = pb.stat_dict(pb.position[rows.at[i, "key_b"]])
            rows.at[i, "stats_rel"] = stats_rel(sb, sa)

    def _compute(self, jobs: list[PassJob], growing: bool) -> Iterator[list[dict]]:
        limit = self.passes_in_flight or default_wave(self.client)
        if not growing:
            yield from map_in_waves(compare_pass, jobs, client=self.client, wave=limit)
            return
        start, wave = 0, 1  # 1, 2, 4, ... passes: an early divergence reads little
        while start < len(jobs):
            yield from map_in_waves(compare_pass, jobs[start : start + wave], client=self.client, wave=wave)
            start += wave
            wave = min(wave * 2, limit)

    def plan(self, pass_: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """Which A entry meets which B entry, through which transform: metadata only.

        Look at it before numbers are computed. One row per pair (and per
        one-sided entry) with ``rank``, ``pass``, ``a_key``, ``b_key``,
        ``transform``, ``rule`` (the mapping rule that paired it, ``""`` for
        identical names), ``shape_a``, ``shape_b`` (as stored), ``shape_b_after``
        (after the transform), ``status`` (``"ok"`` or the structural reason
        the diff will give), and ``assembled_a`` / ``assembled_b``: how an
        unsharded or concatenated entry is put together (``cat(dim 2: rank 0
        (tp 0 of 2), rank 1 (tp 1 of 2))``; ``""`` for a stored entry).

        Parameters
        ----------
        pass_, rank : int, optional
            Restrict to one pass / rank (default: the first pass, every rank).

        Examples
        --------
        >>> DumpSet.open("ref").diff("port", mapping="map.yaml").plan()   # doctest: +SKIP
        """
        passes = sorted({p for _, p in self.a._passes} | {p for _, p in self.b._passes})
        pass_ = passes[0] if pass_ is None and passes else pass_
        out = []
        for job in self._jobs():
            if job.pass_ != pass_ or (rank is not None and job.rank != rank):
                continue
            pa, pb = job.a, job.b
            for ia, ib, _ in _pairs(pa, pb, job.keep, job.align, job.mapping):
                a_key = pa.keys[ia] if ia is not None else ""
                transform = job.transform(a_key) if ia is not None else None
                row = {
                    "rank": job.rank,
                    "pass": job.pass_,
                    "a_key": a_key,
                    "b_key": pb.keys[ib] if ib is not None else "",
                    "transform": transform.spec if transform is not None else "",
                    "rule": self.mapping.rule_of(split_call(a_key)[0])
                    if self.mapping is not None and ia is not None
                    else "",
                    "shape_a": pa.shape[ia] if ia is not None else None,
                    "shape_b": pb.shape[ib] if ib is not None else None,
                    "shape_b_after": None,
                    "status": "ok",
                    "assembled_a": _assembled(pa, ia),
                    "assembled_b": _assembled(pb, ib),
                }
                if ia is None or ib is None:
                    row["status"] = _missing(job, ia, ib)
                elif _problem(pa, ia, "A") or _problem(pb, ib, "B"):
                    row["status"] = _problem(pa, ia, "A") or _problem(pb, ib, "B")
                else:
                    why, row["shape_b_after"] = _layout(pa, ia, pb, ib, transform)
                    row["status"] = why or "ok"
                out.append(row)
        return pd.DataFrame(
            out,
            columns=[
                "rank",
                "pass",
                "a_key",
                "b_key",
                "transform",
                "rule",
                "shape_a",
                "shape_b",
                "shape_b_after",
                "status",
                "assembled_a",
                "assembled_b",
            ],
        )

    # -- thresholds ---------------------------------------------------------------------
    @staticmethod
    def _hits(rows: pd.DataFrame, m, thr_fn) -> np.ndarray:
        """Which rows diverge (a boolean array), by :func:`divergent`."""
        return divergent(
            m,
            rows[m.name].to_numpy(float),
            thr_fn.of_rows(rows),
            rows["structural"].to_numpy(bool),
            rows["reason"].to_numpy(object) != "",
        )

    def _check_metric(self, metric_name):
        metric_name = metric_name or self.default_metric
        self._want_stats_rel = self._want_stats_rel or metric_name == "stats_rel"
        if self.mode == "stats" and metric_name == "equal":
            for name, side in (("A", self.a), ("B", self.b)):
                if not any(
                    pi.checksum and any(c is not None for c in pi.checksum) for pi in side._passes.values()
                ):
                    raise ValueError(
                        f"metric='equal' on a statistics-only diff compares checksums, "
                        f"and {name} ({side.path}) has none: capture it with "
                        "checksum=True"
                    )
        elif self.mode == "stats" and metric_name != "stats_rel":
            raise ValueError(
                f"this diff compares statistics only (a side is stats_only): "
                f"use metric='stats_rel' (or 'equal' with checksums), "
                f"not {metric_name!r}"
            )
        return metric(metric_name)

    @staticmethod
    def _layout_rows(rows: pd.DataFrame) -> np.ndarray:
        """Rows that differ in structure (one-sided, unmatched, shape, transform, arguments),
        as opposed to numbers (NaN/Inf on one side counts as numbers)."""
        reason = rows["reason"].astype(str)
        return rows["structural"].to_numpy(bool) & ~reason.str.startswith(NONFINITE).to_numpy(bool)

    def structural_entries(self, progress: bool | None = None) -> pd.DataFrame:
        """Every entry that differs in structure rather than in numbers (reads every pass).

        Columns ``rank``, ``pass``, ``order``, ``key``, ``key_b``, ``reason``.
        """
        df = self.table(progress)
        return df[self._layout_rows(df)][STRUCTURAL_COLUMNS].reset_index(drop=True)

    def uncompared_after(self, progress: bool | None = None) -> dict | None:
        """Where the comparison stops covering the reference: A entries set aside (one-sided,
        unmatched, reshaped) after the last A entry compared in numbers (reads every pass).

        ``first_divergence(structural="report")`` answering ``None`` says nothing of
        them: a port paired by a mapping that misses most of its entries (suggested
        from a port whose values already differ) compares a few entries and sets the
        rest aside. Entries set aside between compared ones (a reference's
        ``rotary_emb``) are not counted.

        Returns
        -------
        dict or None
            For the first (pass, rank) whose tail was not compared: ``pass``,
            ``rank``, ``last_compared`` (an A key, or None when none was),
            ``position`` (its 1-based place among the pass's A entries), ``of``
            (how many), ``after`` (the A keys set aside after it) and ``text``
            (a sentence); None when every pass's last A entry was compared.
        """
        df = self.table(progress)
        if not len(df):
            return None
        df = df.assign(layout=self._layout_rows(df)).sort_values(["pass", "rank", "order"])
        for (p, rank), rows in df.groupby(["pass", "rank"], sort=True):
            pi = self.a._passes.get((rank, p))
            keys_a = set(pi.keys) if pi is not None else set()
            rows = rows[rows["key"].isin(keys_a)]  # B-only rows name B's entries
            if not len(rows):
                continue
            compared = np.flatnonzero(~rows["layout"].to_numpy(bool))
            last = int(compared[-1]) if len(compared) else -1
            after = rows["key"].iloc[last + 1 :].tolist()
            if not after:
                continue
            shown = ", ".join(after[:3]) + (", ..." if len(after) > 3 else "")
            where = self._where(p, rank)
            if last < 0:
                text = (
                    f"no entry of A was compared in numbers ({where}): all {len(after)} were "
                    f"set aside ({shown})"
                )
                key = None
            else:
                key = rows["key"].iloc[last]
                n = len(after)
                text = (
                    f"the comparison stops at {key} (A's entry {last + 1} of {len(rows)}, "
                    f"{where}): the {n} A {'entry' if n == 1 else 'entries'} after it "
                    f"{'was' if n == 1 else 'were'} set aside, not compared ({shown}); the "
                    f"runs may part there unseen"
                )
            return {
                "pass": int(p),
                "rank": int(rank),
                "last_compared": key,
                "position": last + 1,
                "of": int(len(rows)),
                "after": after,
                "text": text,
            }
        return None

    def _where(self, pass_: int, rank: int) -> str:
        """``pass P``, with ``, rank R`` when the reference has several ranks."""
        return f"pass {pass_}" + (f", rank {rank}" if len(self.a.ranks) > 1 else "")

    # -- answers ------------------------------------------------------------------------
    def first_divergence(
        self,
        threshold: float | str | dict | None = None,
        metric: str | None = None,
        structural: str = "diverge",
    ) -> Divergence | None:
        """The earliest entry, in the reference's (pass, order), past ``threshold``.

        Passes are compared in order and the search stops at the first pass
        that diverges: a divergence in pass 0 reads pass 0 only.

        Parameters
        ----------
        threshold : "auto", float or {regex: float or "auto"}, optional
            ``"auto"`` (the default, also ``None``): each entry's from its two
            dtypes, ``u/4`` for ``rel_diff`` with ``u`` the unit roundoff of
            the coarser one (float32 1.5e-8, bfloat16 9.8e-4; see
            :mod:`tdinspect.numerics.metrics`); metrics without a dtype-derived scale
            (``max_abs``...) keep their fixed default. A number is used for
            every entry; a dict sets thresholds by entry name (first matching
            regex wins; ``"auto"`` where none matches).
        metric : str, optional
            ``rel_diff`` (default), ``max_abs``, ``mean_abs``, ``max_rel``,
            ``cosine`` and ``sqnr_db`` (diverge below), ``mismatch``,
            ``equal`` (diverges when 0); ``stats_rel`` for statistics-only.
        structural : {"diverge", "report"}
            ``"diverge"``: an entry on one side only, unmatched or of another
            shape is a divergence. ``"report"``: such entries are set aside and
            listed in ``Divergence.structural_entries`` (those of the passes
            read) and the repr; the answer is the first numerical divergence
            (``None`` when there is none: :meth:`structural_entries` lists them all;
            an :class:`UncomparedWarning` then names A entries set aside after the
            last one compared, see :meth:`uncompared_after`).

        Returns
        -------
        Divergence or None

        Raises
        ------
        DumpFormatError
            When a record the divergence was read from fails its CRC-32 (a
            damaged pass file: the "divergence" may be the damage).
        """
        div, gap = self._answer(threshold, metric, structural)
        if gap is not None:
            warnings.warn(
                f"tdinspect: no numerical divergence, but {gap['text']}", UncomparedWarning, stacklevel=2
            )
        return div

    def _answer(self, threshold, metric, structural: str) -> tuple[Divergence | None, dict | None]:
        """:meth:`first_divergence`'s answer, and with ``structural="report"`` and no
        divergence, :meth:`uncompared_after` (else ``None``): said once by each caller."""
        if structural not in ("diverge", "report"):
            raise ValueError(f"structural={structural!r}: expected 'diverge' or 'report'")
        m = self._check_metric(metric)
        thr_fn = threshold_fn(threshold, m.name)
        report = structural == "report"
        aside = []
        best = None
        remaining: dict[int, int] = {}  # pass -> ranks not yet seen
        for job in self._jobs():
            remaining[job.pass_] = remaining.get(job.pass_, 0) + 1
        for (rank, p), rows in self.iter_passes(growing=True):
            remaining[p] -= 1
            hit = self._hits(rows, m, thr_fn)
            if report:
                layout = self._layout_rows(rows)
                aside.append(rows[layout])
                hit &= ~layout
            hits = np.flatnonzero(hit)
            if len(hits):
                n = int(hits[0])
                cand = (float(rows["order"].iat[n]), rank, n, rows)
                if best is None or cand[:2] < best[:2]:
                    best = cand
            if best is not None and remaining[p] == 0:
                break  # every rank of the first divergent pass is in: later passes stay unread
        if best is None:
            return None, self.uncompared_after(progress=False) if report else None
        _, rank, n, rows = best
        row = rows.iloc[n].to_dict()
        if not row["structural"] and self.mode == "tensor":
            self._check_records(row)
        located = "" if row["structural"] else self._locate(row, m, thr_fn(row))
        earlier = rows.iloc[max(0, n - BEFORE) : n]
        listed = None
        if report:
            listed = pd.concat(aside, ignore_index=True) if aside else pd.DataFrame(columns=COLUMNS)
            listed = listed.sort_values(["pass", "order", "rank"])[STRUCTURAL_COLUMNS].reset_index(drop=True)
        return divergence_of(
            row, m, thr_fn, list(zip(earlier["key"], earlier[m.name].astype(float))), listed, located
        ), None

    def _check_records(self, row: dict) -> None:
        """``DumpFormatError`` when a record the divergent ``row`` was read from fails its
        CRC-32: neither ``torch.load`` nor the record reader checks them, and a bit flipped on
        disk was answered as a divergence (``rel_diff 1`` at the entry holding it). One side
        after the other: with ISA-L's CRC (:mod:`tdinspect.store.crc`) two 4 MB records take about
        1 ms, less than starting the threads that checked them side by side before."""
        sides = [
            (pi, key)
            for pi, key in (
                (self.a._passes.get((row["rank"], row["pass"])), row["key"]),
                (self.b._passes.get((row["rank"], row["pass"])), row["key_b"]),
            )
            if isinstance(pi, PassIndex)
        ]  # not assembled ones (concat, unshard): other entries
        for pi, key in sides:
            bad = pi.damaged(key)
            if bad is not None:
                raise DumpFormatError(
                    f"{pi.files.tensors}: record {visible(bad)!r} (holding {visible(key)!r}) "
                    f"does not match its CRC-32: the file is damaged, and the divergence found "
                    f"at {visible(row['key'])!r} may be that damage (restore the file or "
                    "capture again)"
                )

    def _locate(self, row: dict, m, thr: float) -> str:
        """For an assembled entry (unshard, concat): the parts (ranks, calls) that differ."""
        if self.mapping is not None and self.mapping.partner(row["op"])[1] is not None:
            return ""  # B is transformed: its slices are no longer the shards' slices
        for side, key in ((self.b, row["key_b"]), (self.a, row["key"])):
            pi = side._passes.get((row["rank"], row["pass"]))
            node = pi.plans.get(key) if isinstance(pi, LogicalPass) else None
            if node and node["op"] == "sum" and _same_partials(pi, node):
                return (
                    f"; its {len(node['parts'])} partial sums ({', '.join(node['labels'])}) "
                    "are identical: already all-reduced? then it is replicated: give it "
                    "dims without 'partial'"
                )
            parts = slices_of(node, pi.source_shape) if node else []
            if len(parts) < 2:
                continue
            ya = self.a.get_pass(row["pass"], row["rank"]).tensor(row["key"])
            xb = self.b.get_pass(row["pass"], row["rank"]).tensor(row["key_b"])
            bad = []
            for label, spans, dim in parts:
                y = torch.cat([ya.narrow(dim, s, n) for s, n in spans], dim)
                x = torch.cat([xb.narrow(dim, s, n) for s, n in spans], dim)
                value = compare_tensors(x, y, chunk=self.chunk)[m.name]
                if m.diverges(value, thr):
                    bad.append(f"{label}: {m.name} {value:.3g}")
            if bad:
                return "; in " + ", ".join(bad)
        return ""

    def per_position(
        self,
        key: str,
        dim: int | str = 1,
        metric: str | None = None,
        threshold: float | str | dict | None = None,
    ) -> xr.DataArray:
        """The metric of one entry along ``dim``: where along the tokens two runs part.

        One value per position for each pass and call (and rank) where both
        sides hold the entry, each what :func:`tdinspect.numerics.metrics.compare_tensors`
        gives for the two slices (the one metric definition), all positions
        computed in one vectorised pass
        (:func:`tdinspect.numerics.metrics_split.compare_positions`). A RoPE or KV-cache bug
        shows as error from the first decode position on; a layer bug as error
        everywhere.

        Parameters
        ----------
        key : str
            Entry name (without ``::callN``; every call is computed).
        dim : int or str
            The position dim, or its name in the entry's dims (``"s"``).
        metric, threshold : optional
            Default: the diff's metric at ``"auto"`` (from the entry's dtypes,
            as :meth:`first_divergence`).

        Returns
        -------
        xarray.DataArray
            Dims ``pass``, ``call``, ``position`` (``rank`` first when several);
            NaN where a call is shorter. ``attrs["first_position"]`` is the
            first position past the threshold (-1 when none);
            ``attrs["threshold"]`` the threshold used (the first call's, should
            calls differ in dtype) and ``attrs["threshold_source"]`` where it
            came from (``""``: given).

        Examples
        --------
        >>> da = full.diff(decode, concat="call:1").per_position("model.layers.0.mlp", dim=1)  # doctest: +SKIP
        >>> da.attrs["first_position"]                                                      # doctest: +SKIP
        16
        """
        import xarray as xr

        from tdinspect.align.concat import dim_index

        m = self._check_metric(metric)
        if self.mode == "stats":
            raise ValueError("per_position compares tensors: a side is statistics-only")
        thr_fn = threshold_fn(threshold, m.name)
        base = split_call(key)[0]
        cells, skipped = [], []
        for (rank, p), rows in self.iter_passes():
            for row in rows[(rows["op"] == base) & (rows["key_b"] != "")].to_dict("records"):
                pa, pb = self.a.get_pass(p, rank), self.b.get_pass(p, rank)
                i = pa.position[row["key"]]
                ya, xb = pa.tensor(row["key"]), pb.tensor(row["key_b"])
                transform = self.mapping.partner(base)[1] if self.mapping is not None else None
                if transform is not None:
                    xb, why = _apply(transform, xb, ya)  # a failing transform: the diff's reason
                    if why:
                        skipped.append(f"pass {p} call {row['call']}: {why}")
                        continue
                if ya.shape != xb.shape:
                    skipped.append(f"pass {p} call {row['call']}: shape {list(ya.shape)} vs {list(xb.shape)}")
                    continue
                d = dim_index(dim, pa.dims[i], ya.dim(), row["key"])
                # positions first, once: each slice is then contiguous, in the same element order
                ya, xb = ya.movedim(d, 0).contiguous(), xb.movedim(d, 0).contiguous()
                values = compare_positions(xb, ya, m.name, chunk=self.chunk).tolist()
                cells.append(
                    (
                        rank,
                        p,
                        int(row["call"]),
                        values,
                        thr_fn.lookup(base, row["dtype_a"], row["dtype_b"], row.get("upstream", "") or ""),
                    )
                )
        if not cells:
            raise KeyError(
                f"{key!r}: no pass where both sides hold it with one shape"
                + (f" ({'; '.join(skipped[:3])})" if skipped else "")
            )
        ranks = sorted({c[0] for c in cells})
        passes = sorted({c[1] for c in cells})
        calls, call_ix = call_axis([c[2] for c in cells])
        npos = max(len(c[3]) for c in cells)
        data = np.full((len(ranks), len(passes), len(calls), npos), np.nan)
        thrs = np.full((len(ranks), len(passes), len(calls), 1), np.nan)
        for (rank, p, _, values, (t, _)), c in zip(cells, call_ix):
            data[ranks.index(rank), passes.index(p), c, : len(values)] = values
            thrs[ranks.index(rank), passes.index(p), c] = t
        with np.errstate(invalid="ignore"):
            over = data > thrs if m.higher_is_worse else data < thrs
        thr, source = cells[0][4]
        hit = np.flatnonzero(over.any(axis=(0, 1, 2)))
        da = xr.DataArray(
            data,
            dims=("rank", "pass", "call", "position"),
            coords={"rank": ranks, "pass": passes, "call": calls, "position": np.arange(npos)},
            name=m.name,
            attrs={
                "key": base,
                "dim": str(dim),
                "metric": m.name,
                "threshold": thr,
                "threshold_source": source,
                "first_position": int(hit[0]) if len(hit) else -1,
            },
        )
        return da.isel(rank=0, drop=True) if len(ranks) == 1 else da

    def table(self, progress: bool | None = None) -> pd.DataFrame:
        """Every compared entry as a ``pandas.DataFrame`` (reads every pass).

        ``progress``: a bar when True; by default only in a terminal (see :mod:`tdinspect.util.progress`).
        """
        from tdinspect.util.progress import bar

        keys = list(bar(self._computed(), progress, total=len(self._jobs()), desc="diff"))
        if not (self._want_stats_rel and self.mode == "tensor"):
            whole = self._results.joined(keys)  # one frame, not one a pass and their concat
            if whole is not None:
                return whole
        frames = [f for _, f in self.iter_passes() if len(f)]  # cached now: nothing computed
        if not frames:
            return pd.DataFrame(columns=COLUMNS)
        return pd.concat(frames, ignore_index=True)

    def divergences(
        self,
        threshold: float | str | dict | None = None,
        metric: str | None = None,
        progress: bool | None = None,
    ) -> pd.DataFrame:
        """All divergent entries in execution order, with their reasons (a DataFrame).

        ``threshold`` as for :meth:`first_divergence` (``"auto"`` by default);
        the column ``threshold`` holds each entry's."""
        m = self._check_metric(metric)
        thr_fn = threshold_fn(threshold, m.name)
        df = self.table(progress)
        df["threshold"] = thr_fn.of_rows(df)
        df["diverges"] = self._hits(df, m, thr_fn)
        df = df[df["diverges"]].sort_values(["pass", "order", "rank"]).reset_index(drop=True)
        df["why"] = [reason_of(r, m, thr_fn) for r in df.to_dict("records")]
        return df

    def growth(self, metric: str | None = None, progress: bool | None = None, *, all_entries: bool = False):
        """The entries that add error: how much each grows the largest error before it (per pass).

        ``growth = error / max(error of earlier entries)``: an op that
        *introduces* error stands out (large growth) from those that inherit
        it. Only entries whose error exceeds every earlier one (``added > 0``)
        are listed, unless ``all_entries``. ``cosine`` and ``sqnr_db`` are
        turned into errors (``1 - cosine``, ``10**(-sqnr/10)``) first.

        Examples
        --------
        >>> diff.growth().sort_values("growth", ascending=False).head(3)   # doctest: +SKIP
        """
        df = _with_growth(self.table(progress), self._check_metric(metric).name)
        if not all_entries:
            df = df[df["added"] > 0].reset_index(drop=True)
        return df[["rank", "pass", "order", "key", "error", "prev_max", "growth", "added"]]

    def nearest(
        self,
        threshold: float | str | dict | None = None,
        metric: str | None = None,
        progress: bool | None = None,
    ) -> dict | None:
        """The entry that came closest to diverging: what to look at when nothing diverges.

        A real fault can stay under a threshold: ``rel_diff`` is second order in the
        error (a 1% scale error gives about 5e-5, under float16's ``"auto"`` 1.2e-4).
        The entry with the largest share of its threshold is named, with its
        :meth:`growth` (its error over the largest one before it in its pass: an
        entry that makes the error, not inherits it, stands out by orders of
        magnitude). Structural entries are left out (they always diverge).

        Returns
        -------
        dict or None
            ``key``, ``pass``, ``rank``, ``call``, ``value`` (the metric), ``threshold``,
            ``share`` (of the threshold, as errors: ``1 - cosine`` for cosine), ``growth``
            (``None`` for the first error of its pass) and ``text`` (a line saying all
            that); ``None`` when every entry is identical or has no threshold above 0.

        Examples
        --------
        >>> diff.nearest()["text"]   # doctest: +SKIP
        'model.model.layers.1.mlp.down_proj (pass 0): rel_diff 5e-05, 41% of its threshold 0.000122; 238x the largest error before it in its pass'
        """
        m = self._check_metric(metric)
        thr_fn = threshold_fn(threshold, m.name)
        df = _with_growth(self.table(progress), m.name)
        df = df[~df["structural"].astype(bool)].reset_index(drop=True)
        if df.empty:
            return None
        df["threshold"] = thr_fn.of_rows(df)
        limit = _as_error(m.name, df["threshold"])
        share = (df["error"] / limit.where(limit > 0)).replace([np.inf, -np.inf], np.nan)
        if not (share > 0).any():
            return None
        row = df.loc[share.idxmax()]
        growth = float(row["growth"]) if row["prev_max"] > 0 else None
        value, thr, part = float(row[m.name]), float(row["threshold"]), float(share.max())
        q = digits_apart(value, thr)  # cosine 0.99998 against 0.999, never "1"
        text = (
            f"{row['key']} ({self._where(row['pass'], row['rank'])}): {m.name} "
            f"{value:.{q}g}, {part * 100:.2g}% of its threshold {thr:.{q}g}; "
            + (
                f"{growth:.3g}x the largest error before it in its pass"
                if growth
                else "the first error of its pass"
            )
        )
        return {
            "key": row["key"],
            "pass": int(row["pass"]),
            "rank": int(row["rank"]),
            "call": int(row["call"]),
            "value": value,
            "threshold": thr,
            "share": part,
            "growth": growth,
            "text": text,
        }

    def introduced(self, metric: str | None = None, progress: bool = True) -> pd.DataFrame:
        """Modules ranked by the error they make themselves, largest first.

        Meant for a B run captured under ``tdinspect.graft(model, A,
        what="inputs")``: every grafted module received A's inputs, so the
        error of its output is its own, not inherited. (On an ordinary diff
        this ranks accumulated error instead.) Inputs, parameters and
        gradients are left out; a module's error is the largest over its
        outputs, calls and passes, structural problems counting as ``inf``.

        Returns
        -------
        pandas.DataFrame
            One row per module: ``module``, ``error`` (``1 - cosine`` and
            ``10**(-sqnr/10)`` for those metrics), ``key``, ``pass``, ``call``
            and ``reason`` of its worst entry.

        Examples
        --------
        >>> DumpSet.open("runs/a").diff("runs/b_grafted").introduced().head(3)  # doctest: +SKIP
        """
        m = self._check_metric(metric)
        df = self.table(progress)
        kinds = []
        for rank, p, key in zip(df["rank"], df["pass"], df["key"]):
            pi = self.a._passes.get((rank, p))
            i = pi.position.get(key) if pi is not None else None
            kinds.append(pi.kind[i] if i is not None and pi.kind else None)
        df = df[[k in (None, "output") for k in kinds]].copy()
        df["error"] = _as_error(m.name, df[m.name]).where(~df["structural"].astype(bool), np.inf)
        df["module"] = [_module_of(op) for op in df["op"]]
        df = df.sort_values("error", ascending=False, na_position="last", kind="stable")
        worst = df.drop_duplicates("module")
        return worst[["module", "error", "key", "pass", "call", "reason"]].reset_index(drop=True)

    def by_rank_pass(self, threshold: float | str | dict | None = None, metric: str | None = None):
        """Per (rank, pass): how many entries diverge, the first of them and its reason.

        A ``pandas.DataFrame`` indexed by ``(rank, pass)`` with columns
        ``n_entries``, ``n_divergent``, ``first`` (key, ``""`` when none),
        ``why`` and ``worst`` (largest metric value): which ranks and steps
        part first, at a glance (reads every pass). ``threshold`` as for
        :meth:`first_divergence` (``"auto"`` by default).
        """
        m = self._check_metric(metric)
        thr_fn = threshold_fn(threshold, m.name)
        out = []
        for (rank, p), rows in self.iter_passes():
            hits = np.flatnonzero(self._hits(rows, m, thr_fn))
            values = rows[m.name].to_numpy(float)
            values = values[~np.isnan(values)]
            worst = (values.max() if m.higher_is_worse else values.min()) if len(values) else math.nan
            first = rows.iloc[hits[0]].to_dict() if len(hits) else None
            out.append(
                {
                    "rank": rank,
                    "pass": p,
                    "n_entries": len(rows),
                    "n_divergent": len(hits),
                    "first": first["key"] if first else "",
                    "why": reason_of(first, m, thr_fn) if first else "",
                    "worst": float(worst),
                }
            )
        return pd.DataFrame(out).set_index(["rank", "pass"]).sort_index()

    def to_xarray(self) -> xr.Dataset:
        """Metrics as a Dataset with the reference cube's dims (``op``, ``call``, ``pass``[, ``rank``])."""
        df = self.table()
        ops = list(dict.fromkeys(df["op"]))
        ranks = sorted(df["rank"].unique().tolist()) or [0]
        passes = sorted(df["pass"].unique().tolist())
        calls, call_ix = call_axis(df["call"].to_numpy())
        shape = (len(ranks), len(ops), len(calls), len(passes))
        ix = (
            df["rank"].map({r: i for i, r in enumerate(ranks)}).to_numpy(),
            df["op"].map({o: i for i, o in enumerate(ops)}).to_numpy(),
            call_ix,
            df["pass"].map({p: i for i, p in enumerate(passes)}).to_numpy(),
        )
        dims = ("rank", "op", "call", "pass")
        variables = {}
        for name in (*ROW_METRICS, "order"):
            arr = np.full(shape, np.nan)
            arr[ix] = df[name].to_numpy(dtype=float)
            variables[name] = (dims, arr)
        for name in ("reason", "dtype_a", "dtype_b"):
            arr = np.full(shape, "", dtype=object)
            arr[ix] = df[name].to_numpy(dtype=object)
            variables[name] = (dims, arr)
        import xarray as xr  # lazily: the CLI's answers need no cube (0.26 s)

        ds = xr.Dataset(
            variables,
            coords={"rank": ranks, "op": ops, "call": calls, "pass": passes},
            attrs={"a": str(self.a.path), "b": str(self.b.path), "mode": self.mode, "align": self.align},
        )
        return ds.isel(rank=0, drop=True) if len(ranks) == 1 else ds

    def summary(self, threshold=None, metric=None, structural: str = "diverge") -> dict[str, Any]:
        div, gap = self._answer(threshold, metric, structural)  # the gap is in the answer here
        name = div.metric if div else (metric or self.default_metric)
        out = {
            "a": str(self.a.path),
            "b": str(self.b.path),
            "mode": self.mode,
            "align": self.align,
            "metric": name,
            "threshold": self.threshold_text(threshold, name),
            "first_divergence": None
            if div is None
            else {
                "op": div.op,
                "call": div.call,
                "pass": div.pass_,
                "rank": div.rank,
                "key": div.key,
                "value": _num(div.value),
                "threshold": div.threshold,
                "reason": div.reason,
                "structural": div.structural,
            },
        }
        if div is None:
            out["nearest"] = self.nearest(threshold, name, progress=False)
        if structural == "report":
            se = div.structural_entries if div is not None else self.structural_entries(False)
            out["structural_entries"] = se[["rank", "pass", "key", "key_b", "reason"]].to_dict("records")
            if div is None:
                out["uncompared_after"] = gap
        return out

    def threshold_text(self, threshold=None, metric: str | None = None) -> str:
        """``threshold`` in words (:meth:`Thresholds.describe`), with the ``"auto"`` values of
        the dtypes compared so far."""
        read = [f for f in self._results.values() if len(f)]
        return threshold_fn(threshold, metric or self.default_metric).describe(
            pd.concat(read) if read else None
        )

    def __repr__(self) -> str:
        return self.headline()

    def headline(self, metric: str | None = None, threshold="auto") -> str:
        """The repr, with the ``"auto"`` rule of ``metric`` (default: the diff's own) when
        ``threshold`` is ``"auto"`` (an explicit one is described by the caller)."""
        head = (
            f"Diff(A={str(self.a.path)!r} (reference), B={str(self.b.path)!r}, "
            f"mode={self.mode}, align={self.align}"
        )
        if threshold is not None and not (isinstance(threshold, str) and threshold == AUTO):
            return head + ")"
        return f"{head}, threshold: auto by default ({auto_rule(metric or self.default_metric)}))"

    def _repr_html_(self) -> str:
        from tdinspect.report import diff_html

        return diff_html(self)


# -- the divergence rule (one definition: Diff's answers and live comparison use it) ---------
BEFORE = 5  # entries listed before a divergence


class Thresholds:
    """The threshold of each row: ``"auto"`` (the default), a number, or ``{regex: value}``.

    ``"auto"`` (or ``None``) derives a row's threshold from its ``dtype_a`` and
    ``dtype_b`` (:func:`tdinspect.numerics.metrics.auto_threshold`, the one rule); a
    number is used for every row; a dict gives the value of the first regex
    matching the entry name (a value may be ``"auto"``), ``"auto"`` where none
    matches. Call it on a row (a mapping with ``op``, ``dtype_a``,
    ``dtype_b``) for the number; :meth:`of_rows` gives a whole frame's.

    Examples
    --------
    >>> t = Thresholds("auto", "rel_diff")
    >>> t({"op": "model.fc", "dtype_a": "torch.float32", "dtype_b": "torch.float32"})
    1.4901161193847656e-08
    >>> Thresholds({"fc": 1e-3}, "rel_diff").source({"op": "model.fc", "dtype_a": "", "dtype_b": ""})
    ''
    """

    def __init__(self, threshold, metric_name: str):
        self.metric = metric(metric_name)
        self.spec = AUTO if threshold is None else threshold
        self.fixed: float | None = None
        self.rules: list[tuple[re.Pattern, float | None]] = []  # None: "auto"
        if isinstance(threshold, str) and threshold != AUTO:
            raise ValueError(
                f"threshold={threshold!r}: expected 'auto', a number or a {{regex: number}} dict"
            )
        if isinstance(threshold, dict):
            self.rules = [
                (_valid_regex(k), None if v == AUTO else _valid_threshold(v, k)) for k, v in threshold.items()
            ]
        elif threshold is not None and threshold != AUTO:
            if not isinstance(threshold, (int, float)) or isinstance(threshold, bool):
                raise TypeError(
                    f"threshold must be 'auto', a number or a {{regex: number}} dict, got {threshold!r}"
                )
            self.fixed = _valid_threshold(threshold)
        self._cache: dict[tuple, tuple[float, str]] = {}

    def lookup(self, op: str, dtype_a, dtype_b, upstream="") -> tuple[float, str]:
        """``(threshold, source)`` of one entry: source ``""`` for a number given,
        ``"auto: <dtype>"``, ``"auto: <dtype> upstream"`` or ``"default"`` for ``"auto"``.
        ``upstream``: the coarsest floating dtype the pair's data has been through
        (:func:`upstream_of`), used when it is coarser than the entry's own."""
        if self.fixed is not None:
            return self.fixed, ""
        key = (op, dtype_a, dtype_b, upstream) if self.rules else (dtype_a, dtype_b, upstream)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._resolve(op, dtype_a, dtype_b, upstream)
        return hit

    def _resolve(self, op, dtype_a, dtype_b, upstream) -> tuple[float, str]:
        for pattern, value in self.rules:
            if pattern.search(op):
                if value is not None:
                    return value, ""
                break
        value, source = auto_threshold(self.metric.name, dtype_a or "", dtype_b or "")
        if not source.startswith("auto: ") or not upstream:
            return value, source
        own = max(unit_roundoff(dtype_a), unit_roundoff(dtype_b))
        # an integer result is exact whatever it was computed from; a float one carries
        # the error of the coarsest rounding its inputs went through
        if own and (unit_roundoff(upstream) or 0.0) > own:
            return auto_threshold(self.metric.name, upstream, upstream)[0], f"auto: {upstream} upstream"
        return value, source

    @staticmethod
    def _args(row) -> tuple:
        return (row["op"], row.get("dtype_a", ""), row.get("dtype_b", ""), row.get("upstream", "") or "")

    def __call__(self, row) -> float:
        return self.lookup(*self._args(row))[0]

    def source(self, row) -> str:
        """Where ``row``'s threshold came from (``""``: a number given)."""
        return self.lookup(*self._args(row))[1]

    def of_rows(self, rows: pd.DataFrame) -> np.ndarray:
        """The thresholds of a frame's rows (vectorised over distinct names and dtypes)."""
        n = len(rows)
        if self.fixed is not None:
            return np.full(n, self.fixed)
        da, db = rows["dtype_a"].to_numpy(object), rows["dtype_b"].to_numpy(object)
        up = rows["upstream"].to_numpy(object) if "upstream" in rows else np.full(n, "", object)
        ops = rows["op"].to_numpy(object) if self.rules else np.full(n, "", object)
        return np.fromiter((self.lookup(o, a, b, u)[0] for o, a, b, u in zip(ops, da, db, up)), float, n)

    def given(self) -> str:
        """The threshold as given, short: ``1e-05``, ``auto``, ``fc=0.001, else auto``.

        Examples
        --------
        >>> Thresholds({"fc": 1e-3, "norm": "auto"}, "rel_diff").given()
        'fc=0.001, norm=auto, else auto'
        """
        if self.fixed is not None:
            return f"{self.fixed:g}"
        if not self.rules:
            return "auto"
        return (
            ", ".join(f"{p.pattern}={'auto' if v is None else f'{v:g}'}" for p, v in self.rules)
            + ", else auto"
        )

    def describe(self, rows: pd.DataFrame | None = None) -> str:
        """The threshold in words: the number, or ``auto (rule; dtype value, ...)`` with the
        values of the dtypes in ``rows``."""
        if self.fixed is not None:
            return self.given()
        rule = auto_rule(self.metric.name)
        values = {}
        if rows is not None and len(rows):
            up = rows["upstream"] if "upstream" in rows else [""] * len(rows)
            auto = Thresholds(AUTO, self.metric.name)
            for a, b, u in dict.fromkeys(zip(rows["dtype_a"], rows["dtype_b"], up)):
                value, source = auto.lookup("", a, b, u or "")
                if source.startswith("auto: "):
                    values.setdefault(source[6:], value)
        shown = "; ".join(f"{d} {_thr_text(v)}" for d, v in values.items())
        return f"{self.given()} ({rule}" + (f": {shown}" if shown else "") + ")"


def _pass_rows(rows: list[dict[str, Any]]):
    """One pass's rows as :data:`COLUMNS` plus ``upstream``: typed columns
    (:mod:`tdinspect.compare.passframes`), or the DataFrame pandas makes of them where they mix kinds."""
    with paused():  # as compare_pass: a list or array a column, an object a row in it
        columns = typed_columns(rows, COLUMNS)
        if columns is None:
            frame = pd.DataFrame(rows, columns=COLUMNS)
            frame["upstream"] = upstream_of(frame["dtype_a"], frame["dtype_b"])
            return frame
        columns["upstream"] = upstream_of(columns["dtype_a"], columns["dtype_b"])
        return columns


def upstream_of(dtype_a, dtype_b) -> np.ndarray:
    """The coarsest floating dtype each row's data has been through (names, ``""``: none).

    ``dtype_a`` and ``dtype_b`` are the two sides' dtypes of one (rank, pass),
    in execution order: for each side, the coarsest floating dtype among its
    entries up to and including the row (a cumulative maximum of the unit
    roundoff), and of the two sides the coarser. Integer, bool and unknown
    dtypes do not count. A float32 op on a bfloat16 model's values (an
    upcast RMSNorm, a rotary buffer) gets ``"bfloat16"``.

    Examples
    --------
    >>> upstream_of(["torch.bfloat16", "torch.float32"], ["torch.float32", "torch.float32"]).tolist()
    ['bfloat16', 'bfloat16']
    """
    da, db = np.asarray(dtype_a, object), np.asarray(dtype_b, object)
    n = len(da)
    if not n:
        return np.array([], object)
    codes, distinct = pd.factorize(np.concatenate([da, db]))
    u = np.array(
        [(unit_roundoff(d) or 0.0) if isinstance(d, str) and d else 0.0 for d in distinct] + [0.0]
    )  # code -1 (missing): 0
    name_of = {0.0: ""}
    for d, ud in zip(distinct, u.tolist()):
        if ud:
            dt = dtype_named(d)
            name_of.setdefault(ud, str(dt.to_real() if dt.is_complex else dt).removeprefix("torch."))
    per_row = u[codes]
    up = np.maximum(np.maximum.accumulate(per_row[:n]), np.maximum.accumulate(per_row[n:]))
    us = np.array(sorted(name_of))
    return np.array([name_of[x] for x in us.tolist()], object)[np.searchsorted(us, up)]


def threshold_fn(threshold, metric_name: str) -> Thresholds:
    """The per-row threshold of ``threshold`` for ``metric_name`` (see :class:`Thresholds`)."""
    return threshold if isinstance(threshold, Thresholds) else Thresholds(threshold, metric_name)


def _thr_digits(value: float, digits: int) -> int:
    """At least ``digits``, and enough to tell ``value`` from 1 (cosine's ``1 - u/4``)."""
    while digits < 17 and value != 1 and float(f"{value:.{digits}g}") == 1:
        digits += 1
    return digits


def _thr_text(value: float) -> str:
    """A threshold with the digits that make it the number used: 3 significant digits
    (``1.49e-08``, ``75.3``, as the reasons show), and 3 of ``1 - value`` near 1
    (cosine's ``0.999878``, not ``0.9999``)."""
    if 0.9 < value < 1:
        return f"{value:.{min(17, 3 + math.floor(-math.log10(1 - value)))}g}"
    if 1 < abs(value) < 1e15 and value != int(value):  # sqnr_db: one decimal, 162.6 dB
        return f"{value:.{max(3, len(str(int(abs(value)))) + 1)}g}"
    return f"{value:.{_thr_digits(value, 3)}g}"


def divergent(m, values, thresholds, structural, explained) -> np.ndarray:
    """Which rows diverge (a boolean array; scalars work too): the one rule every answer uses.

    Structural problems always do; rows with another reason (never compared,
    e.g. uninitialized) never do; the rest when their metric passes the
    threshold in its bad direction, or could not be computed (NaN: never a
    silent pass).
    """
    values, thresholds = np.asarray(values, float), np.asarray(thresholds, float)
    with np.errstate(invalid="ignore"):
        over = values > thresholds if m.higher_is_worse else values < thresholds
    return np.asarray(structural, bool) | ((over | np.isnan(values)) & ~np.asarray(explained, bool))


def reason_of(row, m, thr_fn) -> str:
    """The reason text of a row :func:`divergent` marked (with where an ``"auto"``
    threshold came from: ``rel_diff 5.08e-05 > 1.49e-08 (auto: float32)``)."""
    if row["structural"]:
        return row["reason"]
    value = row[m.name]
    if value is None or math.isnan(value):
        return f"{m.name} could not be computed"
    thr_fn = threshold_fn(thr_fn, m.name)
    thr, source = thr_fn.lookup(*thr_fn._args(row))
    op = ">" if m.higher_is_worse else "<"
    q = digits_apart(value, thr)
    if not source:  # a number given: as it was written (never rounded to 1)
        return f"{m.name} {value:.{q}g} {op} {thr:.{_thr_digits(thr, 6)}g}"
    return f"{m.name} {value:.{q}g} {op} {thr:.{q}g} ({source})"


def digits_apart(value: float, thr: float) -> int:
    """Significant digits (at least 3) that show ``value`` and ``thr`` apart, and neither
    as 1 unless it is: ``cosine 0.99999773 < 0.99999999``."""
    for p in range(3, 18):
        q = _thr_digits(thr, p)
        if f"{value:.{q}g}" != f"{thr:.{q}g}":
            return q
    return q


def divergence_of(row: dict, m, thr_fn, before: list, listed=None, located: str = "") -> Divergence:
    """The :class:`Divergence` of a divergent row; ``before``: ``(key, value)`` of the entries
    just before it; ``listed``: structural entries set aside (``structural="report"``);
    ``located``: which parts of an assembled entry differ."""
    return Divergence(
        row["op"],
        int(row["call"]),
        int(row["pass"]),
        int(row["rank"]),
        row["key"],
        m.name,
        float(row[m.name]),
        thr_fn(row),
        reason_of(row, m, thr_fn) + located,
        float(row["order"]),
        bool(row["structural"]),
        before,
        row,
        listed,
    )


def _valid_threshold(value, pattern: str | None = None) -> float:
    where = f"threshold for {pattern!r}" if pattern is not None else "threshold"
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if math.isnan(out):
        raise ValueError(f"{where}: NaN compares false with everything (nothing would diverge)")
    return out


def _valid_regex(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"threshold regex {pattern!r}: {exc}") from None


def _num(v: float):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v
