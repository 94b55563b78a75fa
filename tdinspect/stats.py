"""Per-tensor statistics: the one definition used by capture and by the loader.

Capture computes them when it writes a pass (into the sidecar); the loader
computes them for dumps written by other tools. Both call :func:`tensor_stats`,
so a statistic means the same thing whoever wrote the dump.

Definitions (over the *finite* elements; complex tensors use their magnitude,
bool and integer tensors their numeric value):

========  ===========================================================
min/max   smallest / largest finite value
mean      arithmetic mean
std       population standard deviation (``correction=0``)
absmax    ``max(|min|, |max|)``
l2        Euclidean norm, ``sqrt(sum(x**2))``
nan       number of NaN elements
inf       number of +/-Inf elements
numel     number of elements (all of them)
========  ===========================================================

Examples
--------
>>> import torch
>>> from tdinspect.stats import tensor_stats, stats_to_dict
>>> stats_to_dict(tensor_stats(torch.tensor([1.0, -3.0, float("nan")])))["absmax"]
3.0
"""

from __future__ import annotations

import math

import torch

STAT_NAMES: tuple[str, ...] = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "numel")

_NAN_ROW = [math.nan] * 6


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """A real, reducible view of ``t``: upcast narrow floats, magnitudes of complex."""
    if t.is_complex():
        t = t.abs()
    if t.dtype == torch.bool:
        return t.to(torch.float32)
    if not t.is_floating_point():
        return t.to(torch.float64)
    if t.element_size() < 4:  # float16, bfloat16, float8 variants: reductions want float32
        return t.to(torch.float32)
    return t


def broadcast_dims(t: torch.Tensor) -> set[int]:
    """Dims that repeat one slice (stride 0, size > 1, as ``expand`` makes): a huge-shaped
    tensor may hold few distinct values, and is reduced as those."""
    return {dim for dim, (size, stride) in enumerate(zip(t.shape, t.stride()))
            if stride == 0 and size > 1}


def first_slice(t: torch.Tensor, dims) -> torch.Tensor:
    """``t`` narrowed to index 0 along ``dims``."""
    for dim in dims:
        t = t.narrow(dim, 0, 1)
    return t


def _unexpand(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Undo broadcasting: the stored elements and how many times each appears."""
    dims = broadcast_dims(t)
    return first_slice(t, dims), math.prod(t.shape[d] for d in dims)


def _finite_row_cpu(v: torch.Tensor, n: int) -> list[float] | None:
    """The statistics row in plain floats when ``v`` is all finite, else ``None``.

    Three vectorised reductions (aminmax, sum, norm) and scalar arithmetic in
    Python: on CPU the per-call overhead of small tensor ops would cost more
    than the reductions themselves.
    """
    lo, hi = (x.item() for x in torch.aminmax(v))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    total = v.sum(dtype=torch.float64 if v.dtype == torch.float64 else None).item()
    l2 = torch.linalg.vector_norm(v).item()
    mean = total / n
    var = max(l2 * l2 / n - mean * mean, 0.0)
    if mean * mean > 1e3 * var:  # cancellation: recompute from centred values
        var = (v.double() - mean).square().mean().item()
    return [lo, hi, mean, math.sqrt(var), max(abs(lo), abs(hi)), l2, 0.0, 0.0, float(n)]


def tensor_stats(t: torch.Tensor, *, sync_free: bool | None = None) -> torch.Tensor:
    """Statistics of ``t`` as a float64 vector ordered like :data:`STAT_NAMES`.

    The result stays on ``t``'s device, so a caller on CUDA can gather many of
    them and copy to the host once.

    Parameters
    ----------
    t : torch.Tensor
        Any dtype, any shape, any device; empty tensors give NaN statistics.
    sync_free : bool, optional
        Compute without a host round trip (branch-free masked reductions).
        Defaults to ``True`` on accelerators and ``False`` on CPU, where the
        fast path (three reductions when everything is finite) is cheaper.

    Examples
    --------
    >>> tensor_stats(torch.ones(4))[:3].tolist()
    [1.0, 1.0, 1.0]
    """
    t = t.detach()
    n = t.numel()
    if n == 0:
        return torch.tensor(_NAN_ROW + [0.0, 0.0, 0.0], dtype=torch.float64, device=t.device)
    t, copies = _unexpand(t)
    if copies > 1:  # every stored element appears `copies` times: same min/max/mean/std
        row = tensor_stats(t, sync_free=sync_free)
        return row * torch.tensor([1, 1, 1, 1, 1, math.sqrt(copies), copies, copies, copies],
                                  dtype=torch.float64, device=row.device)
    v = _as_real(t)  # full reductions need no reshape (which would copy a strided view)
    if sync_free is None:
        sync_free = v.device.type != "cpu"
    if not sync_free:
        fast = _finite_row_cpu(v, n)
        if fast is not None:
            return torch.tensor(fast, dtype=torch.float64)
    finite = torch.isfinite(v)
    n_finite = finite.sum()
    n_nan = torch.isnan(v).sum()
    n_inf = (n - n_finite - n_nan).double()
    if not sync_free:
        kept = v[finite]
        row = _finite_row_cpu(kept, kept.numel()) if kept.numel() else _NAN_ROW + [0.0] * 3
        row[6:9] = [float(n_nan), float(n_inf), float(n)]
        return torch.tensor(row, dtype=torch.float64)
    # sync-free: masked reductions, no host round trip
    inf = torch.tensor(math.inf, dtype=v.dtype, device=v.device)
    lo = torch.where(finite, v, inf).min().double()
    hi = torch.where(finite, v, -inf).max().double()
    zeroed = torch.where(finite, v, torch.zeros((), dtype=v.dtype, device=v.device)).double()
    cnt = n_finite.double()
    mean = zeroed.sum() / cnt
    sq = zeroed.square().sum()
    var = (sq / cnt - mean * mean).clamp_min(0)
    std, l2 = var.sqrt(), sq.sqrt()
    empty = n_finite == 0
    nan = torch.tensor(math.nan, dtype=torch.float64, device=v.device)
    lo, hi, mean, std, l2 = (torch.where(empty, nan, x) for x in (lo, hi, mean, std, l2))
    lo, hi = lo.double(), hi.double()
    return torch.stack([lo, hi, mean, std, torch.maximum(lo.abs(), hi.abs()), l2,
                        n_nan.double(), n_inf, torch.tensor(float(n), dtype=torch.float64,
                                                            device=v.device)])


def stats_to_dict(vec: torch.Tensor | list[float]) -> dict[str, float]:
    """Name the entries of a statistics vector (see :data:`STAT_NAMES`)."""
    values = vec.tolist() if isinstance(vec, torch.Tensor) else list(vec)
    return dict(zip(STAT_NAMES, values))
