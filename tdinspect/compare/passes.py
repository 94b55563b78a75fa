"""One pass's rows: every entry of a pass pair paired, compared, and hinted.

A :class:`PassJob` is one (rank, pass) of both sides; :func:`compare_pass` turns
it into rows of :data:`~tdinspect.compare.rule.COLUMNS`: the pairs of
:func:`~tdinspect.compare.pairing.pairs`, one-sided entries with why they
have no partner, plain pairs through the fast paths
(:mod:`~tdinspect.compare.smallpairs`, :mod:`~tdinspect.compare.plainpairs`,
the same numbers), the rest through :func:`~tdinspect.compare.rule.compare_pair`,
and shape mismatches that are decode calls end to end said so.
:func:`pass_frame` keeps a pass's rows as typed columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from tdinspect.align.logical import LogicalPass
from tdinspect.align.mapping import mapped_key, quoted_rule
from tdinspect.compare.padrows import compare_real_rows
from tdinspect.compare.pairing import pairs, unchanged_since
from tdinspect.compare.passframes import typed_columns
from tdinspect.compare.plainpairs import compare_plain, plain_dtypes
from tdinspect.compare.replicas import check_replicas
from tdinspect.compare.routing import judge_routing
from tdinspect.compare.rule import COLUMNS, compare_pair, new_row, side_of
from tdinspect.compare.smallpairs import compare_batch, pass_spans, small_plain
from tdinspect.compare.spanpairs import compare_spans, span_dtypes
from tdinspect.compare.thresholds import upstream_of
from tdinspect.naming import split_call
from tdinspect.store.passindex import PassIndex
from tdinspect.util.gcpause import paused


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
    # each side's same pass in its other ranks, where the other side has fewer ranks: a
    # shape mismatch that is a tensor-parallel shard says so (_hint_shards)
    peers_a: tuple = ()
    peers_b: tuple = ()
    pattern_b: Any = None  # B's selection (DumpSet.filter / sel on B): honoured as A's is

    def keep(self, key: str) -> bool:
        """Whether A's selection keeps entry ``key``."""
        return self.pattern is None or bool(self.pattern.search(split_call(key)[0]))

    @property
    def keep_b(self):
        """B's selection as a test of an entry name, or ``None`` when B keeps every entry."""
        pattern = self.pattern_b
        return None if pattern is None else (lambda key: bool(pattern.search(split_call(key)[0])))

    def transform(self, a_key: str):
        return None if self.mapping is None else self.mapping.partner(split_call(a_key)[0])[1]

    def cut_short(self, ia: int | None, ib: int | None) -> str:
        """Where the side lacking the entry (B when ``ib`` is None) had its pass cut short by an
        error (its sidecar's ``failed``): why it never reached the entry; ``""`` else."""
        lacking = self.b if ib is None else self.a
        failed = getattr(lacking, "failed", None)
        if not failed:
            return ""
        side = "B" if ib is None else "A"
        return f"not reached in {side}: its pass was cut short by an error ({str(failed)[:120]})"

    def unmatched(self, ia: int | None, ib: int | None) -> str:
        """Why entry ``ia`` of A (``ib`` None) or ``ib`` of B (``ia`` None) has no partner."""
        if self.missing_reason:
            return self.missing_reason
        side = "A" if ib is None else "B"
        if self.align == "sequence":
            return f"unmatched in {side}"
        if side == "A" and self.mapping is not None:
            base = split_call(self.a.keys[ia])[0]
            rule = self.mapping.rule_of(base)
            if rule:
                return f"only in A (its rule '{quoted_rule(rule)}' names '{mapped_key(self.mapping, self.a.keys[ia])}', not in B)"
        return f"only in {side}"


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
    check_replicas(rows, job, (loaded_a, loaded_b))  # a recompute on one side: against its original
    if job.mode == "tensor":
        judge_routing(
            rows,
            pa,
            pb,
            lambda k: pa.tensor(k, loaded_a()),
            lambda k: pb.tensor(k, loaded_b()),
            job.chunk,
        )
        compare_real_rows(
            rows, pa, pb, lambda k: pa.tensor(k, loaded_a()), lambda k: pb.tensor(k, loaded_b()), job.chunk
        )
    _hint_concat(rows, pa, pb)
    _hint_shards(rows, job)
    return rows


