"""A bitwise fingerprint of a tensor, computed on its device (torch only, no copy to the host).

``tensor_checksum(t)`` reads ``t``'s bytes as 32-bit words ``w_j`` (little
endian, in logical row-major order, zero-padded to a whole word) and returns

    h = Σ_c R_c · Σ_k w_{cL+k} · K_k   (mod 2^64, words sign-extended)

where ``L = 2^16`` words make a block, ``K_k`` and ``R_c`` are fixed odd
64-bit multipliers (splitmix64 of ``k`` and of ``c``, :mod:`tdinspect.numerics.fingerprint`), and every
product and sum wraps modulo 2^64. Integer addition is associative, so the
result does not depend on how a device splits the reduction: the same bits
give the same fingerprint on any CPU or GPU. It costs one conversion to
int64, one multiply and one sum (torch's reductions, on any device: capture
computes it, importing torch and the standard library only); the host receives
one int64 per tensor.

Collision rate (two different tensors of the same dtype and shape with the same
fingerprint; shape and dtype are compared separately):

* a change confined to one 32-bit word (one float32, two bfloat16, a bit
  flip anywhere) is **always** detected: a non-zero difference ``|e| < 2^32``
  times odd multipliers is non-zero modulo 2^64;
* any other change, modelling the multipliers as random odd numbers fixed
  before the data: if ``b`` is the lowest bit in which some word differs,
  the probability is about ``2^(b-63)``: ≈ 1e-19 for differences in the low
  bits (rounding-order changes differ in the last mantissa bits), at worst
  ``2^-32`` ≈ 2.3e-10 when every differing word differs only in its top bit
  (sign flips and nothing else). Over a million compared tensors that is
  below 1e-12 (typical) and 2.3e-4 (sign flips only).

It is a fingerprint against accidents, not against an adversary (multipliers
are public and the map is linear).

Every kind of tensor capture accepts has one (:func:`checksum_parts`): a plain
tensor is its words as above, its conjugate or negative bit resolved on a copy
(the value it shows, never the model's tensor changed); any other kind is the
plain tensors that define it, ``h = h_0 + Σ_{i≥1} P_i · h_i`` over their
fingerprints ``h_i`` (``P_i`` odd multipliers of :data:`SEED_P`; one part is its
own fingerprint):

==========================  ========================================================
sparse                      its dense values (above 2^26 elements, or a dtype
                            with no dense kernel: its indices, values and shape)
quantized                   ``int_repr()``; its scales; its zero points; the bytes
                            of its dtype, scheme and axis
nested                      its components flattened and joined (as a reader reads
                            it); their shapes
subclass                    its components (``__tensor_flatten__``), in order; a
                            subclass without them: the plain tensor under it
meta, ``FakeTensor``        none: :class:`ChecksumError` (they hold no data)
==========================  ========================================================

A change to one element of any part changes the fingerprint (``P_i`` are odd).

Examples
--------
>>> x = torch.arange(6, dtype=torch.float32)
>>> tensor_checksum(x) == tensor_checksum(x.clone())
tensor(True)
>>> bool(tensor_checksum(x) == tensor_checksum(x.flip(0)))
False
>>> checksum_hex(tensor_checksum(torch.zeros(3)))
'0000000000000000'
"""

from __future__ import annotations

import torch

from tdinspect.numerics.fingerprint import BLOCK, MASK, SEED_K, SEED_R, multipliers
from tdinspect.numerics.shapes import broadcast_dims, first_slice

CHUNK_BLOCKS = 16  # blocks converted to int64 at a time (8 MB)
_MATERIALISE_LIMIT = 1 << 26  # broadcast tensors up to this many elements are hashed as laid out


SEED_P = 0x7061727473  # "parts": the multipliers of a kind's parts
_MAX_DEPTH = 16  # subclasses wrapping subclasses: deeper is refused, never a RecursionError


class ChecksumError(ValueError):
    """A tensor that has no fingerprint (a meta or fake tensor holds no data)."""


