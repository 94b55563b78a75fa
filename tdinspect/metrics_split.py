"""The divergence metrics of a pair held in parts: several pieces, or one value per position.

Both compute exactly what :func:`tdinspect.metrics.compare_tensors` defines,
from the same float64 sums (``Σx²``, ``Σy²``, ``Σ(x-y)²``, ``Σ|x-y|``, the
maxima and the mismatch count, which add up or take the larger across parts,
as the kernel's own chunks do) and the same final formulas
(:func:`tdinspect.metrics._from_sums`). Where the one-call path would take a
special road (a NaN or Inf to mask, float64 sums out of range to rescale,
``Σxy`` to sum directly, integers, complex numbers or two dtypes), the part
falls back to it: :func:`compare_pieces` returns ``None`` (the caller then
assembles the tensor), :func:`compare_positions` calls ``compare_tensors`` on
that position's slices.

- :func:`compare_pieces`: a concatenated (or unsharded) pair compared piece by
  piece against the matching slices of the other side, with no assembled copy.
- :func:`compare_positions`: one metric per position along the first dim in one
  vectorised pass (``Diff.per_position`` on long sequences).

Examples
--------
>>> import torch
>>> x, y = torch.arange(6.0), torch.arange(6.0) + 0.5
>>> parts = compare_pieces([(x[:2], y[:2]), (x[2:], y[2:])])
>>> parts["max_abs"], parts["mean_abs"]
(0.5, 0.5)
>>> compare_positions(x.reshape(3, 2), y.reshape(3, 2), "max_abs").tolist()
[0.5, 0.5, 0.5]
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from .kernels import EPS, NUMBA_MIN_ELEMENTS, PairSums
from .metrics import (_IDENTICAL, TENSOR_METRICS, _compute_dtype, _from_sums, _sums,
                      compare_tensors, metric, needs_rescaling, same_bits, sxy_derived, tolerances)


def _plain_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and not dtype.is_complex


def compare_pieces(pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                   chunk: int = 1 << 18) -> dict[str, float] | None:
    """The metrics of ``x`` against ``y`` given as matching ``(x_piece, y_piece)`` pairs.

    The pieces together hold every element of both tensors once (any order:
    the metrics are sums and maxima over elements). The result is
    ``compare_tensors(cat(x pieces), cat(y pieces))`` without the copies, to
    the rounding of the float64 sums; ``equal`` is 1 only when every piece is
    bitwise equal.

    Returns
    -------
    dict or None
        ``None`` where only the whole pair can be exact: dtypes that differ
        (across sides or pieces), integers, complex numbers, a NaN or Inf, float64
        sums out of range, norms far apart (``Σxy`` summed directly).
    """
    pieces = list(pieces)
    if not pieces:
        return None
    dtype = pieces[0][0].dtype
    if not _plain_float(dtype) or any(x.dtype != dtype or y.dtype != dtype or x.shape != y.shape
                                      for x, y in pieces):
        return None
    out = {k: math.nan for k in TENSOR_METRICS}
    out["nonfinite_mismatch"] = 0.0
    if all(same_bits(x, y) for x, y in pieces):
        out.update(_IDENTICAL)
        return out
    rtol, atol = tolerances(dtype, dtype)
    dt = _compute_dtype(pieces[0][0], pieces[0][1])
    # numba or numpy as the whole pair's size decides (never by piece: a pair's sums must not
    # depend on how it was stored)
    total = sum(x.numel() for x, _ in pieces)
    min_numba = 0 if total >= NUMBA_MIN_ELEMENTS else total + 1
    s = PairSums()
    for x, y in pieces:
        s += _sums(x.detach().reshape(-1), y.detach().reshape(-1), dt, rtol, atol, chunk,
                   min_numba=min_numba)
    if not (math.isfinite(s.sxx) and math.isfinite(s.syy)):
        return None  # NaN/Inf: compare_tensors masks them
    if dt == torch.float64 and needs_rescaling(s):
        return None
    sxy = sxy_derived(s)
    if sxy is None:
        return None
    out.update(_from_sums(s, sxy))
    out["equal"] = 0.0
    out["rel_diff_cast"], out["max_abs_cast"] = out["rel_diff"], out["max_abs"]
    return out


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compare_positions(x: torch.Tensor, y: torch.Tensor, name: str, *,
                      chunk: int = 1 << 18) -> np.ndarray:
    """``compare_tensors(x[j], y[j])[name]`` for every position ``j`` of dim 0, in one pass.

    Parameters
    ----------
    x, y : torch.Tensor
        Compared and reference, one shape; positions along dim 0.
    name : str
        A tensor metric (:data:`tdinspect.metrics.TENSOR_METRICS`).
    chunk : int
        About how many elements are converted to float64 at a time.

    Returns
    -------
    numpy.ndarray
        float64, one value per position. Positions with a NaN or Inf on a
        side (unless bitwise equal), float64 sums out of range or ``Σxy``
        needing a direct sum, and every position of integer, complex or
        mixed-dtype pairs, are computed by ``compare_tensors`` itself.
    """
    metric(name)
    if name not in TENSOR_METRICS:
        raise ValueError(f"{name!r} is not a tensor metric ({', '.join(TENSOR_METRICS)})")
    if x.shape != y.shape or x.dim() == 0:
        raise ValueError(f"compare_positions needs two tensors of one shape with a position dim, "
                         f"got {list(x.shape)} and {list(y.shape)}")
    npos = x.shape[0]
    values = np.full(npos, math.nan)
    width = math.prod(x.shape[1:])
    slow = np.ones(npos, bool)
    if x.dtype == y.dtype and _plain_float(x.dtype) and 0 < width <= chunk:
        xs, ys = x.detach().reshape(npos, width), y.detach().reshape(npos, width)
        rtol, atol = tolerances(x.dtype, y.dtype)
        step = max(1, chunk // width)
        for start in range(0, npos, step):
            stop = min(npos, start + step)
            _block(xs[start:stop], ys[start:stop], name, rtol, atol,
                   values[start:stop], slow[start:stop])
    elif width == 0:
        slow[:] = False  # empty slices are bitwise equal
        values[:] = _IDENTICAL[name]
    for j in np.flatnonzero(slow):
        values[j] = compare_tensors(x[j], y[j], chunk=chunk)[name]
    return values


def _block(x: torch.Tensor, y: torch.Tensor, name: str, rtol: float, atol: float,
           values: np.ndarray, slow: np.ndarray) -> None:
    """Fill ``values`` for the rows of one block that the vectorised sums settle exactly,
    clearing their ``slow`` flag."""
    bits = _INT_OF_SIZE[x.element_size()]
    same = torch.eq(x.contiguous().view(bits), y.contiguous().view(bits)).all(1).numpy()
    xf = x.to(torch.float64).numpy()
    yf = y.to(torch.float64).numpy()
    finite = np.isfinite(xf).all(1) & np.isfinite(yf).all(1)
    with np.errstate(all="ignore"):
        d = xf - yf
        ad = np.abs(d)
        ay = np.abs(yf)
        sxx = np.square(xf).sum(1)
        syy = np.square(yf).sum(1)
        sdd = np.square(d).sum(1)
        sabs = ad.sum(1)
        max_abs = ad.max(1)
        max_rel = (ad / np.maximum(ay, EPS)).max(1)
        mismatch = np.count_nonzero(ad > atol + rtol * ay, axis=1)
    wide = x.dtype == torch.float64
    n = x.shape[1]
    for j in range(x.shape[0]):
        if same[j]:
            values[j], slow[j] = _IDENTICAL[name], False
            continue
        if not finite[j]:
            continue
        s = PairSums(n, float(sxx[j]), float(syy[j]), float(sdd[j]), float(sabs[j]),
                     float(max_abs[j]), float(max_rel[j]), int(mismatch[j]))
        if wide and needs_rescaling(s):
            continue
        sxy = sxy_derived(s)
        if sxy is None:
            continue
        row = _from_sums(s, sxy)
        row["equal"] = 0.0
        row["rel_diff_cast"], row["max_abs_cast"] = row["rel_diff"], row["max_abs"]
        values[j], slow[j] = row[name], False
