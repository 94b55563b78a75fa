"""A pass's small plain pairs compared in one batch (:func:`tdinspect.compare.diff.compare_pass`).

A pair qualifies when nothing about it needs the per-pair rule of
:func:`tdinspect.compare.diff.compare_pair`: both sides stored as plain tensors of one
float dtype of :data:`~tdinspect.numerics.metrics_batch.BATCHED` and one shape, under
:func:`~tdinspect.numerics.kernels.segment_limit` bytes a side (the size below which a
pair alone is summed the same way), not empty, initialised, no mapping
transform, pieces or unsharding (a :class:`~tdinspect.align.logical.LogicalPass`
never qualifies). Their elements are gathered end to end and compared by
:func:`~tdinspect.numerics.metrics_batch.compare_segments`; a pair it leaves unsettled
(NaN/Inf, float64 sums out of range, ``Σxy`` to sum directly) or whose stored
tensor is not contiguous goes back to ``compare_pair``. The rows are the ones
``compare_pair`` fills, bit for bit (tested).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from tdinspect.align.args import arg_difference
from tdinspect.align.logical import LogicalPass
from tdinspect.compare.plainpairs import plain_dtypes, stored_reader
from tdinspect.numerics import kernels
from tdinspect.numerics.metrics_batch import BATCHED, compare_segments
from tdinspect.store.rawspans import element_starts

GROUP_ELEMENTS = 1 << 16  # elements per side compared in one call (float64 temporaries in cache)
_NAMES = {str(dt): dt for dt in BATCHED}


def small_plain(pi, plain: list | None = None) -> list[torch.dtype | None]:
    """Per entry of a pass: its dtype where it can join a batch, else ``None``: a plain
    entry (:func:`~tdinspect.compare.plainpairs.plain_dtypes`, or ``plain`` when the caller has
    it already) of a dtype of :data:`~tdinspect.numerics.metrics_batch.BATCHED`, under
    :func:`~tdinspect.numerics.kernels.segment_limit` bytes."""
    limit = kernels.segment_limit()
    return [
        dt if dt in BATCHED and dt.itemsize * math.prod(shape) < limit else None
        for dt, shape in zip(plain_dtypes(pi) if plain is None else plain, pi.shape)
    ]


def compare_batch(pairs: list[tuple[dict, int, int]], pa, pb, sources) -> list:
    """Fill the rows of ``pairs`` (``(row, i_a, i_b)``, each pair checked by the caller to
    qualify); returns the pairs left for ``compare_pair``. ``sources`` are the two
    passes' :func:`pass_spans`, or callables giving their loaded tensors."""
    left = []
    groups: dict[torch.dtype, list] = {}
    read_a, read_b = (stored_reader(pi, src) for pi, src in zip((pa, pb), sources))
    for row, ia, ib in pairs:
        dtype = _NAMES[pa.dtype[ia]]
        xa, xb = read_a(ia, dtype), read_b(ib, dtype)
        if xa is None or xb is None or xa.shape != xb.shape:  # the file is not as the sidecar says
            left.append((row, ia, ib))
            continue
        groups.setdefault(dtype, []).append((row, ia, ib, xb, xa))
    for dtype, members in groups.items():
        start = 0
        while start < len(members):
            stop, size = start, 0
            while stop < len(members) and size < GROUP_ELEMENTS:
                size += members[stop][3].shape[0]
                stop += 1
            left += _settle(members[start:stop], dtype, pa, pb)
            start = stop
    return left


def pass_spans(pi) -> tuple[np.ndarray, list, Mapping] | None:
    """``(the pass file's bytes, where each entry's lie by entry index, its tensors made on
    demand)`` when its sidecar lays the records out and they check out
    (:func:`tdinspect.store.rawspans.element_starts`); ``None`` to read tensors instead (a pass
    whose tensors the open already loaded, no layout, a layout that does not check out)."""
    if (
        isinstance(pi, LogicalPass)
        or pi.raw is None
        or pi.files.tensors is None
        or getattr(pi, "_held", None) is not None
    ):
        return None
    rows = [i for i, s in enumerate(pi.stored) if s]
    index, pi._zip = getattr(pi, "_zip", None), None  # it describes the file as opened: used once
    found = element_starts(pi.files.tensors, [pi.keys[i] for i in rows], [pi.raw[i] for i in rows], index)
    if found is None:
        return None
    starts: list = [None] * len(pi.keys)
    for i, where in zip(rows, found.starts):
        starts[i] = where
    return found.data, starts, found.tensors()


def _settle(members: list, dtype: torch.dtype, pa, pb) -> list:
    """One group's rows filled as ``compare_pair`` fills them; the unsettled pairs returned."""
    lengths = np.fromiter((m[3].shape[0] for m in members), np.intp, len(members))
    starts = np.zeros(len(members), np.intp)
    np.cumsum(lengths[:-1], out=starts[1:])
    x = np.concatenate([m[3] for m in members])  # B: the compared side
    y = np.concatenate([m[4] for m in members])  # A: the reference
    values, settled = compare_segments(x, y, starts, dtype)
    columns = list(values)
    table = zip(*(values[k].tolist() for k in columns))
    left = []
    for (row, ia, ib, _, _), ok, found in zip(members, settled.tolist(), table):
        if not ok:
            left.append((row, ia, ib))
            continue
        row.update(zip(columns, found))
        why = arg_difference(pa.call_args[ia], pb.call_args[ib])  # "" unless both recorded
        if why:  # the metrics stay in the row, as compare_pair leaves them
            row.update(structural=True, reason=why)
    return left