def checksum_parts(t: torch.Tensor, _depth: int = 0) -> list[torch.Tensor]:
    """The plain strided tensors (no conjugate or negative bit) whose words define ``t``'s
    fingerprint, in order; see the module docstring. Never changes ``t``.

    Raises
    ------
    ChecksumError
        ``t`` holds no data (meta, ``FakeTensor``), or a subclass nests too deep.

    Examples
    --------
    >>> [p.dtype for p in checksum_parts(torch.tensor([1j]).conj())]
    [torch.complex64]
    >>> len(checksum_parts(torch.quantize_per_tensor(torch.ones(2), 0.5, 0, torch.qint8)))
    4
    """
    if _depth > _MAX_DEPTH:
        raise ChecksumError(f"a tensor subclass nested more than {_MAX_DEPTH} deep")
    if t.device.type == "meta":
        raise ChecksumError("a meta tensor holds no data")
    plain = type(t) is torch.Tensor or type(t) is torch.nn.Parameter
    if not plain:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            raise ChecksumError("a fake tensor holds no data")
    t = t.detach()
    if t.is_nested:  # strided or jagged (a subclass): its components, as a reader reads them
        parts = [c.reshape(-1) for c in t.unbind()]
        values = torch.cat(parts) if parts else torch.empty(0, dtype=t.dtype, device=t.device)
        shapes = [d for c in t.unbind() for d in (c.dim(), *c.shape)]
        return [values.resolve_conj().resolve_neg(), _small(shapes, t)]
    if not plain:
        if hasattr(type(t), "__tensor_flatten__"):
            names = t.__tensor_flatten__()[0]
            parts = [p for name in names for p in checksum_parts(getattr(t, name), _depth + 1)]
            if not parts:
                raise ChecksumError(f"tensor subclass {type(t).__qualname__}: no components")
            return parts
        with torch._C.DisableTorchFunctionSubclass():
            t = t.as_subclass(torch.Tensor)
    if t.is_quantized:
        return _quantized_parts(t)
    if t.layout != torch.strided:
        if t.numel() <= _MATERIALISE_LIMIT:
            try:
                return [t.to_dense().resolve_conj().resolve_neg()]
            except (RuntimeError, NotImplementedError):  # no dense kernel for this dtype (float8 CSR)
                pass
        return [*_sparse_parts(t), _small(list(t.shape), t)]
    return [t.resolve_conj().resolve_neg()]


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """A sparse tensor's indices and values (COO coalesced: one form for one value)."""
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
        index = [t.indices()]
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        index = [t.crow_indices(), t.col_indices()]
    else:  # CSC, BSC
        index = [t.ccol_indices(), t.row_indices()]
    return [*index, t.values().resolve_conj().resolve_neg()]


def _small(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)


def _quantized_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """A quantized tensor's integers, scales, zero points, and the bytes naming its kind."""
    scheme = t.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        scales = torch.tensor([float(t.q_scale())], dtype=torch.float64, device=t.device)
        zeros, axis = _small([int(t.q_zero_point())], t), -1
    else:
        scales = t.q_per_channel_scales().to(torch.float64)
        zeros, axis = t.q_per_channel_zero_points().to(torch.int64), int(t.q_per_channel_axis())
    kind = torch.tensor(list(f"{t.dtype} {scheme} {axis}".encode()), dtype=torch.uint8, device=t.device)
    return [t.int_repr(), scales, zeros, kind]


