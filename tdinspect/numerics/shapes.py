"""Broadcast views (stride-0 dims, as ``expand`` makes) and the elements they store: torch only.

Examples
--------
>>> import torch
>>> t = torch.ones(3).expand(4, 3)
>>> broadcast_dims(t), first_slice(t, {0}).shape
({0}, torch.Size([1, 3]))
"""

from __future__ import annotations

import torch


def broadcast_dims(t: torch.Tensor) -> set[int]:
    """Dims that repeat one slice (stride 0, size > 1, as ``expand`` makes): a huge-shaped
    tensor may hold few distinct values, and is reduced as those."""
    return {dim for dim, (size, stride) in enumerate(zip(t.shape, t.stride())) if stride == 0 and size > 1}


def first_slice(t: torch.Tensor, dims) -> torch.Tensor:
    """``t`` narrowed to index 0 along ``dims``."""
    for dim in dims:
        t = t.narrow(dim, 0, 1)
    return t
