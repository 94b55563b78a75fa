"""Tensors that are not plain strided tensors with data: how capture stores them, or why not.

The recorder copies plain tensors itself; everything else comes here, and
nothing here may break the model's forward: a tensor that cannot be stored is
recorded with its reason (the sidecar's ``skipped`` column), and one that is
stored in another form says which in the sidecar's ``storage`` column:

============================  ===============================================================
sparse COO / CSR / CSC / BSR  stored as is (``torch.load`` reads it back); read as dense
quantized                     stored as is, with dtype, scheme, scale and zero point noted;
                              read (and its statistics taken) dequantized
nested                        stored as is; read as its components, flattened and joined
expanded (stride 0)           the elements the storage holds (size 1 on broadcast dims), and
                              the view's geometry, re-indexed on read (:mod:`tdinspect.store.reindex`)
``DTensor``                   the local shard, with placements, mesh and global shape
other subclasses              the plain tensor under it, with the subclass's name; a wrapper
                              subclass without its own storage is skipped
meta, ``FakeTensor``          skipped: they hold no data (shape and dtype are recorded)
============================  ===============================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tdinspect.numerics.stats import broadcast_dims, capture_stats, first_slice, tensor_stats
from tdinspect.store.restore import flat_values

_SPARSE = {
    torch.sparse_coo: "sparse_coo",
    torch.sparse_csr: "sparse_csr",
    torch.sparse_csc: "sparse_csc",
    torch.sparse_bsr: "sparse_bsr",
    torch.sparse_bsc: "sparse_bsc",
}


def is_plain(t: torch.Tensor) -> bool:
    """A strided tensor with data and no subclass, that is not expanded: the recorder's path."""
    return (
        (type(t) is torch.Tensor or type(t) is torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_nested
        and t.device.type != "meta"
        and not (0 in t.stride() and broadcast_dims(t))
    )


def holds_no_data(t: torch.Tensor) -> bool:
    """A meta tensor or a ``FakeTensor``: a shape and a dtype, no values to read."""
    if t.device.type == "meta":
        return True
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


@dataclass
class Prepared:
    """What to store for one tensor, and what the sidecar says about it."""

    data: torch.Tensor | None  # the tensor to copy into the pass file (None: nothing stored)
    stats: torch.Tensor | None  # its statistics (float64 vector), None when skipped
    shape: list[int] | None  # the shape analysis sees
    dtype: str | None
    storage: dict[str, Any] | None = None
    skipped: str | None = None


def prepare(t: torch.Tensor) -> Prepared:
    """How to record ``t``; never raises (a failure is a skip with its reason)."""
    try:
        return _prepare(t.detach())
    except Exception as exc:  # noqa: BLE001 - the model's forward must go on
        shape = shape_of(t)
        return Prepared(
            None,
            None,
            shape,
            str(t.dtype),
            skipped=f"{type(t).__name__} could not be stored ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''})",
        )


def shape_of(t: torch.Tensor) -> list[int] | None:
    """``t``'s shape as a list, or ``None`` (a nested tensor has no single shape; a jagged one
    has a symbolic dim, which no sidecar can hold: its pass was lost)."""
    try:
        shape = list(t.shape)
    except Exception:  # noqa: BLE001 - nested tensors have no single shape
        return None
    return shape if all(type(d) is int for d in shape) else None


_TINY_SCALE = 2.0**600  # exact: brings float64 subnormals (2**-1074 and up) to 2**-474 and up


def safe_stats(t: torch.Tensor) -> torch.Tensor:
    """:func:`~tdinspect.numerics.stats.capture_stats` that never raises because of the values (capture calls it in a hook:
    an error there would fail the model's forward).

    A float64 tensor whose largest magnitude is subnormal (``1e-310``) made
    ``stats.power_of_two_scale`` ask ``math.ldexp(1.0, 1029)``: ``OverflowError``
    from inside ``model(x)``. Such a tensor is measured scaled by an exact power
    of two (min, max, mean, std, absmax and l2 scale back exactly as far as float64
    holds them); any other arithmetic failure gives the branch-free row (NaN where a
    moment cannot be formed; the NaN/Inf counts and min/max are exact).
    """
    try:
        return capture_stats(t)
    except ArithmeticError:
        pass
    v = t.detach()
    if v.dtype == torch.float64 and v.layout == torch.strided and 0 not in v.stride():
        try:
            row = capture_stats(v * _TINY_SCALE)
            row[:6] /= _TINY_SCALE
            return row
        except ArithmeticError:
            pass
    return tensor_stats(v, sync_free=True, compiled=False)


def _prepare(t: torch.Tensor) -> Prepared:
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t):
        return Prepared(
            None, None, shape_of(t), str(t.dtype), skipped="FakeTensor (traced under FakeTensorMode): no data"
        )
    if t.device.type == "meta":
        return Prepared(None, None, shape_of(t), str(t.dtype), skipped="meta tensor: no data")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return _subclass(t)
    if t.layout in _SPARSE:
        return _sparse(t)
    if t.is_quantized:
        values = t.dequantize()
        q = {"dtype": str(t.dtype), "qscheme": str(t.qscheme())}
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            q.update(scale=float(t.q_scale()), zero_point=int(t.q_zero_point()))
        else:
            q.update(axis=int(t.q_per_channel_axis()))
        return Prepared(t, safe_stats(values), list(t.shape), str(values.dtype), storage={"quantized": q})
    if t.is_nested:
        flat = flat_values(t)
        return Prepared(
            t,
            safe_stats(flat),
            [flat.numel()],
            str(t.dtype),
            storage={"nested": [list(p.shape) for p in t.unbind()]},
        )
    dims = broadcast_dims(t)
    if dims:
        held = first_slice(t, dims)
        sizes = list(held.shape)
        base = [math.prod(sizes[d + 1 :]) for d in range(len(sizes))]  # row-major, as stored
        strides = [0 if d in dims else s for d, s in enumerate(base)]
        view = {"base": [sizes, base, 0], "view": [list(t.shape), strides, 0]}
        return Prepared(held, safe_stats(t), list(t.shape), str(t.dtype), storage={"expand": view})
    return Prepared(t, safe_stats(t), list(t.shape), str(t.dtype))


