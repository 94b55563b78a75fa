"""Is a diverging tensor-parallel concatenation a fused layout? Found from the values.

A fused projection sharded over ``n`` ranks (a ``qkv`` whose ranks each hold
``[q_r | k_r | v_r]``) put back rank after rank is ``[q_0 k_0 v_0 q_1 k_1 v_1]``,
not the whole model's ``[q | k | v]``: it diverges everywhere though every value is
right. :func:`fused_layout` reads the layout off the two tensors (rank 0's shard
meets the reference in runs of columns, one per segment; every rank's share of a
segment sits after the previous rank's) and :func:`fused_hint` spells the dims
that assemble it (:mod:`tdinspect.align.dims`, ``fused=``).

Examples
--------
>>> q, k = torch.arange(4.0), torch.arange(10.0, 12.0)
>>> whole = torch.cat([q, k])                        # [q | k]
>>> ranks = [torch.cat([q[:2], k[:1]]), torch.cat([q[2:], k[1:]])]
>>> fused_layout(whole, ranks, 0)
[4, 2]
"""

from __future__ import annotations

import torch

from tdinspect.align.dims import Dim, parse_dims
from tdinspect.errors import DimsError

CLOSE = 0.05  # a column meets its partner within 5% relative L2 error (a shifted one misses by ~100%)


def _columns(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``[other elements, positions along dim]`` in float64."""
    return t.movedim(dim, -1).reshape(-1, t.shape[dim]).double()


def _close(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per column: whether ``a`` meets ``b`` (both ``[m, k]``)."""
    return (a - b).norm(dim=0) <= CLOSE * b.norm(dim=0) + 1e-12


def fused_layout(whole: torch.Tensor, ranks: list[torch.Tensor], dim: int) -> list[int] | None:
    """The whole-model widths of the segments (two or more) that ``ranks``' shards
    along ``dim`` are made of, each split over the ranks on its own; ``None`` when
    the values show no such layout."""
    n = len(ranks)
    if n < 2 or any(r.shape != ranks[0].shape for r in ranks) or whole.dim() != ranks[0].dim():
        return None
    width = ranks[0].shape[dim]
    if whole.shape[dim] != n * width or whole.numel() != n * ranks[0].numel():
        return None
    y = _columns(whole, dim)
    parts = [_columns(r, dim) for r in ranks]
    widths, at = [], 0  # at: where the next segment starts within a rank
    while at < width:
        start = n * at  # where it starts in the whole
        hits = _close(parts[0][:, at:], y[:, start : start + width - at])
        run = int(hits.long().cumprod(0).sum())  # rank 0's share of this segment
        if run == 0:
            return None
        for r, part in enumerate(parts[1:], 1):
            theirs = y[:, start + r * run : start + (r + 1) * run]
            if not bool(_close(part[:, at : at + run], theirs).all()):
                return None
        widths.append(n * run)
        at += run
    return widths if len(widths) > 1 else None


def _spelled(d: Dim) -> str:
    mods = list(d.axes) + ["partial"] * d.partial + ["zigzag"] * d.zigzag
    if d.fused:
        kind = "fused_per_rank" if d.per_rank else "fused"
        mods.append(f"{kind}=" + ",".join(f"{n}:{w}" for n, w in d.fused))
    return d.name + (f"({','.join(mods)})" if mods else "")


def fused_hint(whole: torch.Tensor, ranks: list[torch.Tensor], dim: int, spec_text: str | None) -> str:
    """``"; ..."`` saying the shards are a fused layout and the dims that assemble it, or ``""``.

    ``ranks`` are the shards as concatenated (rank order), ``whole`` the other side's
    tensor, ``spec_text`` the entry's dims (rewritten with ``fused=`` on ``dim``).
    """
    widths = fused_layout(whole, ranks, dim)
    if widths is None:
        return ""
    segments = tuple((f"s{i}", w) for i, w in enumerate(widths))
    try:
        spec = parse_dims(spec_text) if spec_text else None
    except DimsError:
        spec = None
    if spec is not None and dim < len(spec.dims):
        d = spec.dims[dim]
        dims = list(spec.dims)
        dims[dim] = Dim(d.name, d.axes, d.partial, d.zigzag, segments)
        suggested = " ".join(_spelled(x) for x in dims)
    else:
        suggested = f"... h(tp,fused={','.join(f'{n}:{w}' for n, w in segments)})"
    return (
        f"; each rank's shard meets the other side as {len(widths)} segments, each split over "
        f"the ranks on its own (whole widths {', '.join(map(str, widths))}): a fused layout "
        f"(qkv, gate_up)? give it dims {suggested!r} (name the segments as you like)"
    )