def _words(t: torch.Tensor) -> torch.Tensor:
    """A plain part's (:func:`checksum_parts`) bytes as int32 words in logical order (zero-padded)."""
    if t.numel() > _MATERIALISE_LIMIT:  # a huge broadcast view: hash the elements it stores
        t = first_slice(t, broadcast_dims(t))
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    nbytes = flat.numel() * flat.element_size()
    if nbytes % 4 == 0 and flat.element_size() == 4:
        return flat.view(torch.int32)
    if flat.storage_offset() * flat.element_size() % 4 or not flat.is_contiguous():
        flat = flat.clone()
    raw = flat.view(torch.uint8)
    if nbytes % 4:
        raw = torch.cat([raw, raw.new_zeros(4 - nbytes % 4)])
    return raw.view(torch.int32)


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint of ``t``'s bits as a 0-d int64 tensor on ``t``'s device.

    See the module docstring for the definition and its collision rate; every kind of
    tensor has one (:func:`checksum_parts`), and ``t`` is never changed.

    Raises
    ------
    ChecksumError
        ``t`` holds no data (meta, ``FakeTensor``).
    """
    parts = checksum_parts(t)
    h = _plain_checksum(parts[0])
    if len(parts) > 1:
        p = multipliers(SEED_P, len(parts), h.device)
        for i, part in enumerate(parts[1:], 1):
            h = h + _plain_checksum(part) * p[i]
    return h


def _plain_checksum(t: torch.Tensor) -> torch.Tensor:
    words = _words(t)
    n = words.numel()
    device = words.device
    full, tail = divmod(n, BLOCK)
    h = torch.zeros((), dtype=torch.int64, device=device)
    k = multipliers(SEED_K, min(n, BLOCK), device)
    r = multipliers(SEED_R, full + 1, device)
    for start in range(0, full, CHUNK_BLOCKS):  # bounded temporaries (big ones cost page faults)
        stop = min(full, start + CHUNK_BLOCKS)
        blocks = words[start * BLOCK : stop * BLOCK].view(stop - start, BLOCK).to(torch.int64)
        blocks *= k
        h = h + (blocks.sum(1) * r[start:stop]).sum()
    if tail:
        last = words[full * BLOCK :].to(torch.int64)
        last *= k[:tail]
        h = h + last.sum() * r[full]
    return h


def row_checksums(t: torch.Tensor, dim: int) -> torch.Tensor | None:
    """One fingerprint per index along ``dim``, as a 1-d int64 tensor on ``t``'s device.

    Row ``i``'s is :func:`tensor_checksum` of ``t.select(dim, i)`` (the same formula on that
    slice's words, zero-padded per row), so row 0 of a batch of 4 and the one row of a batch
    of 1 have the same fingerprint exactly when they hold the same bits: batch invariance
    checked without writing tensors. ``None`` for a 0-d tensor, a ``dim`` it does not have,
    or a huge broadcast view (its rows would have to be materialised).

    Examples
    --------
    >>> x = torch.arange(6.0).reshape(3, 2)
    >>> bool((row_checksums(x, 0) == torch.stack([tensor_checksum(r) for r in x])).all())
    True
    >>> row_checksums(x, 1).shape, row_checksums(x, 2) is None
    (torch.Size([2]), True)
    """
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg()  # a copy where a bit is set: never the model's tensor
    if not -t.dim() <= dim < t.dim() or t.dim() == 0:
        return None
    if t.numel() > _MATERIALISE_LIMIT and broadcast_dims(t):
        return None
    d = dim % t.dim()
    n = t.shape[d]
    rows = t.movedim(d, 0).reshape(n, t.numel() // n if n else 0)
    if rows.dtype == torch.bool:
        rows = rows.view(torch.uint8)
    rows = rows.contiguous()
    if not (n and rows.shape[1]):
        return torch.zeros(n, dtype=torch.int64, device=rows.device)  # no words: 0, as tensor_checksum
    if rows.element_size() == 4:
        words = rows.view(torch.int32)
    else:
        raw = rows.view(torch.uint8)
        pad = -raw.shape[1] % 4
        if pad:
            raw = torch.cat([raw, raw.new_zeros((n, pad))], 1)
        words = raw.view(torch.int32)
    width = words.shape[1]
    h = torch.zeros(n, dtype=torch.int64, device=words.device)
    full, tail = divmod(width, BLOCK)
    k = multipliers(SEED_K, min(width, BLOCK), words.device)
    r = multipliers(SEED_R, full + 1, words.device)
    step = max(1, CHUNK_BLOCKS * BLOCK // min(width, BLOCK))  # rows at a time: bounded temporaries
    for c in range(full + (1 if tail else 0)):
        block = words[:, c * BLOCK : (c + 1) * BLOCK]
        for s in range(0, n, step):
            part = block[s : s + step].to(torch.int64)
            part *= k[: block.shape[1]]
            h[s : s + step] += part.sum(1) * r[c]
    return h


def checksum_hex(value: torch.Tensor | int) -> str:
    """A fingerprint as 16 hex digits (how sidecars store it: JSON numbers lose 64-bit ints)."""
    v = int(value.item() if isinstance(value, torch.Tensor) else value)
    return f"{v & MASK:016x}"
