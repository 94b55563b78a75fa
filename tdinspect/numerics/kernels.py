"""The per-pair sums behind the divergence metrics, in one read of both tensors.

Every tensor metric of :mod:`tdinspect.numerics.metrics` is a function of seven numbers
over the elements of ``x`` (compared) and ``y`` (reference):
``Σx²``, ``Σy²``, ``Σ(x-y)²``, ``Σ|x-y|``, ``max|x-y|``,
``max |x-y| / max(|y|, eps)`` and the count of ``|x-y| > atol + rtol·|y|``.
A NaN or Inf element makes ``Σx²`` or ``Σy²`` non-finite, which is how the
caller learns it must mask them (one read for the usual, finite, tensors).

All of it in float64, whatever the stored dtype (float32 arrays are widened
element by element). Two backends compute them:

``numba``
    One fused loop (:mod:`tdinspect.numerics.fused_loop`), compiled once per dtype (and
    cached on disk), vectorised over 16 lanes, run without the GIL so dask
    threads use every core. Measured 2.4 G float32 elements/s (19 GB/s of both
    sides) on one core of the development machine. bfloat16, float16 and float8 arrive as their raw bits and are
    decoded inside the loop by bit arithmetic, never converted as a whole.
``segment_sums``
    Every pair under :func:`segment_limit` bytes a side (64 KB): numpy
    elementwise kernels and ``reduceat`` over pairs laid end to end, whether
    the pair comes alone or with a pass's worth of others
    (:mod:`tdinspect.compare.smallpairs`): one order of additions, so the same bits
    either way.
``numpy``
    A loop over cache-sized chunks of numpy kernels (sixteen passes per chunk,
    1-2.5 GB/s), used where numba is not installed, for pairs too small to be
    worth loading numba, or when ``TDINSPECT_KERNEL=numpy`` is set. The two
    agree bit for bit on the maxima and the count, to rounding on the sums
    (tested).

Why not numpy alone: its per-chunk calls each take and release the GIL, so
two threads comparing two pass pairs ran *slower* than one (1.4 vs 2.4 GB/s
on 2 cores, measured), and fifteen passes over each chunk cannot approach the
memory-bound floor. numexpr's reductions are single-threaded and unvectorised
(0.26 GB/s measured).

Examples
--------
>>> import numpy as np
>>> s = pair_sums(np.array([1.0, 2.5]), np.array([1.0, 2.0]), rtol=0.0, atol=0.1)
>>> s.sdd, s.max_abs, s.mismatch
(0.25, 0.5, 1)
"""

from __future__ import annotations

import functools
import math
import os
import threading
from dataclasses import dataclass

import numpy as np

from tdinspect.numerics import lazy_numba

EPS = 1e-12
# Below this many bytes a side numpy's loop takes ~0.1 ms: not worth numba's one-time
# ~1.5 s (import, then the compiled kernel from its on-disk cache) in a small session.
# Bytes, not elements: a 64 KB bfloat16 pair in numpy's loop ran at half the floor.
NUMBA_MIN_BYTES = 1 << 16


@dataclass
class PairSums:
    """The seven numbers of one pair (or of several chunks, added up with ``+``)."""

    n: int = 0
    sxx: float = 0.0
    syy: float = 0.0
    sdd: float = 0.0
    sabs: float = 0.0
    max_abs: float = 0.0
    max_rel: float = 0.0
    mismatch: int = 0

    def __add__(self, other: PairSums) -> PairSums:
        return PairSums(
            self.n + other.n,
            self.sxx + other.sxx,
            self.syy + other.syy,
            self.sdd + other.sdd,
            self.sabs + other.sabs,
            max(self.max_abs, other.max_abs),
            max(self.max_rel, other.max_rel),
            self.mismatch + other.mismatch,
        )


# Pairs of fewer bytes a side than this are summed by :func:`segment_sums`, whether they
# come alone (compare_tensors, live comparison) or a pass's worth at a time (Diff): one
# order of additions for both, so a pair's numbers never depend on how it was reached.
SEGMENT_MAX_BYTES = 1 << 16
SEGMENT_SUMS = ("sxx", "syy", "sdd", "sabs", "max_abs", "max_rel", "mismatch")


