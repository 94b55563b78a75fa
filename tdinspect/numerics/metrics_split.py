"""The divergence metrics of a pair held in parts: several pieces, or one value per position.

Both compute exactly what :func:`tdinspect.numerics.metrics.compare_tensors` defines,
from the same float64 sums (``Σx²``, ``Σy²``, ``Σ(x-y)²``, ``Σ|x-y|``, the
maxima and the mismatch count, which add up or take the larger across parts,
as the kernel's own chunks do) and the same final formulas
(:func:`tdinspect.numerics.metrics._from_sums`). Where the one-call path would take a
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

from tdinspect.numerics.kernels import (
    EPS,
    NUMBA_MIN_BYTES,
    UINT_OF,
    PairSums,
    decode_table,
    pair_sums,
    row_sums,
)
from tdinspect.numerics.metrics import (
    _CODED,
    _IDENTICAL,
    STORED,
    TENSOR_METRICS,
    _compute_dtype,
    _sums,
    as_stored,
    compare_tensors,
    equal_bytes,
    metric,
    same_bits,
    settled,
    tolerances,
)
from tdinspect.numerics.slices import SLICE_COLUMNS, worst_slices


def _identical_slices() -> dict[str, float]:
    """The slices of a pair bitwise equal piece by piece: each is identical."""
    return {c: _IDENTICAL[c.removeprefix("slice_")] for c in SLICE_COLUMNS}


def _as_row(s: PairSums) -> list[float]:
    return [s.sxx, s.syy, s.sdd, s.sabs, s.max_abs, s.max_rel, float(s.mismatch)]


def _plain_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and not dtype.is_complex


def compare_pieces(
    pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], *, chunk: int = 1 << 18, slices=None
) -> dict[str, float] | None:
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
    if not _plain_float(dtype) or any(
        x.dtype != dtype or y.dtype != dtype or x.shape != y.shape for x, y in pieces
    ):
        return None
    if dtype in STORED:  # as stored, without a torch call a piece (see stored_pieces_metrics)
        arrays = [(as_stored(x, dtype), as_stored(y, dtype)) for x, y in pieces]
        if all(x is not None and y is not None for x, y in arrays):
            return stored_pieces_metrics(arrays, dtype, slices)
    if isinstance(slices, int):
        return None  # rows of a dtype not stored as numpy: the caller's whole road
    out = {k: math.nan for k in TENSOR_METRICS}
    out["nonfinite_mismatch"] = 0.0
    if all(same_bits(x, y) for x, y in pieces):
        out.update(_IDENTICAL)
        if slices is not None and len(pieces) > 1:
            out.update(_identical_slices())
        return out
    rtol, atol = tolerances(dtype, dtype)
    dt = _compute_dtype(pieces[0][0], pieces[0][1])
    # numba or numpy as the whole pair's size decides (never by piece: a pair's sums must not
    # depend on how it was stored)
    total = sum(x.numel() * x.element_size() for x, _ in pieces)  # bytes a side
    min_numba = 0 if total >= NUMBA_MIN_BYTES else 1 << 62  # every piece, or none
    s = PairSums()
    each = []
    for x, y in pieces:
        p = _sums(x.detach().reshape(-1), y.detach().reshape(-1), dt, rtol, atol, chunk, min_numba=min_numba)
        each.append(p)
        s += p
    row = settled(s, dt == torch.float64)
    if row is None:
        return None
    out.update(row)
    if slices is not None and len(each) > 1:
        out.update(worst_slices(np.array([_as_row(p) for p in each]), np.array([p.n for p in each])))
    return out


def stored_pieces_metrics(
    pieces: list[tuple[np.ndarray, np.ndarray]], dtype: torch.dtype, slices=None
) -> dict[str, float] | None:
    """:func:`compare_pieces` of pieces given as flat numpy arrays of what they store (one dtype
    of :data:`~tdinspect.numerics.metrics.STORED`, narrow floats as their bits; ``x`` the
    compared side): the same sums, kernel and formulas, with no torch call.

    numpy slices and a kernel that releases the GIL let the threads of a diff compare
    side by side; a torch call releases and takes the GIL back (token-aligned passes
    made 8x the thread switches of a plain diff, and ran 1.5x its time, with one a piece).

    ``slices`` as for :func:`compare_pieces`: with rows (an int), each piece's rows are summed
    in the same read (:func:`~tdinspect.numerics.kernels.row_sums`) and the pair's sums are
    theirs added up.

    Examples
    --------
    >>> x, y = np.arange(6, dtype=np.float32), np.arange(6, dtype=np.float32) + 0.5
    >>> stored_pieces_metrics([(x[:2], y[:2]), (x[2:], y[2:])], torch.float32)["max_abs"]
    0.5
    """
    out = dict.fromkeys(TENSOR_METRICS, math.nan)
    out["nonfinite_mismatch"] = 0.0
    if isinstance(slices, int) and (slices <= 0 or any(x.shape[0] % slices for x, _ in pieces)):
        return None  # pieces not cut at rows: the caller's road
    if all(equal_bytes(x.view(np.uint8), y.view(np.uint8)) for x, y in pieces):
        out.update(_IDENTICAL)
        many = sum(x.shape[0] // slices for x, _ in pieces) if isinstance(slices, int) else len(pieces)
        if slices is not None and many > 1:
            out.update(_identical_slices())
        return out
    rtol, atol = tolerances(dtype, dtype)
    codes = STORED[dtype][1]
    # numba or numpy as the whole pair's size decides (never by piece: a pair's sums must not
    # depend on how it was stored)
    total = sum(x.nbytes for x, _ in pieces)
    min_numba = 0 if total >= NUMBA_MIN_BYTES else 1 << 62
    found = worst = None
    if isinstance(slices, int):
        s = PairSums()
        each = []
        for x, y in pieces:
            p, w = row_sums(x, y, slices, rtol=rtol, atol=atol, codes=codes, min_numba=min_numba)
            s += p
            each.append(w)
        if s.n > slices:  # two rows or more
            worst = _worse(each)
    else:
        each = [pair_sums(x, y, rtol=rtol, atol=atol, codes=codes, min_numba=min_numba) for x, y in pieces]
        s = PairSums()
        for p in each:
            s += p
        found = np.array([_as_row(p) for p in each]) if slices is not None else None
        counts = np.array([p.n for p in each])
    row = settled(s, dtype == torch.float64)
    if row is None:
        return None
    out.update(row)
    if found is not None and found.shape[0] > 1:
        out.update(worst_slices(found, counts))
    if worst is not None:
        out.update(worst)
    return out


_ROW_WORST = ("rel_diff", "mean_abs", "cosine", "sqnr_db", "mismatch")


def _worse(each: list[tuple[float, ...]]) -> dict[str, float]:
    """``slice_<metric>`` of pieces' worst rows (:func:`row_sums`' order; a few pieces a pair:
    plain Python, no numpy call)."""
    out = {}
    for k, name in enumerate(_ROW_WORST):
        v = [w[k] for w in each if not math.isnan(w[k])]
        worst = (min(v) if name in ("cosine", "sqnr_db") else max(v)) if v else math.nan
        out[f"slice_{name}"] = float(worst)
    out["slice_rel_diff_cast"] = out["slice_rel_diff"]  # one dtype
    return out


def compare_positions(x: torch.Tensor, y: torch.Tensor, name: str, *, chunk: int = 1 << 18) -> np.ndarray:
    """``compare_tensors(x[j], y[j])[name]`` for every position ``j`` of dim 0, in one pass.

    Parameters
    ----------
    x, y : torch.Tensor
        Compared and reference, one shape; positions along dim 0.
    name : str
        A tensor metric (:data:`tdinspect.numerics.metrics.TENSOR_METRICS`).
    chunk : int
        About how many elements are taken to float64 at a time.

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
        raise ValueError(
            f"compare_positions needs two tensors of one shape with a position dim, "
            f"got {list(x.shape)} and {list(y.shape)}"
        )
    npos = x.shape[0]
    values = np.full(npos, math.nan)
    width = math.prod(x.shape[1:])
    slow = np.ones(npos, bool)
    if x.dtype == y.dtype and _plain_float(x.dtype) and 0 < width <= chunk:
        (xs, lut), (ys, _) = (_as_numpy(t.detach().reshape(npos, width)) for t in (x, y))
        rtol, atol = tolerances(x.dtype, y.dtype)
        step = min(npos, max(1, chunk // width))
        work = _Work(step, width)  # reused by every block: no page faults after the first
        for start in range(0, npos, step):
            stop = min(npos, start + step)
            work.block(
                xs[start:stop],
                ys[start:stop],
                lut,
                name,
                rtol,
                atol,
                x.dtype,
                values[start:stop],
                slow[start:stop],
            )
    elif width == 0:
        slow[:] = False  # empty slices are bitwise equal
        values[:] = _IDENTICAL[name]
    for j in np.flatnonzero(slow):
        values[j] = compare_tensors(x[j], y[j], chunk=chunk)[name]
    return values


def _as_numpy(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
    """``(array, decode table)``: float32/float64 as they are, narrow floats as their raw bits
    with the table of their float64 values (torch's conversions run on its thread pool)."""
    if t.dtype in (torch.float32, torch.float64):
        return t.contiguous().numpy(), None
    return t.contiguous().view(_CODED[t.dtype]).numpy(), decode_table(t.dtype)


class _Work:
    """float64 buffers for one block of positions."""

    def __init__(self, rows: int, width: int):
        self.xf, self.yf, self.d, self.ay, self.tmp = (np.empty((rows, width)) for _ in range(5))
        self.flag = np.empty((rows, width), bool)

    def block(self, xa, ya, lut, name, rtol, atol, dtype, values, slow) -> None:
        """Fill ``values`` for the rows of one block (values, or raw bits decoded by ``lut``)
        that the vectorised sums settle exactly, clearing their ``slow`` flag."""
        k = xa.shape[0]
        xf, yf, d, ay, tmp, flag = (b[:k] for b in (self.xf, self.yf, self.d, self.ay, self.tmp, self.flag))
        same = (xa.view(UINT_OF[xa.itemsize]) == ya.view(UINT_OF[ya.itemsize])).all(1)
        if lut is None:
            np.copyto(xf, xa)
            np.copyto(yf, ya)
        else:
            np.take(lut, xa, out=xf)
            np.take(lut, ya, out=yf)
        with np.errstate(all="ignore"):
            sxx = np.square(xf, out=tmp).sum(1)
            syy = np.square(yf, out=tmp).sum(1)
            np.subtract(xf, yf, out=d)
            sdd = np.square(d, out=tmp).sum(1)
            np.abs(d, out=d)
            sabs = d.sum(1)
            max_abs = d.max(1)
            np.abs(yf, out=ay)
            np.maximum(ay, EPS, out=tmp)
            max_rel = np.divide(d, tmp, out=tmp).max(1)
            np.multiply(ay, rtol, out=tmp)
            tmp += atol
            mismatch = np.count_nonzero(np.greater(d, tmp, out=flag), axis=1)
        wide = dtype == torch.float64
        n = xa.shape[1]
        for j in range(k):
            if same[j]:
                values[j], slow[j] = _IDENTICAL[name], False
                continue
            row = settled(
                PairSums(
                    n,
                    float(sxx[j]),
                    float(syy[j]),
                    float(sdd[j]),
                    float(sabs[j]),
                    float(max_abs[j]),
                    float(max_rel[j]),
                    int(mismatch[j]),
                ),
                wide,
            )
            if row is not None:
                values[j], slow[j] = row[name], False
