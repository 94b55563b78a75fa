"""A token-aligned pass's pairs compared straight from the pass files' bytes (:func:`tdinspect.compare.passes.compare_pass`).

Each entry of a request pass (:class:`~tdinspect.align.tokens.RequestPass`, one request's
token rows, ``DumpSet.diff(other, tokens=True)``) is a list of byte spans of its sources'
pass files: the rows of a prefill run, one row of each decode pass.
:meth:`~tdinspect.align.tokens.RequestPass.byte_pieces` gives them as numpy views (small
rows copied together); the two sides are cut at every boundary of either and compared piece
by piece by :func:`~tdinspect.numerics.metrics_split.stored_pieces_metrics`, token row by token row
(each judged, :mod:`tdinspect.numerics.slices`), which is
what :func:`~tdinspect.compare.rule.compare_pair` computes for such a pair, without a torch
call: each releases and takes back the GIL, and with one a piece the diff's threads spent
their time handing it over (8x the thread switches of a plain diff of the same bytes).

A pair qualifies when both sides are request-pass entries of one dtype of
:data:`~tdinspect.numerics.metrics.STORED` and one shape, not empty, initialised, with no
mapping transform. A pair whose sources are not mapped pass files, or that the sums leave
unsettled (NaN/Inf, float64 sums out of range, ``Σxy`` to sum directly), goes back to
``compare_pair``. The rows are the ones ``compare_pair`` fills (tested).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tdinspect.align.logical import common_cuts
from tdinspect.align.tokens import RequestPass
from tdinspect.compare.plainpairs import fill_settled
from tdinspect.numerics.metrics import STORED
from tdinspect.numerics.metrics_split import stored_pieces_metrics

_NAMES = {str(dt): dt for dt in STORED}


def span_dtypes(pi) -> list[torch.dtype | None] | None:
    """Per entry of a request pass: its dtype where its pair may be compared from its spans
    (a dtype of :data:`~tdinspect.numerics.metrics.STORED`, a non-empty shape), else
    ``None``; ``None`` for a pass that is not a request pass."""
    if not isinstance(pi, RequestPass) or pi.shared is None:
        return None
    return [
        _NAMES.get(dt)
        if isinstance(shape, list) and math.prod(shape) > 0 and not pi.uninitialized[i]
        else None
        for i, (dt, shape) in enumerate(zip(pi.dtype, pi.shape))
    ]


def compare_spans(pairs: list[tuple[dict, int, int]], pa: RequestPass, pb: RequestPass) -> list:
    """Fill the rows of ``pairs`` (``(row, i_a, i_b)``, each checked by the caller to qualify
    by :func:`span_dtypes`, one shape, no transform); returns the pairs left for
    ``compare_pair``."""
    left = []
    for row, ia, ib in pairs:
        dtype = _NAMES[pa.dtype[ia]]
        a, b = pa.byte_pieces(pa.keys[ia]), pb.byte_pieces(pb.keys[ib])
        cut = None if a is None or b is None or a[0] != dtype or b[0] != dtype else matching_bytes(b[1], a[1])
        found = None
        if cut is not None:
            elements = STORED[dtype][0]
            width = math.prod(pa.shape[ia][1:])  # a token row: each is judged (numerics/slices.py)
            found = stored_pieces_metrics(
                [(x.view(elements), y.view(elements)) for x, y in cut], dtype, slices=width
            )
        if not fill_settled(row, found, pa.call_args[ia], pb.call_args[ib]):
            left.append((row, ia, ib))  # not as the sidecars say, or a special road: compare_pair's
    return left


def matching_bytes(
    x: list[tuple[int, Any]], y: list[tuple[int, Any]]
) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Two sides' pieces (``[(first byte, uint8 array)]``, end to end from byte 0) cut at every
    boundary of either, pair by pair; ``None`` when they do not cover one length.

    Examples
    --------
    >>> x = [(0, np.arange(4, dtype=np.uint8)), (4, np.arange(4, 8, dtype=np.uint8))]
    >>> y = [(0, np.arange(8, dtype=np.uint8))]
    >>> [(a.tolist(), b.tolist()) for a, b in matching_bytes(x, y)][1]
    ([4, 5, 6, 7], [4, 5, 6, 7])
    """
    length = x[-1][0] + x[-1][1].size
    if length != y[-1][0] + y[-1][1].size:
        return None
    if len(x) == len(y) and all(sx == sy for (sx, _), (sy, _) in zip(x, y)):  # cut alike
        return [(px, py) for (_, px), (_, py) in zip(x, y)]
    return [
        (px[start - sx : start - sx + n], py[start - sy : start - sy + n])
        for start, n, (sx, px), (sy, py) in common_cuts(x, y, length)
    ]