def segment_sums(
    x: np.ndarray, y: np.ndarray, starts: np.ndarray, rtol, atol, codes: str | None = None
) -> np.ndarray:
    """The seven sums of many pairs at once: ``x`` and ``y`` (one length) hold the pairs
    one after another, pair ``j`` starting at ``starts[j]`` (increasing, from 0, none
    empty): float64 or float32 values, or with ``codes`` a narrow float's raw bits (as
    :func:`pair_sums` takes them), decoded exactly to float64 first.

    Returns a ``(7, len(starts))`` float64 array, rows in :data:`SEGMENT_SUMS` order
    (the mismatch count as a float, exact). ``rtol`` and ``atol`` are numbers or one per
    element (a batch of several dtypes).

    The order of additions is numpy's ``add.reduceat``: a segment's first element plus
    the pairwise sum of the rest (eight accumulators up to 128 elements, halves above).
    It depends only on the segment's own values and length, never on its neighbours
    or on where it lies in memory (every elementwise step is one IEEE operation), so a
    pair summed alone (``starts=[0]``) or among thousands gives the same bits. Error:
    pairwise summation's ``O(log2 n)`` roundings at most (``n/8 + log2 n`` for a
    segment up to 128 elements), within the ``n/16·eps`` the numba loop allows itself.

    The float64 temporaries live in this thread's reused buffers (:func:`_scratch`):
    fresh ones for a batch of 64K elements were fresh pages, and faulting them in took
    most of the time (a batch of 4,096 pairs of 16 float32: 2.65 ms with fresh ones,
    0.80 ms reused, measured).

    Examples
    --------
    >>> x, y = np.array([1.0, 2.5, 3.0]), np.array([1.0, 2.0, 1.0])
    >>> segment_sums(x, y, np.array([0, 2]), rtol=0.0, atol=0.1)[[2, 6]].tolist()
    [[0.25, 4.0], [1.0, 1.0]]
    """
    m = x.shape[0]
    if m <= SCRATCH_MAX:
        bufs = _scratch(m)
        xd, yd, t, d, ay, bits = (b[:m] for b in (*bufs[:5], bufs[7]))
    else:  # only what this function uses (no ones, no bool buffer)
        xd, yd, t, d, ay, bits = (*(np.empty(m) for _ in range(5)), np.empty(m, np.uint32))
    sums = np.empty((7, len(starts)))  # fresh: the caller keeps it, the buffers are reused
    with np.errstate(all="ignore"):  # NaN/Inf reach the sums on purpose: the caller's signal
        if codes is not None or x.dtype != np.float64:
            decode = _numpy_decoder(codes)
            decode(x, xd, bits)
            decode(y, yd, bits)
            x, y = xd, yd
        np.add.reduceat(np.multiply(x, x, out=t), starts, out=sums[0])
        np.add.reduceat(np.multiply(y, y, out=t), starts, out=sums[1])
        np.subtract(x, y, out=d)
        np.add.reduceat(np.multiply(d, d, out=t), starts, out=sums[2])
        ad = np.abs(d, out=d)
        np.add.reduceat(ad, starts, out=sums[3])
        np.maximum.reduceat(ad, starts, out=sums[4])
        np.abs(y, out=ay)
        np.divide(ad, np.maximum(ay, EPS, out=t), out=t)
        np.maximum.reduceat(t, starts, out=sums[5])
        ay *= rtol
        ay += atol
        # the count summed as float64 zeros and ones (exact in any order)
        np.add.reduceat(np.greater(ad, ay, out=t), starts, out=sums[6])
    return sums


# segment_sums keeps its temporaries between calls up to this many elements (a batch's
# group, GROUP_ELEMENTS plus one pair, is under it); a larger call gets fresh ones
SCRATCH_MAX = 1 << 18