def _plain_first(job: PassJob, files: dict[str, Any], loaders) -> tuple[list, list]:
    """A pass's rows, those of its plain pairs filled (the small ones together:
    :mod:`tdinspect.compare.smallpairs`, the larger from the files' bytes: :mod:`tdinspect.compare.plainpairs`;
    same numbers); and the pairs left for ``compare_pair``: ``(row, i_a, i_b, transform)``.
    ``files`` gets each side's tensors where the records were read; ``loaders`` load them."""
    pa, pb = job.a, job.b
    rows, batch, plain, spanned, single = [], [], [], [], []
    plain_a, plain_b = (plain_dtypes(p) if job.mode == "tensor" and p is not None else None for p in (pa, pb))
    span_a, span_b = (span_dtypes(p) if job.mode == "tensor" else None for p in (pa, pb))
    small_a, small_b = (
        None if plain is None else small_plain(p, plain) for p, plain in ((pa, plain_a), (pb, plain_b))
    )
    for ia, ib, order in pairs(pa, pb, job.keep, job.align, job.mapping, job.keep_b):
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
            cut = job.cut_short(ia, ib)  # never compared, not a structural divergence
            row.update(structural=not cut, reason=cut or job.unmatched(ia, ib))
            continue
        if not (pa.uninitialized[ia] or pb.uninitialized[ib]):
            same = unchanged_since(pa, ia, pb, ib)
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
        elif (
            span_a is not None
            and span_b is not None
            and span_a[ia] is not None
            and span_a[ia] == span_b[ib]
            and pa.shape[ia] == pb.shape[ib]
            and transform is None
        ):
            spanned.append((row, ia, ib))
        else:
            single.append((row, ia, ib, transform))
    single += [(row, ia, ib, None) for row, ia, ib in compare_spans(spanned, pa, pb)]
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
            if total == size:  # shapes only: no value was read, so no claim that they match
                row["reason"] += (
                    f"{head} have {other}'s shape; compare after .concat('call', "
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


def _hint_shards(rows: list[dict[str, Any]], job: PassJob) -> None:
    """Say so where a shape mismatch is one side's tensor-parallel shard: that side holds
    the entry in several ranks whose shapes along one dim add up to the other side's, or
    records parallel coordinates (compare with ``unshard=True``)."""
    mismatched = [r for r in rows if r["structural"] and r["reason"].startswith("shape ")]
    if not mismatched or not (job.peers_a or job.peers_b):
        return
    for row in mismatched:
        for side, mine, peers, key, other, theirs in (
            ("B", job.b, job.peers_b, row["key_b"] or row["key"], job.a, row["key"]),
            ("A", job.a, job.peers_a, row["key"], job.b, row["key_b"] or row["key"]),
        ):
            if not peers or mine is None or other is None:
                continue
            shapes = [pi.shape[pi.position[key]] for pi in (mine, *peers) if key in pi.position]
            target = other.shape[other.position[theirs]] if theirs in other.position else None
            axes = [a for a, (_i, size) in sorted(mine.parallel.items()) if size > 1]
            found = _concat_dim(shapes, [target])  # None unless two or more shapes
            adds_up = found is not None and found[1] == found[2]
            if not (adds_up or axes):
                continue
            held = f"{side} holds this entry in {len(shapes)} ranks" + (
                f" ({', '.join(axes)})" if axes else ""
            )
            row["reason"] += f" ({held}; compare with unshard=True / --unshard)"
            break


def rank_hint(pi: PassIndex | None) -> str:
    """What to add to ``rank R only in B`` where that rank records parallel coordinates
    (a pipeline stage, a tensor-parallel shard): the ranks meet the other side's once
    unsharded (pipeline stages entry by entry, by name), or ``""``."""
    axes = [a for a, (_i, size) in sorted((getattr(pi, "parallel", None) or {}).items()) if size > 1]
    if not axes:
        return ""
    return f" (a {', '.join(axes)} rank: compare with unshard=True / --unshard)"


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


def _open(pi: PassIndex):
    """A pass's tensors for comparing entry by entry (assembled ones into reused buffers)."""
    return pi.load(scratch=True) if isinstance(pi, LogicalPass) else pi.load()


def pass_frame(rows: list[dict[str, Any]]):
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


def cut_short(a, b, rank: int, pass_: int, where) -> list[str]:
    """For each side whose pass ``pass_`` of ``rank`` an error cut short (its sidecar's
    ``failed``): a sentence saying so. Such a pass never makes a verdict "matches": what ran
    may agree, but the rest of the forward never ran (``a`` and ``b``: the DumpSets;
    ``where(pass_, rank)`` names the pass)."""
    out = []
    for name, side in (("A", a), ("B", b)):
        failed = getattr(side.pass_map.get((rank, pass_)), "failed", None)
        if failed:
            out.append(f"{where(pass_, rank)} of {name} was cut short by an error ({str(failed)[:120]})")
    return out
