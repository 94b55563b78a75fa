"""Pad rows left out of a plain diff: a padded batch compared on its real tokens only.

A padded batch (``[batch, seq, ...]`` under an attention mask) holds rows that are no token:
eager and SDPA attention, among others, fill them differently, and whole-tensor metrics
read a correct model as diverging there (a tiny Llama, eager against SDPA: ``o_proj``
rel_diff 0.013 on its pad rows, 3e-15 on its real ones). Where both passes carry the same
token layout (``dump.step(tokens=...)``) with pad rows, every entry led by those rows is
compared on its real rows alone: pads are not tokens (GUIDE, soundness), and identical pads
no longer dilute a fault in a real row either. The row's metrics are those of its real rows
(its ``reason`` stays empty: a row compared in numbers, judged by its metric like any other),
and each request's real rows are judged as a slice too (``slice_<metric>``).
Statistics-only dumps hold no rows to leave out: their statistics are of whole tensors, pads
included.

Examples
--------
>>> DumpSet.open("dumps/eager").diff("dumps/sdpa").verdict().outcome   # doctest: +SKIP
'matches'
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tdinspect.compare.rule import NONFINITE, _worst_apart
from tdinspect.numerics.metrics import compare_tensors


def real_rows(layout) -> torch.Tensor | None:
    """A boolean mask of ``layout``'s real token rows, or ``None`` when every row is real."""
    if layout is None:
        return None
    real = [request is not None for request, _, n in layout.segments for _ in range(n)]
    return None if all(real) else torch.tensor(real)


def token_row_shape(shape, lead: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape of one token row of an entry of ``shape`` led by the layout's token rows
    ``lead`` (``[b, s, ...]``, or ``[b*s, ...]`` flattened row-major as MoE blocks flatten the
    batch: :func:`tdinspect.align.tokens` reads the same rows), ``None`` when it is not led by them.

    >>> token_row_shape((2, 9, 32), (2, 9)), token_row_shape((18, 4), (2, 9)), token_row_shape((36, 16), (2, 9))
    ((32,), (4,), None)
    """
    shape = tuple(shape)
    if shape[: len(lead)] == tuple(lead):
        return shape[len(lead) :]
    if len(lead) > 1 and shape and shape[0] == math.prod(lead):
        return shape[1:]
    return None


def request_rows(layout) -> list[torch.Tensor]:
    """The indices, among ``layout``'s real token rows, of each request's rows."""
    out: dict[int, list[int]] = {}
    i = 0
    for request, _, n in layout.segments:
        if request is not None:
            out.setdefault(request, []).extend(range(i, i + n))
            i += n
    return [torch.tensor(rows) for rows in out.values()]


def compare_real_rows(rows: list[dict[str, Any]], pa, pb, fetch_a, fetch_b, chunk: int) -> None:
    """Recompute, on the real token rows alone, the metrics of each numerically compared row of
    a pass pair whose two token layouts are the same and hold pad rows (in place)."""
    layout = getattr(pa, "tokens", None)
    if layout is None or layout != getattr(pb, "tokens", None):
        return
    keep = real_rows(layout)
    if keep is None:
        return
    lead, n = tuple(layout.shape), len(keep)
    requests = request_rows(layout)
    for row in rows:
        if row["structural"] or row["reason"]:
            continue
        ya, xb = fetch_a(row["key"]), fetch_b(row["key_b"])
        ra, rb = token_row_shape(ya.shape, lead), token_row_shape(xb.shape, lead)
        if ra is None or rb is None:
            continue  # not token-major (weights, the last position's logits): whole tensors
        y = ya.reshape(n, *ra)[keep]
        x = xb.reshape(n, *rb)[keep]
        row.update(compare_tensors(x, y, chunk=chunk))
        # each request's real rows judged too (every slice judged): a fault in one request's
        # tokens is not diluted by the other requests' (a slice per request, not per token row:
        # a row of a few elements, a router's score, reads its own rounding as a large ratio)
        row.update(_worst_apart([(x[i], y[i]) for i in requests], chunk))
        if row.pop("nonfinite_mismatch", 0):  # NaN/Inf on one side in a real row (pads: no token's)
            row.update(structural=True, reason=f"{NONFINITE} (in real token rows)")