def decoded(v: np.ndarray, codes: str | None = None) -> np.ndarray:
    """The float64 values of a 1-D array of float32/float64 values, or of a narrow float's
    raw bits (``codes``: its torch dtype name), as a new array (exact)."""
    if codes is None:
        return v.astype(np.float64)
    if codes == "bfloat16":
        return (v.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if codes == "float16":
        return v.view(np.float16).astype(np.float64)
    return decode_table(codes)[v]


def _one_segment(x: np.ndarray, y: np.ndarray, rtol: float, atol: float, codes: str | None) -> PairSums:
    """A small pair's sums: :func:`segment_sums` with one segment (a batch's order)."""
    if x.shape[0] == 0:
        return PairSums()
    s = segment_sums(x, y, _FIRST, rtol, atol, codes)[:, 0].tolist()
    return PairSums(x.shape[0], *s[:6], int(s[6]))


_FIRST = np.zeros(1, np.intp)


def segment_limit(min_numba: int = NUMBA_MIN_BYTES) -> int:
    """Pairs of fewer bytes a side than this go through :func:`segment_sums` (alone or in
    a batch); ``min_numba=0`` sends every pair to the compiled loop."""
    return min(SEGMENT_MAX_BYTES, min_numba)


# Under OpenBLAS's 10,000 elements, from which it splits a dot over its threads: next to
# dask's threads, or on a busy machine, a 16K-element dot then took 8 ms instead of 2 us
# (median, measured with other jobs running); 8K chunks ran 2.5x faster than 32K ones there.
NUMPY_CHUNK = 1 << 13


def _numpy_sums(
    x: np.ndarray, y: np.ndarray, rtol: float, atol: float, chunk: int = NUMPY_CHUNK, codes: str | None = None
) -> PairSums:
    """Fallback backend: numpy kernels on chunks small enough to stay in cache (raw codes
    decoded into the chunk buffers, a chunk at a time)."""
    m = x.shape[0]
    total = PairSums(n=m)
    # float64 chunk buffers, reused across chunks and calls (no page faults; a pass of 10^4
    # small pairs spent a third of this function allocating them)
    bufs = _scratch(min(chunk, max(m, 1 << 12)))
    decode = _numpy_decoder(codes)
    with np.errstate(all="ignore"):  # NaN/Inf reach the sums on purpose: the caller's signal
        for i in range(0, m, chunk):
            _chunk_sums(total, x[i : i + chunk], y[i : i + chunk], rtol, atol, decode, bufs)
    return total


def _numpy_decoder(codes: str | None):
    """``decode(chunk, out, bits)``: the float64 values of one chunk into ``out`` (never in
    place on the chunk: it may be a mapped file's memory); ``bits`` is a uint32 scratch."""
    if codes is None:
        return lambda v, out, bits: np.copyto(out, v)
    if codes == "bfloat16":

        def bfloat16(v, out, bits):
            np.copyto(bits, v)
            bits <<= 16
            np.copyto(out, bits.view(np.float32))

        return bfloat16
    if codes == "float16":  # numpy's own half-precision conversion (exact)
        return lambda v, out, bits: np.copyto(out, v.view(np.float16))
    lut = decode_table(codes)
    return lambda v, out, bits: np.take(lut, v, out=out)


def _chunk_sums(total: PairSums, x, y, rtol, atol, decode, bufs) -> None:
    """Add one cache-sized chunk's sums to ``total``."""
    k = x.shape[0]
    xc, yc, d, ay, r, gt, ones, bits = (b[:k] for b in bufs)
    decode(x, xc, bits)
    decode(y, yc, bits)
    total.sxx += float(np.dot(xc, xc))
    total.syy += float(np.dot(yc, yc))
    np.subtract(xc, yc, out=d)
    total.sdd += float(np.dot(d, d))
    np.abs(d, out=d)
    total.max_abs = max(total.max_abs, float(d.max()))
    total.sabs += float(np.dot(d, ones))
    np.abs(yc, out=ay)
    np.maximum(ay, EPS, out=ay)
    total.max_rel = max(total.max_rel, float(np.divide(d, ay, out=r).max()))
    np.abs(yc, out=ay)
    ay *= rtol
    ay += atol
    total.mismatch += int(np.count_nonzero(np.greater(d, ay, out=gt)))


_SCRATCH = threading.local()  # one set per thread: dask threads compare pairs at once


def _scratch(size: int) -> tuple[np.ndarray, ...]:
    """This thread's buffers (:func:`_fresh`), at least ``size`` long: kept between calls,
    never shared with another thread. Grown to a power of two, so that a pass's batches of
    varying sizes fault new pages in a few times, not at every batch."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None or bufs[0].shape[0] < size:
        bufs = _fresh(1 << max(size - 1, 1).bit_length())
        _SCRATCH.bufs = bufs
    return bufs


def _fresh(size: int) -> tuple[np.ndarray, ...]:
    """Five float64 buffers, one bool, ones (Σ|d| as a BLAS dot, several times faster than
    sum()) and a uint32 for decoding bits, ``size`` long."""
    return (
        *(np.empty(size) for _ in range(5)),
        np.empty(size, bool),
        np.ones(size),
        np.empty(size, np.uint32),
    )


_NUMBA_KERNELS: dict | None = None
_COMPILE_LOCK = threading.Lock()  # dask threads reach the first big pair together


def _numba_kernels() -> dict:
    """The fused loops by codec (:mod:`tdinspect.numerics.fused_loop`), made once per process (lazily:
    numba is slow to load); each compiles, or loads from numba's disk cache, on first use.
    Empty where numba fails to load (numpy's kernels serve; said once)."""
    global _NUMBA_KERNELS
    with _COMPILE_LOCK:
        if _NUMBA_KERNELS is None:
            _NUMBA_KERNELS = _define_numba_kernels()
    return _NUMBA_KERNELS


_ROW_KERNELS: dict | None = None


def _numba_row_kernels() -> dict:
    """:func:`tdinspect.numerics.fused_loop.compile_row_kernels`' loops, made once per process
    (as :func:`_numba_kernels`); empty where numba fails to load."""
    global _ROW_KERNELS
    with _COMPILE_LOCK:
        if _ROW_KERNELS is None:
            fused_loop = lazy_numba.load("fused_loop", "the metrics use numpy's kernels (slower)")
            if fused_loop is None:
                _ROW_KERNELS = {}
            else:
                try:
                    _ROW_KERNELS = fused_loop.compile_row_kernels(cache=True)
                except RuntimeError:  # no writable cache directory
                    _ROW_KERNELS = fused_loop.compile_row_kernels(cache=False)
    return _ROW_KERNELS


def row_sums(
    x: np.ndarray,
    y: np.ndarray,
    width: int,
    *,
    rtol: float,
    atol: float,
    min_numba: int = NUMBA_MIN_BYTES,
    codes: str | None = None,
) -> tuple[PairSums, tuple[float, ...]]:
    """The seven sums of ``x`` against ``y`` from those of its rows of ``width`` elements, and
    its worst row, in one read.

    ``x`` and ``y`` as :func:`pair_sums` takes them, their length a multiple of ``width``.
    Returns ``(sums, worst)``: the pair's :class:`PairSums` (its rows' added up: the same
    numbers as :func:`pair_sums` to the rounding of the sums) and the worst row's
    ``[rel_diff, mean_abs, cosine, sqnr_db, mismatch]``
    (:func:`tdinspect.numerics.slices.worst_slices`; NaN where no row settles one).

    The road is chosen by size as :func:`pair_sums` chooses it: under :func:`segment_limit`
    bytes :func:`segment_sums` (a segment a row), else the compiled loop row by row, each row
    judged as it is summed (:func:`tdinspect.numerics.fused_loop.compile_row_kernels`), or
    numpy's segments where numba is not there.

    Examples
    --------
    >>> x, y = np.array([1.0, 2.0, 3.0, 5.0]), np.array([1.0, 2.0, 3.0, 4.0])
    >>> sums, worst = row_sums(x, y, 2, rtol=0.0, atol=0.0)
    >>> sums.sdd, round(worst[0], 4)  # Σ(x - y)² of the pair, the worst row's rel_diff
    (1.0, 0.0169)
    """
    from tdinspect.numerics.slices import worst_slices

    global _BACKEND
    if width <= 0 or x.shape[0] % width or x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"row_sums needs two 1-D arrays of one length, a multiple of width={width}")
    rows = x.shape[0] // width
    codec = "value" if codes is None else codes if codes in _ARITHMETIC else "table"
    if _BACKEND is None:
        _BACKEND = default_backend()
    big = _BACKEND == "numba" and x.nbytes >= max(segment_limit(min_numba), min_numba)
    compiled = _numba_row_kernels() if big else {}
    if compiled:
        lut = decode_table(codes) if codec == "table" else None
        out = compiled[codec](
            np.ascontiguousarray(x), np.ascontiguousarray(y), width, float(rtol), float(atol), EPS, lut
        )
        sums = PairSums(x.shape[0], *(float(v) for v in out[:6]), int(out[6]))
        rel, mab, cos, sq, mms = (float(v) for v in out[7:])
        return sums, (rel if rel >= 0 else math.nan, mab, cos if cos <= 1 else math.nan, sq, mms)
    found = np.empty((rows, 7))
    step = max(1, SCRATCH_MAX // width)  # rows a call: the reused scratch buffers
    for r in range(0, rows, step):
        stop = min(rows, r + step)
        starts = np.arange(0, (stop - r) * width, width, dtype=np.intp)
        found[r:stop] = segment_sums(
            x[r * width : stop * width], y[r * width : stop * width], starts, rtol, atol, codes
        ).T
    sums = PairSums(
        x.shape[0],
        *(float(found[:, k].sum()) for k in range(4)),
        float(found[:, 4].max()),
        float(found[:, 5].max()),
        int(found[:, 6].sum()),
    )
    worst = worst_slices(found, np.full(rows, width))
    return sums, tuple(worst[f"slice_{m}"] for m in ("rel_diff", "mean_abs", "cosine", "sqnr_db", "mismatch"))


def _define_numba_kernels() -> dict:
    fused_loop = lazy_numba.load("fused_loop", "the metrics use numpy's kernels (slower)")
    if fused_loop is None:
        return {}
    try:
        return fused_loop.compile_kernels(cache=True)
    except RuntimeError:  # no writable cache directory (read-only install and home): compile each run
        return fused_loop.compile_kernels(cache=False)


def default_backend() -> str:
    """``"numba"`` when it imports (and ``TDINSPECT_KERNEL`` does not say ``numpy``)."""
    forced = os.environ.get("TDINSPECT_KERNEL", "").strip().lower()
    if forced and forced not in ("numba", "numpy"):
        raise ValueError(f"TDINSPECT_KERNEL={forced!r}: expected 'numba' or 'numpy'")
    if forced == "numpy":
        return "numpy"
    # not imported here: numba takes ~0.2 s to import, paid only when a pair is big enough
    # to use it (small dumps and the CLI on them never load it)
    if not lazy_numba.installed():
        if forced == "numba":
            raise ImportError("TDINSPECT_KERNEL=numba but numba is not installed")
        return "numpy"
    return "numba"


_BACKEND: str | None = None
# the unsigned integer that holds an item's raw bits, by item size (narrow floats' codes,
# bitwise comparisons)
UINT_OF = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# decoded by bit arithmetic in the compiled loop (the other narrow floats: by decode_table)
_ARITHMETIC = {"bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def decode_table(dtype) -> np.ndarray:
    """The float64 value of every bit pattern of a 1- or 2-byte torch float dtype (or its name).

    Indexed by the raw bits (as unsigned integers): ``decode_table(torch.bfloat16)[0x3F80]``
    is 1.0. Exact (every such value is a float64), built by torch's own conversion, so
    fp8 variants decode exactly as torch reads them.

    Examples
    --------
    >>> import torch
    >>> float(decode_table(torch.float8_e4m3fn)[0x38])
    1.0
    """
    return _table(str(dtype).removeprefix("torch."))


@functools.cache
def _table(name: str) -> np.ndarray:
    import torch  # only callers holding torch tensors ask for a table

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize > 2:
        raise ValueError(f"codes={name!r}: expected a 1- or 2-byte torch float dtype")
    codes = torch.from_numpy(np.arange(1 << (8 * dtype.itemsize), dtype=UINT_OF[dtype.itemsize]))
    table = np.empty(codes.shape[0], np.float64)
    # converted 8K codes at a time: under torch's grain (32K), so no OpenMP team is started
    # from a pool thread
    for i in range(0, codes.shape[0], 1 << 13):
        table[i : i + (1 << 13)] = codes[i : i + (1 << 13)].view(dtype).to(torch.float64).numpy()
    table.setflags(write=False)
    return table


def pair_sums(
    x: np.ndarray,
    y: np.ndarray,
    *,
    rtol: float,
    atol: float,
    backend: str | None = None,
    min_numba: int = NUMBA_MIN_BYTES,
    codes: str | None = None,
) -> PairSums:
    """The seven sums of ``x`` against the reference ``y``.

    Parameters
    ----------
    x, y : numpy.ndarray
        1-D, same length and dtype (float32 or float64), contiguous; or, with
        ``codes``, the raw bits of a narrow float (uint8 or uint16).
    rtol, atol : float
        The tolerances of the mismatch count.
    backend : {"numba", "numpy"}, optional
        Default: :func:`default_backend`, decided once per process.
    min_numba : int
        Pairs of fewer bytes a side use numpy whatever the backend (those under
        :func:`segment_limit` by :func:`segment_sums`, with one segment: the
        order of additions a batch of small pairs uses too).
    codes : str, optional
        The torch float dtype (its name: ``"bfloat16"``, ``"float16"``,
        ``"float8_e4m3fn"``...) whose bits ``x`` and ``y`` hold. They are decoded
        element by element inside the loop (bit arithmetic, or :func:`decode_table`
        for the rarer float8 formats), or a cache-sized chunk at a time by numpy;
        never converted as a whole. Exact either way.

    Examples
    --------
    >>> s = pair_sums(np.zeros(3, np.float32), np.ones(3, np.float32), rtol=0.0, atol=0.0)
    >>> s.sxx, s.syy, s.max_rel, s.mismatch
    (0.0, 3.0, 1.0, 3)
    >>> one, two = np.array([0x3F80], np.uint16), np.array([0x4000], np.uint16)  # bfloat16 bits
    >>> pair_sums(two, one, rtol=0.0, atol=0.0, codes="bfloat16").max_abs
    1.0
    """
    global _BACKEND
    if backend is None:
        if _BACKEND is None:
            _BACKEND = default_backend()
        backend = _BACKEND
    if x.shape != y.shape or x.dtype != y.dtype or x.ndim != 1:
        raise ValueError(
            f"pair_sums needs two 1-D arrays of one dtype, got {x.shape} {x.dtype} and {y.shape} {y.dtype}"
        )
    if backend not in ("numba", "numpy"):
        raise ValueError(f"backend={backend!r}: expected 'numba' or 'numpy'")
    lut = None
    if codes is not None:
        size = _ARITHMETIC.get(codes) or (decode_table(codes).shape[0] - 1).bit_length() // 8
        if x.dtype != UINT_OF[size]:
            raise ValueError(
                f"codes={codes!r} needs {np.dtype(UINT_OF[size])} arrays of its bits, got {x.dtype}"
            )
    # by size only, never by what this process loaded before: a pair's sums must not depend
    # on the process that compares it (dask workers, the CLI), nor on its company (Diff
    # batches a pass's small pairs through segment_sums)
    if x.nbytes < segment_limit(min_numba):
        return _one_segment(x, y, rtol, atol, codes)
    if backend == "numpy" or x.nbytes < min_numba:
        return _numpy_sums(x, y, rtol, atol, codes=codes)
    codec = "value" if codes is None else codes if codes in _ARITHMETIC else "table"
    if codec == "table":
        lut = decode_table(codes)
    # contiguous (a no-op for callers keeping the contract): bfloat16 is read a word at a time
    x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
    compiled = _numba_kernels()
    if not compiled:  # numba failed to load (warned once)
        return _numpy_sums(x, y, rtol, atol, codes=codes)
    out = compiled[codec](x, y, float(rtol), float(atol), EPS, lut)
    return PairSums(x.shape[0], *(float(v) for v in out[:6]), int(out[6]))
