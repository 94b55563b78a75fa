"""The compiled loops behind :mod:`tdinspect.numerics.onepass` (imports numba: load lazily).

Module-level functions, so numba's on-disk cache finds them again in the next
process (about 4 s to compile, well under a second to load).
"""

from __future__ import annotations

import numba
import numpy as np

from tdinspect.numerics.fingerprint import BLOCK, CHUNK

# "reassoc": LLVM may split a chunk's sum over vector lanes (what makes the loops fast);
# error_model="numpy": no ZeroDivisionError checks, which stop vectorisation.
LANES_OPS = dict(nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"})
# fastmath=False said explicitly: numba's callees otherwise inherit the caller's flags
EXACT_OPS = dict(nogil=True, error_model="numpy", fastmath=False)
TOP = np.int32(0x7FFFFFFF)
EXPONENT = np.int32(0x7F800000)


def jit(**options):
    """``numba.njit`` with the on-disk cache where a cache directory is writable."""

    def wrap(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # no writable cache directory: compile in each process
            return numba.njit(**options)(fn)

    return wrap


@jit(**EXACT_OPS)
def add_up(parts, m, s, c):
    """``s + Σ parts[:m]``, compensated (Knuth's TwoSum: each addition's rounding
    error is carried in ``c``). Its own function, not reassociated: the callers'
    flags would fold the compensation away."""
    for i in range(m):
        x = parts[i]
        t = s + x
        z = t - s
        c += (s - (t - z)) + (x - z)
        s = t
    return s, c


@jit(**LANES_OPS)
def sweep(v, w):
    """One read of the float32 values v (w: the same memory as int32 words): min/max
    keys, non-finite count, float64 sums of the values and of their squares."""
    n = w.shape[0]
    lo = TOP
    hi = np.int32(-2147483648)
    bad = np.int64(0)
    s = c = q = qc = 0.0
    sums = np.empty(BLOCK // CHUNK + 1)
    squares = np.empty(BLOCK // CHUNK + 1)
    for b0 in range(0, n, BLOCK):  # a block stays in L2 between the loops
        wb = w[b0 : min(n, b0 + BLOCK)]
        for i in range(wb.shape[0]):
            word = wb[i]
            key = word ^ ((word >> 31) & TOP)
            lo = min(lo, key)
            hi = max(hi, key)
            bad += (word & EXPONENT) == EXPONENT
        vb = v[b0 : min(n, b0 + BLOCK)]
        m = 0
        for a in range(0, vb.shape[0], CHUNK):
            vc = vb[a : min(vb.shape[0], a + CHUNK)]
            x = xx = 0.0
            for i in range(vc.shape[0]):
                f = np.float64(vc[i])
                x += f
                xx += f * f  # exact: a float32's square fits a float64
            sums[m] = x
            squares[m] = xx
            m += 1
        s, c = add_up(sums, m, s, c)
        q, qc = add_up(squares, m, q, qc)
    return lo, hi, bad, s + c, q + qc


@jit(**LANES_OPS)
def centred(v, mean):
    """Σ(v - mean)² in float64, summed as sweep's sums."""
    n = v.shape[0]
    s = c = 0.0
    sums = np.empty(BLOCK // CHUNK + 1)
    for b0 in range(0, n, BLOCK):
        vb = v[b0 : min(n, b0 + BLOCK)]
        m = 0
        for a in range(0, vb.shape[0], CHUNK):
            vc = vb[a : min(vb.shape[0], a + CHUNK)]
            x = 0.0
            for i in range(vc.shape[0]):
                d = np.float64(vc[i]) - mean
                x += d * d
            sums[m] = x
            m += 1
        s, c = add_up(sums, m, s, c)
    return s + c
