"""Copies within one side: a one-sided call that repeats an earlier call (a recompute).

Activation checkpointing runs a module's forward again during backward, so the checkpointed
side holds ``fc1::call1`` where the other holds ``fc1`` alone. Set aside as "only in B", the
recompute was never looked at: with ``allow_uncompared="fc1"`` a recompute 0.1 off its
original read "matches". A replica is data: a module-level call one side alone holds, whose
entry that side called earlier in the same pass with the same shape and dtype, is compared
with the nearest of those earlier calls, on its own side. The row is then judged by the diff's
metric and threshold like any other (it counts as compared); a disagreement diverges as
``B's fc1::call1 differs from its call 0 (a recompute?)``.

Op-level entries and sequence alignment are left as they were: the same op on the same shape
is called many times for different things, and an unmatched op is no copy.

Examples
--------
>>> replica_reason("B", 0)
"compared with B's call 0: a recompute on one side"
"""

from __future__ import annotations

import math
from typing import Any

from tdinspect.compare.rule import compare_pair, side_of
from tdinspect.compare.thresholds import REPLICA
from tdinspect.naming import parse_key, split_call
from tdinspect.numerics.metrics import stats_rel

CANDIDATES = 16  # earlier calls a copy is compared with, nearest first (a model called many times)


def replica_reason(side: str, call: int) -> str:
    """The reason of a row compared with its own side's call ``call`` (:data:`REPLICA` first)."""
    return f"{REPLICA}{side}'s call {call}: a recompute on one side"


def check_replicas(rows: list[dict[str, Any]], job, loaders) -> None:
    """Compare each one-sided copy among a pass's ``rows`` with its side's earlier call.

    ``job`` is the :class:`~tdinspect.compare.passes.PassJob`; ``loaders`` the two sides'
    pass files (``(loaded_a, loaded_b)``, opened on first use). A row is changed in place
    only when its side called its entry before with the same shape and dtype.
    """
    if job.missing_reason or job.align == "sequence" or job.a is None or job.b is None:
        return
    for row in rows:
        if not row["structural"]:
            continue
        reason = row["reason"]
        if reason in ("only in B",):
            side, pi, key, loaded = "B", job.b, row["key_b"], loaders[1]
        elif reason.startswith("only in A"):
            side, pi, key, loaded = "A", job.a, row["key"], loaders[0]
        else:
            continue
        earlier = _earlier_copies(pi, key)
        if earlier:
            _compare_copy(row, side, pi, pi.position[key], earlier, loaded, job)


def _module_level(key: str) -> bool:
    try:
        return not parse_key(key).op
    except ValueError:
        return True


def _earlier_copies(pi, key: str) -> list[int]:
    """Positions of the calls of ``key``'s entry before it in ``pi``, with its shape and dtype,
    nearest first."""
    base, call = split_call(key)
    i = pi.position.get(key)
    if not call or i is None or not _module_level(key) or pi.uninitialized[i] or pi.shape[i] is None:
        return []
    found = []
    for c in range(call - 1, -1, -1):
        j = pi.position.get(base if c == 0 else f"{base}::call{c}")
        if (
            j is not None
            and pi.shape[j] == pi.shape[i]
            and pi.dtype[j] == pi.dtype[i]
            and not pi.uninitialized[j]
        ):
            found.append(j)
            if len(found) == CANDIDATES:
                break
    return found


def _compare_copy(row, side: str, pi, i: int, earlier: list[int], loaded, job) -> None:
    """Fill ``row`` with entry ``i`` against the nearest (in the metric) of its ``earlier`` calls."""
    mine = side_of(pi, i, loaded, side)
    name = "stats_rel" if job.mode == "stats" else "rel_diff"
    best = None
    for j in earlier:
        trial = dict(row, structural=False, reason="")
        compare_pair(trial, side_of(pi, j, loaded, side), mine, None, job.mode, job.chunk)
        value = trial[name]
        score = math.inf if trial["structural"] or trial["reason"] or math.isnan(value) else value
        if best is None or score < best[0]:
            best = (score, j, trial)
        if score == 0:
            break
    _, j, trial = best
    call, alone = split_call(pi.keys[j])[1], row["reason"]
    dtype = pi.dtype[i] or ""
    row.update(trial, dtype_a=dtype, dtype_b=dtype)
    if row["structural"]:  # NaN/Inf in one copy only, or it cannot be read: said with its partner
        row["reason"] += f" ({side}'s call {call}, a recompute?)"
        return
    if row["reason"]:  # never compared (not stored): stays one-sided
        row.update(structural=True, reason=alone)
        return
    row["reason"] = replica_reason(side, call)
    if job.mode == "tensor":  # what Diff._fill_stats_rel gives the rows of pairs
        row["stats_rel"] = stats_rel(pi.stat_dict(i), pi.stat_dict(j))
