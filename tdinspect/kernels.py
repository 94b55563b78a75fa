"""The per-pair sums behind the divergence metrics, in one read of both tensors.

Every tensor metric of :mod:`tdinspect.metrics` is a function of seven numbers
over the elements of ``x`` (compared) and ``y`` (reference):
``Σx²``, ``Σy²``, ``Σ(x-y)²``, ``Σ|x-y|``, ``max|x-y|``,
``max |x-y| / max(|y|, eps)`` and the count of ``|x-y| > atol + rtol·|y|``.
A NaN or Inf element makes ``Σx²`` or ``Σy²`` non-finite, which is how the
caller learns it must mask them (one read for the usual, finite, tensors).

All of it in float64, whatever the stored dtype (float32 arrays are widened
element by element). Two backends compute them:

``numba``
    One fused loop, compiled once per dtype (and cached on disk), vectorised
    over 16 lanes, run without the GIL so dask threads use every core.
    Measured 9.6 GB/s on one core of the development machine.
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
import importlib.util
import os
import threading
from dataclasses import dataclass

import numpy as np

EPS = 1e-12
LANES = 16  # lanes of accumulators; 4 and 8 did not vectorise here, 16 and 32 ran alike
# Below this many elements numpy's loop takes ~0.1 ms: not worth numba's one-time
# ~1.5 s (import, then the compiled kernel from its on-disk cache) in a small session.
NUMBA_MIN_ELEMENTS = 1 << 16


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
        return PairSums(self.n + other.n, self.sxx + other.sxx, self.syy + other.syy,
                        self.sdd + other.sdd, self.sabs + other.sabs,
                        max(self.max_abs, other.max_abs), max(self.max_rel, other.max_rel),
                        self.mismatch + other.mismatch)


def _numpy_sums(x: np.ndarray, y: np.ndarray, rtol: float, atol: float,
                chunk: int = 1 << 15, lut: np.ndarray | None = None) -> PairSums:
    """Fallback backend: numpy kernels on chunks small enough to stay in cache (raw codes
    decoded through ``lut`` into the chunk buffers)."""
    m = x.shape[0]
    total = PairSums(n=m)
    # float64 chunk buffers, reused across chunks and calls (no page faults; a pass of 10^4
    # small pairs spent a third of this function allocating them)
    bufs = _scratch(min(chunk, max(m, 1 << 12)))
    with np.errstate(all="ignore"):  # NaN/Inf reach the sums on purpose: the caller's signal
        for i in range(0, m, chunk):
            _chunk_sums(total, x[i:i + chunk], y[i:i + chunk], rtol, atol, lut, bufs)
    return total


def _chunk_sums(total: PairSums, x, y, rtol, atol, lut, bufs) -> None:
    """Add one cache-sized chunk's sums to ``total``."""
    k = x.shape[0]
    xc, yc, d, ay, r, gt, ones = (b[:k] for b in bufs)
    if lut is None:  # never in place on x, y: they may be a mapped file's memory
        np.copyto(xc, x)
        np.copyto(yc, y)
    else:
        np.take(lut, x, out=xc)
        np.take(lut, y, out=yc)
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
    """This thread's chunk buffers, at least ``size`` long (five float64, one bool, and ones:
    Σ|d| as a BLAS dot, several times faster than sum())."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None or bufs[0].shape[0] < size:
        bufs = (*(np.empty(size) for _ in range(5)), np.empty(size, bool), np.ones(size))
        _SCRATCH.bufs = bufs
    return bufs


_NUMBA_KERNEL = None
_COMPILE_LOCK = threading.Lock()  # dask threads reach the first big pair together


def _numba_kernel():
    """The fused loop, compiled once per process (lazily: numba is slow to load)."""
    global _NUMBA_KERNEL
    with _COMPILE_LOCK:
        if _NUMBA_KERNEL is None:
            _NUMBA_KERNEL = _define_numba_kernel()
    return _NUMBA_KERNEL


def _define_numba_kernel():
    import numba

    # error_model="numpy": no ZeroDivisionError check, which stops vectorisation.
    # Elements are taken to float64 in registers (as fast here as float32: the loop is
    # bound by memory). fastmath for reassociated sums (the lanes) only: without "arcp",
    # "afn" and "contract", max_abs, max_rel and the mismatch count round exactly as
    # the numpy backend's do, so the two agree bit for bit on them; without "nnan" and
    # "ninf", a NaN/Inf element still makes the sums non-finite (the caller's signal).
    # lut None: x, y hold the values; else they hold raw codes (bf16/fp16/fp8 bits as
    # unsigned ints) decoded by lut[code] in the loop, so no converted copy is made (numba
    # compiles each case separately and prunes the other branch).
    def fused(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled; covered via pair_sums
        n = x.shape[0]
        sxx, syy, sdd, sab = np.zeros(LANES), np.zeros(LANES), np.zeros(LANES), np.zeros(LANES)
        mxa, mxr, mis = np.zeros(LANES), np.zeros(LANES), np.zeros(LANES, np.int64)
        # The caller passes a multiple of LANES, but LLVM vectorises only when the
        # bound says so itself (8.9 vs 1.5 GB/s measured), as does the fixed inner trip.
        whole = n - n % LANES
        for start in range(0, whole, LANES):
            for j in range(LANES):
                if lut is None:
                    xi = np.float64(x[start + j])
                    yi = np.float64(y[start + j])
                else:
                    xi = lut[x[start + j]]
                    yi = lut[y[start + j]]
                d = xi - yi
                ad = abs(d)
                ay = abs(yi)
                sxx[j] += xi * xi
                syy[j] += yi * yi
                sdd[j] += d * d
                sab[j] += ad
                mxa[j] = max(mxa[j], ad)
                mxr[j] = max(mxr[j], ad / max(ay, eps))
                mis[j] += 1 if ad > atol + rtol * ay else 0
        for k in range(whole, n):  # the < 16-element tail (one call, no numpy tail)
            if lut is None:
                xi = np.float64(x[k])
                yi = np.float64(y[k])
            else:
                xi = lut[x[k]]
                yi = lut[y[k]]
            d = xi - yi
            ad = abs(d)
            ay = abs(yi)
            sxx[0] += xi * xi
            syy[0] += yi * yi
            sdd[0] += d * d
            sab[0] += ad
            mxa[0] = max(mxa[0], ad)
            mxr[0] = max(mxr[0], ad / max(ay, eps))
            mis[0] += 1 if ad > atol + rtol * ay else 0
        return sxx.sum(), syy.sum(), sdd.sum(), sab.sum(), mxa.max(), mxr.max(), mis.sum()

    options = dict(nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"})
    try:
        return numba.njit(cache=True, **options)(fused)
    except RuntimeError:  # no writable cache directory (read-only install and home): compile each run
        return numba.njit(**options)(fused)


def default_backend() -> str:
    """``"numba"`` when it imports (and ``TDINSPECT_KERNEL`` does not say ``numpy``)."""
    forced = os.environ.get("TDINSPECT_KERNEL", "").strip().lower()
    if forced and forced not in ("numba", "numpy"):
        raise ValueError(f"TDINSPECT_KERNEL={forced!r}: expected 'numba' or 'numpy'")
    if forced == "numpy":
        return "numpy"
    # find_spec, not import: numba takes ~0.2 s to import, paid only when a pair is big
    # enough to use it (small dumps and the CLI on them never load it)
    if importlib.util.find_spec("numba") is None:
        if forced == "numba":
            raise ImportError("TDINSPECT_KERNEL=numba but numba is not installed")
        return "numpy"
    return "numba"


_BACKEND: str | None = None
_CODE_DTYPES = {1: np.uint8, 2: np.uint16}


@functools.lru_cache(maxsize=None)
def decode_table(dtype) -> np.ndarray:
    """The float64 value of every bit pattern of a 1- or 2-byte torch float dtype.

    Indexed by the raw bits (as unsigned integers): ``decode_table(torch.bfloat16)[0x3F80]``
    is 1.0. Exact (every such value is a float64), built by torch's own conversion, so
    fp8 variants decode exactly as torch reads them.

    Examples
    --------
    >>> import torch
    >>> float(decode_table(torch.float8_e4m3fn)[0x38])
    1.0
    """
    import torch  # only callers holding torch tensors ask for a table

    size = torch.empty((), dtype=dtype).element_size()
    codes = torch.from_numpy(np.arange(1 << (8 * size), dtype=_CODE_DTYPES[size]))
    table = codes.view(dtype).to(torch.float64).numpy()
    table.setflags(write=False)
    return table


def pair_sums(x: np.ndarray, y: np.ndarray, *, rtol: float, atol: float,
              backend: str | None = None, min_numba: int = NUMBA_MIN_ELEMENTS,
              lut: np.ndarray | None = None) -> PairSums:
    """The seven sums of ``x`` against the reference ``y``.

    Parameters
    ----------
    x, y : numpy.ndarray
        1-D, same length and dtype (float32 or float64), contiguous; or, with
        ``lut``, the raw bits of a narrow float (uint8 or uint16).
    rtol, atol : float
        The tolerances of the mismatch count.
    backend : {"numba", "numpy"}, optional
        Default: :func:`default_backend`, decided once per process.
    min_numba : int
        Pairs shorter than this use numpy whatever the backend.
    lut : numpy.ndarray, optional
        float64 value of each code (:func:`decode_table`): bfloat16, float16 and
        float8 are decoded element by element inside the loop, never converted
        as a whole.

    Examples
    --------
    >>> s = pair_sums(np.zeros(3, np.float32), np.ones(3, np.float32), rtol=0.0, atol=0.0)
    >>> s.sxx, s.syy, s.max_rel, s.mismatch
    (0.0, 3.0, 1.0, 3)
    """
    global _BACKEND
    if backend is None:
        if _BACKEND is None:
            _BACKEND = default_backend()
        backend = _BACKEND
    if x.shape != y.shape or x.dtype != y.dtype or x.ndim != 1:
        raise ValueError(f"pair_sums needs two 1-D arrays of one dtype, got {x.shape} {x.dtype} "
                         f"and {y.shape} {y.dtype}")
    if backend not in ("numba", "numpy"):
        raise ValueError(f"backend={backend!r}: expected 'numba' or 'numpy'")
    if lut is not None and (x.dtype.kind != "u" or lut.shape[0] != 1 << (8 * x.dtype.itemsize)):
        raise ValueError(f"a decode table of {lut.shape[0]} values cannot decode {x.dtype} codes")
    # by size only, never by what this process loaded before: a pair's sums must not depend
    # on the process that compares it (dask workers, the CLI)
    if backend == "numpy" or x.shape[0] < min_numba:
        return _numpy_sums(x, y, rtol, atol, lut=lut)
    out = _numba_kernel()(x, y, float(rtol), float(atol), EPS, lut)
    return PairSums(x.shape[0], *(float(v) for v in out[:6]), int(out[6]))
