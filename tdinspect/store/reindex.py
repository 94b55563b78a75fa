"""Rebuild a recorded view from the stored tensor it views, by indexing alone.

Op-level capture does not store the output of a view op (``view``,
``transpose``, ``select``...) of a tensor it has already stored: it records
where the view's elements sit in the storage they share, as two geometries
``[sizes, strides, storage_offset]``, the stored tensor's and the view's. On
load the view is re-indexed out of the stored (compact) copy. Nothing named by
the file is ever run: a sidecar can only choose which stored elements to show,
and a geometry reaching outside the stored tensor's elements is refused.

Examples
--------
>>> base = torch.arange(6.0).reshape(2, 3)
>>> reindex(base, [[2, 3], [3, 1], 0], [[3, 2], [1, 3], 0], "demo")   # base.t()
tensor([[0., 3.],
        [1., 4.],
        [2., 5.]])
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tdinspect.errors import DumpFormatError

_LIMIT = 1 << 48  # sizes, strides and offsets beyond this are not a real tensor's
_GATHER_LIMIT = 1 << 28  # distinct elements a non-contiguous base may be re-indexed into


def check_geometry(geom: Any, where: str) -> tuple[list[int], list[int], int]:
    """``(sizes, strides, offset)`` from a sidecar's ``[sizes, strides, offset]``, validated.

    Raises
    ------
    DumpFormatError
        Naming ``where`` (the file and entry), if it is not lists of
        non-negative integers of one length, or is absurdly large.
    """

    def is_int(v):
        return type(v) is int and 0 <= v < _LIMIT

    if (
        not isinstance(geom, list)
        or len(geom) != 3
        or not isinstance(geom[0], list)
        or not isinstance(geom[1], list)
        or len(geom[0]) != len(geom[1])
        or len(geom[0]) > 64
        or not all(map(is_int, geom[0]))
        or not all(map(is_int, geom[1]))
        or not is_int(geom[2])
        or math.prod(geom[0]) >= _LIMIT
    ):
        raise DumpFormatError(
            f"{where}: malformed view geometry {str(geom)[:80]!r} "
            "(expected [sizes, strides, storage_offset] of non-negative integers)"
        )
    return geom[0], geom[1], geom[2]


def _contiguous(sizes: list[int], strides: list[int]) -> bool:
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _positions(sizes: list[int], strides: list[int], offset: int) -> torch.Tensor:
    """The storage position of every element, in row-major order of ``sizes``."""
    pos = torch.tensor(offset, dtype=torch.int64)
    for size, stride in zip(sizes, strides):
        pos = pos.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return pos.reshape(-1)


def reindex(base: torch.Tensor, base_geom: Any, view_geom: Any, where: str) -> torch.Tensor:
    """The view of ``base`` described by two geometries in the storage they shared.

    Parameters
    ----------
    base : Tensor
        The stored tensor, as read from the pass file (any layout: its logical
        elements are what was captured).
    base_geom, view_geom : list
        ``[sizes, strides, storage_offset]`` of the stored tensor and of the
        view, as they were in the captured program's storage.
    where : str
        Names the file and entry in errors.

    Returns
    -------
    Tensor
        Bitwise the view's elements (a view of ``base`` when its geometry was
        contiguous, else a gathered copy).

    Raises
    ------
    DumpFormatError
        If a geometry is malformed, does not fit ``base``, or reaches an
        element that is not one of ``base``'s.
    """
    bsizes, bstrides, boffset = check_geometry(base_geom, where)
    vsizes, vstrides, voffset = check_geometry(view_geom, where)
    if list(base.shape) != bsizes:
        raise DumpFormatError(
            f"{where}: the stored tensor has shape {list(base.shape)}, the view's record says {bsizes}"
        )
    if math.prod(vsizes) == 0:
        return base.new_empty(vsizes)
    flat = base.reshape(-1)
    if _contiguous(bsizes, bstrides):
        rel = voffset - boffset
        last = rel + sum((s - 1) * st for s, st in zip(vsizes, vstrides))
        if rel < 0 or last >= flat.numel():
            raise DumpFormatError(
                f"{where}: the view reaches outside the stored tensor "
                f"(elements {rel}..{last} of {flat.numel()})"
            )
        return flat.as_strided(vsizes, vstrides, flat.storage_offset() + rel)
    # a base that was itself strided (a transpose, a slice...): find each view element's
    # storage position among the base's; broadcast (stride 0) dimensions are expanded after
    if flat.numel() == 0:
        raise DumpFormatError(f"{where}: the view reaches elements the stored tensor does not hold")
    distinct = [1 if st == 0 else s for s, st in zip(vsizes, vstrides)]
    if math.prod(distinct) > _GATHER_LIMIT:
        raise DumpFormatError(
            f"{where}: view of {math.prod(distinct)} distinct elements is too large to rebuild"
        )
    wanted = _positions(distinct, vstrides, voffset)
    have, order = torch.sort(_positions(bsizes, bstrides, boffset), stable=True)
    loc = torch.searchsorted(have, wanted).clamp_(max=have.numel() - 1)
    if not bool((have[loc] == wanted).all()):
        raise DumpFormatError(f"{where}: the view reaches elements the stored tensor does not hold")
    return flat[order[loc]].reshape(distinct).expand(vsizes)
