"""Pad rows left out of a plain diff: a padded batch compared on its real tokens only.

A padded batch (``[batch, seq, ...]`` under an attention mask) holds rows that are no token:
eager and SDPA attention, among others, fill them differently, and whole-tensor metrics
read a correct model as diverging there (a tiny Llama, eager against SDPA: ``o_proj``
rel_diff 0.013 on its pad rows, 3e-15 on its real ones). Where both passes carry the same
token layout (``dump.step(tokens=...)``) with pad rows, every entry led by those rows is
compared on its real rows alone: pads are not tokens (GUIDE, soundness), and identical pads
no longer dilute a fault in a real row either. The row's metrics are those of its real rows
(its ``reason`` stays empty: a row compared in numbers, judged by its metric like any other),
and each real token row is judged as a slice too (``slice_<metric>``), as ``tokens=True`` judges it.
Statistics-only dumps hold no rows to leave out: their statistics are of whole tensors, pads
included.

Examples
--------
>>> DumpSet.open("dumps/eager").diff("dumps/sdpa").verdict().outcome   # doctest: +SKIP
'matches'
"""

from __future__ import annotations

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
    for row in rows:
        if row["structural"] or row["reason"]:
            continue
        ya, xb = fetch_a(row["key"]), fetch_b(row["key_b"])
        if tuple(ya.shape[: len(lead)]) != lead or tuple(xb.shape[: len(lead)]) != lead:
            continue  # not token-major (weights, the last position's logits): whole tensors
        y = ya.reshape(n, *ya.shape[len(lead) :])[keep]
        x = xb.reshape(n, *xb.shape[len(lead) :])[keep]
        row.update(compare_tensors(x, y, chunk=chunk))
        # each real token row judged too (every slice judged): a fault in one token is not
        # diluted by the others, as with tokens=True on the same dumps
        row.update(_worst_apart(list(zip(x.unbind(0), y.unbind(0))), chunk))
        if row.pop("nonfinite_mismatch", 0):  # NaN/Inf on one side in a real row (pads: no token's)
            row.update(structural=True, reason=f"{NONFINITE} (in real token rows)")
