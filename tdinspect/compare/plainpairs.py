"""A pass's plain pairs compared straight from the pass files' bytes (:func:`tdinspect.compare.diff.compare_pass`).

A pair qualifies as a small pair does (:mod:`tdinspect.compare.smallpairs`), whatever
its size: both sides stored as plain tensors of one dtype of
:data:`~tdinspect.numerics.metrics.STORED` and one shape, not empty, initialised, no
mapping transform, pieces or unsharding. Its elements are read as numpy
arrays from the checked records (:func:`tdinspect.compare.smallpairs.pass_spans`, no
torch view per entry) and compared by
:func:`~tdinspect.numerics.metrics.stored_metrics`, which is what
:func:`~tdinspect.numerics.metrics.compare_tensors` computes for such a pair. A pair it
leaves unsettled (NaN/Inf, float64 sums out of range, ``Σxy`` to sum
directly) or whose stored tensor is not contiguous goes back to
``compare_pair``. The rows are the ones ``compare_pair`` fills, bit for bit
(tested).
"""

from __future__ import annotations

import math

import torch

from tdinspect.align.args import arg_difference
from tdinspect.align.logical import LogicalPass
from tdinspect.numerics.metrics import STORED, as_stored, stored_metrics

_NAMES = {str(dt): dt for dt in STORED}


def plain_dtypes(pi) -> list[torch.dtype | None]:
    """Per entry of a pass: its dtype where its pair may be compared from its stored bytes
    (a stored plain tensor of a dtype of :data:`~tdinspect.numerics.metrics.STORED`, not empty,
    initialised), else ``None``."""
    if isinstance(pi, LogicalPass) or pi.files.tensors is None:
        return [None] * len(pi.keys)
    storage, skipped = pi.storage, pi.skipped
    out = []
    for i, dt in enumerate(pi.dtype):
        dtype = _NAMES.get(dt)
        ok = (
            dtype is not None
            and pi.stored[i]
            and not pi.uninitialized[i]
            and (storage is None or storage[i] is None)
            and (skipped is None or not isinstance(skipped[i], str))
            and isinstance(pi.shape[i], list)
            and math.prod(pi.shape[i]) > 0
        )
        out.append(dtype if ok else None)
    return out


def compare_plain(pairs: list[tuple[dict, int, int]], pa, pb, sources) -> list:
    """Fill the rows of ``pairs`` (``(row, i_a, i_b)``, each checked by the caller to qualify
    by :func:`plain_dtypes`, one shape, no transform); returns the pairs left for
    ``compare_pair``. ``sources`` are the two passes' :func:`~tdinspect.compare.smallpairs.pass_spans`,
    or callables giving their loaded tensors."""
    left = []
    read_a, read_b = (stored_reader(pi, src) for pi, src in zip((pa, pb), sources))
    for row, ia, ib in pairs:
        dtype = _NAMES[pa.dtype[ia]]
        ya, xb = read_a(ia, dtype), read_b(ib, dtype)
        found = None
        if ya is not None and xb is not None and ya.shape == xb.shape:
            found = stored_metrics(xb, ya, dtype)[0]
        if not fill_settled(row, found, pa.call_args[ia], pb.call_args[ib]):
            left.append((row, ia, ib))  # not as the sidecar says, or a special road: compare_pair's
    return left


def fill_settled(row: dict, found: dict | None, call_a, call_b) -> bool:
    """Fill ``row`` with a settled pair's metrics (``found``) as ``compare_pair`` leaves them,
    a difference of the recorded calls (``call_a``, ``call_b``) said as its reason; ``False``
    when ``found`` is ``None`` (the pair takes ``compare_pair``'s road)."""
    if found is None:
        return False
    del found["nonfinite_mismatch"]  # 0: settled pairs are finite or bitwise equal
    row.update(found)
    why = arg_difference(call_a, call_b)  # "" unless both recorded
    if why:  # the metrics stay in the row, as compare_pair leaves them
        row.update(structural=True, reason=why)
    return True


def stored_reader(pi, source):
    """``read(i, dtype)``: entry ``i``'s elements as a flat numpy array of what it stores
    (narrow floats: their bits; :func:`~tdinspect.numerics.metrics.as_stored`), or ``None`` (not a
    contiguous tensor of ``dtype``). ``source``: the pass's
    :func:`~tdinspect.compare.smallpairs.pass_spans`, or a callable giving its loaded tensors."""
    if callable(source):
        tensors = source()
        return lambda i, dtype: (
            as_stored(tensors[pi.keys[i]], dtype) if type(tensors[pi.keys[i]]) is torch.Tensor else None
        )
    data, starts, _ = source

    def read(i, dtype):
        where = starts[i]
        if where is None or where[2] != pi.dtype[i]:
            return None
        first, count, _ = where
        return data[first : first + count * dtype.itemsize].view(STORED[dtype][0])

    return read