def _subclass(t: torch.Tensor) -> Prepared:
    name = f"{type(t).__module__}.{type(t).__qualname__}"
    to_local = getattr(t, "to_local", None)
    mesh = getattr(t, "device_mesh", None)
    if callable(to_local) and mesh is not None:  # a DTensor: its local shard
        local = to_local()
        inner = _prepare(local)
        inner.storage = {
            **(inner.storage or {}),
            "dtensor": {
                "placements": [str(p) for p in t.placements],
                "mesh": list(mesh.shape),
                "global_shape": list(t.shape),
            },
        }
        return inner
    if hasattr(type(t), "__tensor_flatten__"):
        return Prepared(
            None,
            None,
            shape_of(t),
            str(t.dtype),
            skipped=f"tensor subclass {name}: a wrapper without storage of its own",
        )
    with torch._C.DisableTorchFunctionSubclass():
        plain = t.as_subclass(torch.Tensor)
    inner = _prepare(plain)
    inner.storage = {**(inner.storage or {}), "subclass": name}
    return inner


def _sparse(t: torch.Tensor) -> Prepared:
    """Sparse tensors: statistics from the stored values and the implicit zeros, never dense."""
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
    values = t.values()
    row = safe_stats(values).tolist()
    n, nnz = t.numel(), values.numel()
    zeros = n - nnz  # implicit zeros (block formats store whole blocks: their numel counts)
    if zeros > 0:
        nan, inf = row[6], row[7]
        finite = nnz - nan - inf
        total = row[2] * finite if finite else 0.0
        count = finite + zeros
        mean = total / count
        l2 = 0.0 if math.isnan(row[5]) else row[5]
        lo = 0.0 if math.isnan(row[0]) else min(row[0], 0.0)
        hi = 0.0 if math.isnan(row[1]) else max(row[1], 0.0)
        std = math.sqrt(max(l2 * l2 / count - mean * mean, 0.0))
        row = [lo, hi, mean, std, max(abs(lo), abs(hi)), l2, nan, inf, float(n)]
    return Prepared(
        t,
        torch.tensor(row, dtype=torch.float64),
        list(t.shape),
        str(t.dtype),
        storage={"layout": _SPARSE[t.layout], "nnz": int(t._nnz())},
    )
