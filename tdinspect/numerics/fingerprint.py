"""The constants of the tensor fingerprint (:mod:`tdinspect.numerics.checksum`) and of the
one-read statistics loops (:mod:`tdinspect.numerics.onepass`): the bottom of ``numerics``,
torch only.

The fingerprint is ``h = Σ_c R_c · Σ_k w_{cL+k} · K_k (mod 2^64)`` over a tensor's 32-bit
words, ``L`` = :data:`BLOCK`; ``K_k`` and ``R_c`` are :func:`multipliers` of
:data:`SEED_K` and :data:`SEED_R` (splitmix64, made odd). The one-read loops take their
block size (:data:`BLOCK`, which stays in the L2 cache) and :data:`CHUNK` from here.

Examples
--------
>>> multipliers(SEED_K, 2, torch.device("cpu")).tolist()[0] % 2
1
"""

from __future__ import annotations

import threading

import torch

BLOCK = 1 << 16  # words per block: the per-position multipliers are 512 KB on each device
SEED_K = 0x7464696E73706563  # "tdinspec"
SEED_R = 0x636865636B73756D  # "checksum"
MASK = (1 << 64) - 1
# elements per partial float64 sum of the one-read loops (onepass): bounds their rounding
# (see onepass's docstring); each costs a reduction
CHUNK = 64
_cache: dict[tuple[str, int], torch.Tensor] = {}
_lock = threading.Lock()


def signed(v: int) -> int:
    """``v`` modulo 2^64 as a signed 64-bit integer."""
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(index: torch.Tensor, seed: int) -> torch.Tensor:
    """splitmix64 of ``seed + index * golden`` for an int64 tensor of indices (wrapping)."""
    z = index * signed(0x9E3779B97F4A7C15) + signed(seed)
    z = (z ^ _shr(z, 30)) * signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * signed(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def multipliers(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` odd multipliers of ``seed`` on ``device`` (made on the CPU, cached)."""
    key = (str(device), seed)
    with _lock:
        have = _cache.get(key)
        if have is None or have.numel() < n:
            size = max(n, BLOCK, 2 * (have.numel() if have is not None else 0))
            have = (splitmix64(torch.arange(size, dtype=torch.int64), seed) | 1).to(device)
            _cache[key] = have
    return have[:n]
