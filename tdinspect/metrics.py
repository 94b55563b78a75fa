"""Divergence metrics: the one definition used by Diff, replay, the CLI and the widgets.

``y`` is the reference run (the first argument of a diff), ``x`` the other.

==========  ==============================================  ===========  =========
metric      definition                                      diverges     default
==========  ==============================================  ===========  =========
rel_diff    ``1 - 2Σxy/(Σx²+Σy²)`` = ``Σ(x-y)²/(Σx²+Σy²)``   above        1e-3
max_abs     ``max |x-y|``                                   above        1e-3
mean_abs    ``mean |x-y|``                                  above        1e-4
max_rel     ``max |x-y| / max(|y|, eps)``                   above        1e-2
cosine      ``Σxy / (‖x‖‖y‖)``, 1 when both are zero         below        0.99
sqnr_db     ``10·log10(Σy² / Σ(x-y)²)``, inf when equal      below        30
mismatch    fraction outside ``atol + rtol·|y|``            above        0
equal       bitwise equality (1 or 0)                       below (0)    1
==========  ==============================================  ===========  =========

``rel_diff`` is computed in its second form, which is the same number without
the cancellation of the first when the runs are close (≈ ½·relative L2 error²,
so 1e-3 fires near 4.5%). Every element is compared in float64 and every sum
accumulated in float64, in one fused read of both tensors
(:mod:`tdinspect.kernels`).
``mismatch`` uses ``torch.testing.assert_close``'s default tolerances for the
pair's dtypes (the looser of the two). Only elements finite on both sides
enter the numbers; NaN/Inf where the other side is finite is a *structural*
divergence, reported with its reason.

When the dtypes differ, ``rel_diff_cast`` and ``max_abs_cast`` compare after
rounding the wider side to the narrower dtype (what the narrow run could at
best have produced).

Examples
--------
>>> import torch
>>> m = compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
>>> round(m["max_abs"], 3), m["equal"]
(0.5, 0.0)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .kernels import EPS, PairSums, pair_sums
from .stats import broadcast_dims, first_slice

try:  # torch.testing's own table of defaults (private, but the source of truth)
    from torch.testing._comparison import default_tolerances as _torch_tolerances
except ImportError:  # pragma: no cover - very old or very new torch
    _torch_tolerances = None


@dataclass(frozen=True)
class Metric:
    """How one metric is read: which way it diverges and its default threshold."""

    name: str
    higher_is_worse: bool
    default_threshold: float
    description: str

    def diverges(self, value: float, threshold: float) -> bool:
        """Whether ``value`` passes ``threshold`` in this metric's bad direction."""
        if value is None or math.isnan(value):
            return False
        return value > threshold if self.higher_is_worse else value < threshold


METRICS: dict[str, Metric] = {m.name: m for m in [
    Metric("rel_diff", True, 1e-3, "1 - 2Σxy/(Σx²+Σy²), scale-free, 0 when identical"),
    Metric("max_abs", True, 1e-3, "max |x - y|"),
    Metric("mean_abs", True, 1e-4, "mean |x - y|"),
    Metric("max_rel", True, 1e-2, "max |x - y| / |y|"),
    Metric("cosine", False, 0.99, "cosine similarity; diverges below the threshold"),
    Metric("sqnr_db", False, 30.0, "signal-to-quantisation-noise ratio in dB; diverges below"),
    Metric("mismatch", True, 0.0, "fraction of elements outside assert_close's atol + rtol·|y|"),
    Metric("equal", False, 1.0, "1 when bitwise equal; diverges when 0"),
    Metric("stats_rel", True, 1e-3, "statistics-only diff: max relative difference of min, max, "
                                   "mean, l2"),
]}
TENSOR_METRICS = ("rel_diff", "max_abs", "mean_abs", "max_rel", "cosine", "sqnr_db", "mismatch",
                  "equal", "rel_diff_cast", "max_abs_cast")
_FLOAT8_RTOL = {"float8_e4m3fn": 0.125, "float8_e4m3fnuz": 0.125, "float8_e5m2": 0.25,
                "float8_e5m2fnuz": 0.25, "float8_e8m0fnu": 1.0}


def metric(name: str) -> Metric:
    """Look a metric up by name (clear error listing the known ones)."""
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; choose one of {sorted(METRICS)}") from None


