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


def _moments(v: torch.Tensor, count: torch.Tensor | int) -> list[torch.Tensor]:
    var, mean = torch.var_mean(v, correction=0)
    var, mean = var.double(), mean.double()
    return [mean, var.sqrt(), (var + mean * mean).mul(count).sqrt()]


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
        fast path (two reductions when everything is finite) is cheaper.

    Examples
    --------
    >>> tensor_stats(torch.ones(4))[:3].tolist()
    [1.0, 1.0, 1.0]
    """
    t = t.detach()
    n = t.numel()
    if n == 0:
        return torch.tensor(_NAN_ROW + [0.0, 0.0, 0.0], dtype=torch.float64, device=t.device)
    v = _as_real(t).reshape(-1)
    if sync_free is None:
        sync_free = v.device.type != "cpu"
    lo, hi = torch.aminmax(v)
    if not sync_free and math.isfinite(lo.item()) and math.isfinite(hi.item()):
        zero = torch.zeros((), dtype=torch.float64, device=v.device)
        lo, hi = lo.double(), hi.double()
        rest = _moments(v, n)
        return torch.stack([lo, hi, *rest[:2], torch.maximum(lo.abs(), hi.abs()), rest[2],
                            zero, zero, zero + n])
    finite = torch.isfinite(v)
    n_finite = finite.sum()
    n_nan = torch.isnan(v).sum()
    n_inf = (n - n_finite - n_nan).double()
    if not sync_free:
        kept = v[finite]
        if kept.numel() == 0:
            row = torch.tensor(_NAN_ROW, dtype=torch.float64, device=v.device)
            return torch.cat([row, torch.stack([n_nan.double(), n_inf,
                                                torch.tensor(float(n), dtype=torch.float64)])])
        lo, hi = torch.aminmax(kept)
        mean, std, l2 = _moments(kept, kept.numel())
    else:
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
