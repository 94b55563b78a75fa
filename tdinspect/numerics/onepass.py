"""Statistics of a big float32 CPU tensor in one read of its memory (compiled loops).

With torch alone, the statistics of a float32 tensor take several passes over
it (min/max, a float64 copy, sums): 0.7 ms for 4 MB on one core of the
development machine. Here one loop over each block of 2^16 words
(:data:`~tdinspect.numerics.fingerprint.BLOCK`, which stays in the L2 cache) computes

* min and max, on order-preserving integer keys of the float32 bits,
* the count of non-finite elements (exponent bits all ones),
* the float64 sums of the elements and of their squares (a float32's square is
  exact in float64);

0.4 ms for the same 4 MB (:func:`float32_sums`). :mod:`tdinspect.numerics.stats` takes
``M2 = Σx² - n·mean²`` from it when ``mean² <= std²/7`` (no cancellation), else
reads once more for the centred sum ``Σ(x - mean)²`` (:func:`centred_squares`,
the two-pass method). Checksums are not computed here: capture computes them,
with torch's reductions (:mod:`tdinspect.numerics.checksum`).

Rounding: each chunk of :data:`~tdinspect.numerics.fingerprint.CHUNK` = 64 elements is summed in whatever order
the compiler vectorises it into (at most 63 roundings deep: error at most
``31.5·eps·Σ|x|`` over the chunk, ``eps`` = 2⁻⁵²), and the chunk sums are added
with Knuth's TwoSum compensation (error about ``eps/2`` of the total), whatever
the tensor's length. Hence, first order: ``mean`` within ``32.5·eps·mean(|x|)``;
``l2`` within ``16.5·eps·l2``; ``std`` within ``19·eps·(std + mean(|x|))`` by
``Σx² - n·mean²`` under its condition (``Σx² <= 8/7·M2``), and within
``17·eps·std`` plus the second-order effect of the mean's error by the centred
sum: inside the bounds of docs/reliability.md, "Numbers" (tested against exact
references on both ways).

Used for contiguous CPU tensors of at least :data:`MIN_ELEMENTS` elements when
numba is installed: the first use in a process imports numba and loads the
compiled loops from numba's on-disk cache (about 0.8 s; 4 s the very first time,
to compile), not worth it for small tensors, which keep torch's reductions.
``TDINSPECT_ONEPASS=0`` turns the loops off. Capture never uses them (it passes
``compiled=False``: torch and the standard library only); the loader does, for dumps
written without statistics.

Examples
--------
>>> import torch
>>> x = torch.randn(1 << 17)
>>> s = float32_sums(x)
>>> s.numel, s.nonfinite, s.minimum == float(x.min()), s.maximum == float(x.max())
(131072, 0, True, True)
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import torch

from tdinspect.numerics import lazy_numba

MIN_ELEMENTS = 1 << 16


@dataclass
class Float32Sums:
    """What one read of a float32 tensor gives."""

    numel: int
    nonfinite: int
    minimum: float
    maximum: float
    total: float  # float64 sums of the elements and of their squares (meaningless when
    squares: float  # nonfinite > 0)


def enabled(t: torch.Tensor) -> bool:
    """Whether ``t`` goes through the compiled loops (CPU, contiguous, big, numba loads)."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and t.numel() >= max(MIN_ELEMENTS, 1)
        and t.is_contiguous()
        and os.environ.get("TDINSPECT_ONEPASS", "1") != "0"
        and _kernels() is not None
    )


def _kernels():
    """The compiled loops (sweep, centred), or ``None`` where numba is missing or fails to
    load (then torch's reductions serve; a numba that fails says so once,
    :func:`tdinspect.numerics.lazy_numba.load`). Loaded on first use."""
    loops = lazy_numba.load("onepass_loops", "statistics use torch's reductions (slower)")
    return None if loops is None else (loops.sweep, loops.centred)


def _float_of_key(key: int) -> float:
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)  # the key map is its own inverse
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def float32_sums(t: torch.Tensor) -> Float32Sums:
    """Min, max, non-finite count, float64 sums of the elements and of their squares of a
    float32 tensor for which :func:`enabled` holds, in one read."""
    v = t.detach().reshape(-1).numpy()
    lo, hi, bad, total, squares = _kernels()[0](v, v.view("int32"))
    return Float32Sums(
        int(v.shape[0]),
        int(bad),
        _float_of_key(int(lo)),
        _float_of_key(int(hi)),
        float(total),
        float(squares),
    )


def centred_squares(t: torch.Tensor, mean: float) -> float:
    """``Σ(x - mean)²`` in float64 over a float32 tensor for which :func:`enabled` holds."""
    return float(_kernels()[1](t.detach().reshape(-1).numpy(), mean))