@functools.lru_cache(maxsize=None)  # torch's lookup costs ~60 us; diffs call it per entry
def tolerances(*dtypes: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)``: ``assert_close`` defaults, the looser over ``dtypes``."""
    rtol = atol = 0.0
    for dt in dtypes:
        name = str(dt).removeprefix("torch.")
        if name in _FLOAT8_RTOL:
            r, a = _FLOAT8_RTOL[name], 1e-5
        elif _torch_tolerances is not None:
            r, a = _torch_tolerances(dt)
        else:  # pragma: no cover
            r, a = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
                    torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7)}.get(dt, (0.0, 0.0))
        rtol, atol = max(rtol, r), max(atol, a)
    return rtol, atol


def _real(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        return torch.view_as_real(t)
    return t


def _compute_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """The dtype both sides are handed to the kernel in (exact for every float up to 32 bits)."""
    return torch.float64 if torch.float64 in (a.dtype, b.dtype) or not (
        a.is_floating_point() and b.is_floating_point()) else torch.float32


def _nonfinite_mismatch(x: torch.Tensor, y: torch.Tensor) -> int:
    """Elements where NaN/Inf on one side meets something else on the other."""
    xn, yn = torch.isnan(x), torch.isnan(y)
    bad = (xn != yn)
    xi, yi = torch.isinf(x), torch.isinf(y)
    bad |= (xi | yi) & ~(xn | yn) & (x != y)
    return int(bad.sum())


def _sums(xr: torch.Tensor, yr: torch.Tensor, dt: torch.dtype, rtol: float, atol: float,
          chunk: int) -> PairSums:
    """The kernel's sums of two flat tensors, converted to ``dt`` a chunk at a time if needed."""
    if xr.dtype == yr.dtype == dt and xr.is_contiguous() and yr.is_contiguous():
        return pair_sums(xr.numpy(), yr.numpy(), rtol=rtol, atol=atol)  # no copy at all
    s = PairSums()
    for i in range(0, xr.numel(), chunk):  # memory stays bounded for huge tensors
        s += pair_sums(xr[i:i + chunk].to(dt).contiguous().numpy(),
                       yr[i:i + chunk].to(dt).contiguous().numpy(), rtol=rtol, atol=atol)
    return s


def compare_tensors(x: torch.Tensor, y: torch.Tensor, *, chunk: int = 1 << 18) -> dict[str, float]:
    """All tensor metrics of ``x`` against the reference ``y`` (same shape).

    Parameters
    ----------
    x, y : torch.Tensor
        The compared tensor and the reference; any dtypes (compared as numbers).
    chunk : int
        Elements converted at a time when a dtype conversion or a copy is
        needed: memory stays bounded for huge tensors.

    Returns
    -------
    dict
        The metrics of the module table, plus ``nonfinite_mismatch`` (count of
        NaN/Inf positions that differ) and, when dtypes differ, the ``_cast``
        metrics.
    """
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: {list(x.shape)} vs {list(y.shape)}")
    both = broadcast_dims(x) & broadcast_dims(y)  # broadcast on both sides: one copy says it all
    x, y = first_slice(x, both), first_slice(y, both)
    same_dtype = x.dtype == y.dtype
    out = {k: math.nan for k in TENSOR_METRICS}
    out["nonfinite_mismatch"] = 0.0
    if same_dtype and torch.equal(x, y):  # the common case in same-backend runs: nothing to do
        out.update(rel_diff=0.0, max_abs=0.0, mean_abs=0.0, max_rel=0.0, cosine=1.0,
                   sqnr_db=math.inf, mismatch=0.0, equal=1.0)
        return out
    out["equal"] = 0.0
    xr, yr = _real(x).detach().reshape(-1), _real(y).detach().reshape(-1)
    dt = _compute_dtype(x, y)
    rtol, atol = tolerances(x.dtype, y.dtype)
    s = _sums(xr, yr, dt, rtol, atol, chunk)
    if not (math.isfinite(s.sxx) and math.isfinite(s.syy)):
        # A NaN/Inf somewhere (squares of finite values up to float32's range cannot
        # overflow float64): count where the sides disagree, then compare only the
        # elements finite on both. Finite tensors, the usual case, are read once.
        out["nonfinite_mismatch"] = float(_nonfinite_mismatch(xr, yr))
        keep = torch.isfinite(xr) & torch.isfinite(yr)
        s = _sums(xr[keep], yr[keep], dt, rtol, atol, chunk)
    m = s.n
    denom = s.sxx + s.syy
    out["rel_diff"] = s.sdd / denom if denom > 0 else 0.0
    out["max_abs"] = s.max_abs
    out["mean_abs"] = s.sabs / m if m else 0.0
    out["max_rel"] = s.max_rel
    if s.sxx <= EPS * EPS and s.syy <= EPS * EPS:
        out["cosine"] = 1.0
    elif s.sxx > 0 and s.syy > 0:
        sxy = (s.sxx + s.syy - s.sdd) / 2  # Σxy derived, not summed: only cosine needs it
        out["cosine"] = sxy / math.sqrt(s.sxx * s.syy)
    else:
        out["cosine"] = 0.0
    out["sqnr_db"] = math.inf if s.sdd == 0 else (
        10 * math.log10(s.syy / s.sdd) if s.syy > 0 else -math.inf)
    out["mismatch"] = s.mismatch / m if m else 0.0
    if not same_dtype and x.is_floating_point() and y.is_floating_point():
        narrow = min((x.dtype, y.dtype), key=lambda d: torch.finfo(d).bits)
        cast = compare_tensors(x.to(narrow), y.to(narrow), chunk=chunk) \
            if x.dtype != narrow or y.dtype != narrow else out
        out["rel_diff_cast"], out["max_abs_cast"] = cast["rel_diff"], cast["max_abs"]
    return out


STAT_COMPARED = ("min", "max", "mean", "l2")


def stats_rel(a: dict[str, float], b: dict[str, float]) -> float:
    """Statistics-only divergence: max over min, max, mean, l2 of ``|a-b| / max(|b|, eps)``.

    ``b`` is the reference. NaN statistics (empty tensors) are skipped.
    """
    worst = 0.0
    for s in STAT_COMPARED:
        va, vb = a.get(s, math.nan), b.get(s, math.nan)
        if math.isnan(va) and math.isnan(vb):
            continue
        if math.isnan(va) or math.isnan(vb):
            return math.inf
        worst = max(worst, abs(va - vb) / max(abs(vb), EPS))
    return worst
