"""Pad rows in a plain diff: say when a divergence is padding alone, and that ``tokens=True`` helps.

A padded batch (``[batch, seq, ...]`` with an attention mask) holds rows that are no token:
eager and SDPA attention, among others, fill them differently, and a plain diff, which
compares row by row, reads that as a divergence of a correct model. When both passes carry
token layouts (``dump.step(tokens=...)``), :func:`pad_hint` checks the divergent entry on
the real tokens only and says what it found; it claims nothing it did not check.

Examples
--------
>>> d = DumpSet.open("dumps/eager").diff("dumps/sdpa")              # doctest: +SKIP
>>> print(d.verdict().text)                                          # doctest: +SKIP
diverges: model.model.layers.0.self_attn.o_proj (pass 0): rel_diff 0.0369 > 1.49e-08 (auto:
float32); on pad rows only: its 13 real token rows (of 16) give rel_diff 5.4e-15, within the
threshold; both dumps carry token layouts: tokens=True compares the real tokens only
"""

from __future__ import annotations

import torch

from tdinspect.compare.padrows import request_rows, token_row_shape
from tdinspect.numerics.metrics import compare_tensors
from tdinspect.store.passindex import PassIndex


def pad_hint(pa: PassIndex, pb: PassIndex, key_a: str, key_b: str, m, thr: float, *, chunk: int) -> str:
    """The hint for divergent entry ``key_a`` / ``key_b`` of passes ``pa`` / ``pb`` compared
    row by row (no transform), or ``""`` where there is nothing checked to say.

    - both layouts the same, with pad rows, the entry led by their token rows: the metric
      ``m`` on the real token rows alone, and on each request's; when one request's rows diverge
      the hint names it and its worst position; when all are within ``thr``, the divergence is the
      pads' and the hint says so (when the real tokens diverge as a whole, nothing is added);
    - the two layouts differ: row by row the diff meets rows the layouts place elsewhere; the
      hint says so.
    """
    la, lb = pa.tokens, pb.tokens
    if la is None or lb is None:
        return ""
    if la != lb:
        return layouts_hint(pa, pb)
    real = [request is not None for request, _, n in la.segments for _ in range(n)]
    if all(real):
        return ""
    lead = tuple(la.shape)
    ya, xb = pa.tensor(key_a), pb.tensor(key_b)
    ra, rb = token_row_shape(ya.shape, lead), token_row_shape(xb.shape, lead)
    if ra is None or rb is None:
        return ""  # not token-major: its rows are not the layout's
    keep = torch.tensor(real)
    y = ya.reshape(len(real), *ra)[keep]
    x = xb.reshape(len(real), *rb)[keep]
    value = compare_tensors(x, y, chunk=chunk)[m.name]
    if m.diverges(value, thr):
        return ""
    # the whole of the real rows is within: a divergence there is one request's (every slice
    # judged, compare/padrows.py), never the pads'; its worst token row named
    where = [(r, p + j) for r, p, n in la.segments if r is not None for j in range(n)]
    for rows in request_rows(la):
        one = compare_tensors(x[rows], y[rows], chunk=chunk)[m.name]
        if m.diverges(one, thr):
            worst = max(rows.tolist(), key=lambda i: compare_tensors(x[i], y[i], chunk=chunk)["rel_diff"])
            request, position = where[worst]
            return (
                f"; in request {request}'s real token rows: {m.name} {one:.3g} "
                f"(its worst, position {position})"
            )
    return (
        f"; on pad rows only: its {int(keep.sum())} real token rows (of {len(real)}) give "
        f"{m.name} {value:.3g}, within the threshold; both dumps carry token layouts: "
        "tokens=True compares the real tokens only"
    )


def layouts_hint(pa: PassIndex, pb: PassIndex) -> str:
    """When both passes carry token layouts and they differ (a padded batch against one request
    at a time: shapes that differ too), that ``tokens=True`` lines them up; ``""`` otherwise."""
    la, lb = getattr(pa, "tokens", None), getattr(pb, "tokens", None)
    if la is None or lb is None or la == lb:
        return ""
    return (
        f"; both dumps carry token layouts and they differ (A {la!r}, B {lb!r}): row by row "
        "this meets rows the layouts give to another (request, position) or to padding; "
        "tokens=True lines them up by (request, position)"
    )
