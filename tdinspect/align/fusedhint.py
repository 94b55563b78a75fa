"""Is a diverging tensor-parallel concatenation a fused layout? Found from the values.

A fused projection sharded over ``n`` ranks (a ``qkv`` whose ranks each hold
``[q_r | k_r | v_r]``) put back rank after rank is ``[q_0 k_0 v_0 q_1 k_1 v_1]``,
not the whole model's ``[q | k | v]``: it diverges everywhere though every value is
right. :func:`fused_layout` reads the layout off the two tensors (rank 0's shard
meets the reference in runs of columns, one per segment; every rank's share of a
segment sits after the previous rank's) and :func:`fused_hint` spells the dims
that assemble it (:mod:`tdinspect.align.dims`, ``fused=``). Through a mapping the
reference shows the segments itself: the entries it cuts out of the fused one
(``q_proj``, ``k_proj``, ``v_proj``) tile it, and :func:`cuts_hint` reads them.

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

from tdinspect.align.dims import SEGMENT, Dim, parse_dims
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


def cut_of(transform, width: int, dim: int, ndim: int) -> tuple[int, int] | None:
    """``(start, length)`` along ``dim`` that ``transform`` (a mapping rule's) cuts out of
    a tensor ``width`` long there, or ``None`` when it is not one contiguous cut.
    Found by applying it to the positions themselves (``narrow``, ``chunk(...)[i]``)."""
    shape = [1] * ndim
    shape[dim] = width
    try:
        out = transform(torch.arange(width).view(shape))
    except Exception:  # reshapes of other dims, a user's callable: not a cut
        return None
    if not isinstance(out, torch.Tensor) or out.numel() == 0 or out.numel() != out.shape[dim % out.dim()]:
        return None
    pos = out.flatten()
    start, n = int(pos[0]), pos.numel()
    return (start, n) if torch.equal(pos, torch.arange(start, start + n)) else None


def _with_segments(spec_text: str | None, dim: int, segments: tuple) -> str:
    """``spec_text`` with ``fused=`` segments on ``dim`` (a placeholder spec without one)."""
    try:
        spec = parse_dims(spec_text) if spec_text else None
    except DimsError:
        spec = None
    if spec is None or dim >= len(spec.dims):
        return f"... h(tp,fused={','.join(f'{n}:{w}' for n, w in segments)})"
    d = spec.dims[dim]
    dims = list(spec.dims)
    dims[dim] = Dim(d.name, d.axes, d.partial, d.zigzag, segments)
    return " ".join(_spelled(x) for x in dims)


def cuts_hint(
    cuts: dict[str, tuple[int, int]], ranks: int, rank_width: int, dim: int, spec_text: str | None
) -> str:
    """``"; ..."`` where the reference's entries cut out of one concatenated entry
    (``{name: (start, length)}``) tile it in two or more segments that each split over
    the ``ranks``: the layout may be fused (else ``""``)."""
    order = sorted(cuts.items(), key=lambda kv: kv[1][0])
    at = 0
    for _, (start, n) in order:
        if start != at or n % ranks:
            return ""
        at += n
    if len(order) < 2 or at != ranks * rank_width:
        return ""
    leaves = [name.rsplit(".", 1)[-1] for name, _ in order]  # q_proj, k_proj, v_proj
    names = leaves if len(set(leaves)) == len(leaves) else [name for name, _ in order]
    shown = ", ".join(f"{name} {s}..{s + n}" for name, (_, (s, n)) in zip(names, order))
    valid = all(SEGMENT.match(f"{name}:1") for name in names)
    segments = tuple(
        (name if valid else f"s{i}", n) for i, (name, (_, (_, n))) in enumerate(zip(names, order))
    )
    return (
        f"; the reference cuts it into {shown} and each rank holds {rank_width} = their sum / "
        f"{ranks}: if each rank holds its share of every one (a fused layout), give it dims "
        f"{_with_segments(spec_text, dim, segments)!r}"
    )


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
    suggested = _with_segments(spec_text, dim, tuple((f"s{i}", w) for i, w in enumerate(widths)))
    return (
        f"; each rank's shard meets the other side as {len(widths)} segments, each split over "
        f"the ranks on its own (whole widths {', '.join(map(str, widths))}): a fused layout "
        f"(qkv, gate_up)? give it dims {suggested!r} (name the segments as you like)"
    )
