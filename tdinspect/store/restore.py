"""How a stored tensor is read back as analysis sees it: dense, dequantized, nested parts joined.

Capture stores some tensors in another form than a plain strided one (see
:mod:`tdinspect.dumper.kinds`); every reader turns them back into plain tensors here.

Examples
--------
>>> import torch
>>> restore(torch.eye(2).to_sparse()).layout
torch.strided
"""

from __future__ import annotations

import torch


def flat_values(t: torch.Tensor) -> torch.Tensor:
    """The values a sparse or nested tensor holds, as one plain tensor (never made dense);
    any other tensor as it is."""
    if t.is_nested:
        parts = t.unbind()
        return torch.cat([p.reshape(-1) for p in parts]) if parts else t.new_empty(0)
    if t.layout == torch.sparse_coo:
        return t._values()  # duplicates of an uncoalesced tensor are values too
    if t.layout != torch.strided:
        return t.values()
    return t


def restore(t: torch.Tensor) -> torch.Tensor:
    """A stored tensor as analysis reads it: dense, dequantized, nested parts joined.

    Decided from the tensor itself (what ``torch.load`` gave back), never from
    the sidecar.
    """
    if t.is_nested:
        return flat_values(t)
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.dequantize()
    return t
