"""How a stored tensor is read back as analysis sees it: checked, then dense, dequantized,
nested parts joined.

Capture stores some tensors in another form than a plain strided one (see
:mod:`tdinspect.dumper.kinds`); every reader turns them back into plain tensors here, and
checks them first: ``torch.load`` does not check a sparse tensor's indices against its
size (an index past it is an out-of-bounds write when made dense), and a sparse tensor of
a few bytes can claim a dense size of gigabytes. A tensor read from a file is made dense
only up to :data:`DENSE_FACTOR` times the bytes it stores, or :data:`DENSE_FLOOR_BYTES`
whichever is larger (``TDINSPECT_MAX_DENSE_BYTES`` raises the floor).

Examples
--------
>>> import torch
>>> restore(torch.eye(2).to_sparse()).layout
torch.strided
>>> restored_shape(torch.eye(3).to_sparse())
([3, 3], 'torch.float32')
"""

from __future__ import annotations

import math
import os

import torch

from tdinspect.errors import DumpFormatError

DENSE_FACTOR = 64  # a stored tensor may be made at most this many times larger than it is...
DENSE_FLOOR_BYTES = 64 << 20  # ...or this large, whichever is more
_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


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


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a sparse tensor is made of."""
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    compressed, plain = _COMPRESSED[t.layout]
    return [getattr(t, compressed)(), getattr(t, plain)(), t.values()]


def stored_bytes(t: torch.Tensor) -> int:
    """The bytes ``t`` holds (for a sparse tensor, its indices and values)."""
    if t.layout == torch.strided and not t.is_nested:
        return t.numel() * t.element_size()
    if t.is_nested:
        return sum(p.numel() * p.element_size() for p in t.unbind())
    return sum(p.numel() * p.element_size() for p in _parts(t))


def dense_limit(t: torch.Tensor) -> int:
    """The most bytes reading ``t`` may make of it."""
    floor = DENSE_FLOOR_BYTES
    env = os.environ.get("TDINSPECT_MAX_DENSE_BYTES", "")
    if env.isdigit():
        floor = max(floor, int(env))
    return max(floor, DENSE_FACTOR * stored_bytes(t))


def oversized(t: torch.Tensor) -> str:
    """Why making ``t`` contiguous would allocate beyond :func:`dense_limit` of the storage it
    views (an expanded view of a few bytes claiming gigabytes), or ``""``.

    Examples
    --------
    >>> oversized(torch.zeros(1).expand(2**40))
    'an expanded view of 4 bytes that would be 4398046511104 bytes made whole (at most 67108864)'
    >>> oversized(torch.zeros(4))
    ''
    """
    if t.layout != torch.strided or t.is_nested or t.is_contiguous():
        return ""
    dense = t.numel() * t.element_size()
    stored = t.untyped_storage().nbytes()
    limit = max(DENSE_FLOOR_BYTES, DENSE_FACTOR * stored)
    if dense <= limit:
        return ""
    return f"an expanded view of {stored} bytes that would be {dense} bytes made whole (at most {limit})"


def check(t: torch.Tensor, where: object = "a stored tensor") -> None:
    """Check a tensor read from a file before anything reads its elements.

    Raises
    ------
    DumpFormatError
        Naming ``where``, for a sparse tensor whose indices break its invariants (out of its
        size, not ordered as its layout needs) or a tensor whose dense form would be larger
        than :func:`dense_limit` allows.
    """
    if t.layout != torch.strided:
        check_sparse(t, where)
    if t.is_nested or t.layout == torch.strided:
        return
    dense = math.prod(t.shape) * t.element_size()
    if dense > dense_limit(t):
        raise DumpFormatError(
            f"{where}: a {t.layout} tensor of shape {list(t.shape)} storing {stored_bytes(t)} bytes "
            f"would be {dense} bytes dense, more than {dense_limit(t)} (set TDINSPECT_MAX_DENSE_BYTES "
            "to read it if the file is yours)"
        )


def check_sparse(t: torch.Tensor, where: object) -> None:
    """Check a sparse tensor's invariants (a :class:`DumpFormatError` naming ``where``)."""
    # the public constructors check every invariant (indices within the size, compressed
    # indices ordered); torch.load does not unless a process-wide switch is on
    try:
        if t.layout == torch.sparse_coo:
            torch.sparse_coo_tensor(t._indices(), t._values(), t.shape, check_invariants=True)
        elif t.layout in _COMPRESSED:
            compressed, plain, values = _parts(t)
            torch.sparse_compressed_tensor(
                compressed, plain, values, t.shape, layout=t.layout, check_invariants=True
            )
        else:
            raise DumpFormatError(f"{where}: a tensor of layout {t.layout}, which tdinspect does not read")
    except DumpFormatError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise DumpFormatError(
            f"{where}: a damaged {t.layout} tensor ({str(exc).splitlines()[0][:200]})"
        ) from None


def restored_shape(t: torch.Tensor, where: object = "a stored tensor") -> tuple[list[int], str]:
    """The shape and dtype :func:`restore` gives ``t``, without making anything (checked)."""
    check(t, where)
    if t.is_nested:
        return [sum(p.numel() for p in t.unbind())], str(t.dtype)
    dtype = torch.float32 if t.is_quantized else t.dtype
    return list(t.shape), str(dtype)


def restore(t: torch.Tensor, where: object = "a stored tensor") -> torch.Tensor:
    """A stored tensor as analysis reads it: checked (:func:`check`), then dense,
    dequantized, nested parts joined.

    Decided from the tensor itself (what ``torch.load`` gave back), never from
    the sidecar.
    """
    check(t, where)
    try:
        if t.is_nested:
            return flat_values(t)
        if t.layout != torch.strided:
            t = t.to_dense()
        if t.is_quantized:
            t = t.dequantize()
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        # what the checks let through and torch still refuses (a sparse size of 0 x 2^40 x 2^40
        # holds no element, yet its dense strides overflow)
        raise DumpFormatError(
            f"{where}: a {t.layout} tensor of size {list(t.shape)} that cannot be made dense "
            f"({str(exc).splitlines()[0][:200]})"
        ) from None
    return t
