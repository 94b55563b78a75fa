"""Right numbers at every magnitude: statistics and metrics against independent exact references.

The references here use Python's exact rationals (``fractions.Fraction``) and ``math.fsum``,
never torch reductions; the bounds are those stated in docs/reliability.md, "Numbers".
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tdinspect.stats import STAT_NAMES, stats_to_dict, tensor_stats

EPS = 2.0 ** -52
BOUND = 64 * EPS  # statistics: see reference_stats


def _values(t: torch.Tensor) -> list:
    """The exact values a statistic describes (complex: magnitudes, via math.hypot)."""
    flat = t.detach().reshape(-1)
    if t.is_complex():
        return [math.hypot(float(z.real), float(z.imag)) for z in flat.tolist()]
    if t.dtype == torch.bool or not t.is_floating_point():
        return [int(v) for v in flat.tolist()]
    return [float(v) for v in flat.double().tolist()]


def reference_stats(t: torch.Tensor) -> dict[str, float]:
    """Statistics computed exactly (rationals), then rounded once."""
    values = _values(t)
    finite = [v for v in values if not isinstance(v, float) or math.isfinite(v)]
    out = {"numel": float(len(values)), "nan": float(sum(1 for v in values if v != v)),
           "inf": float(sum(1 for v in values if isinstance(v, float) and math.isinf(v)))}
    if not finite:
        return {**out, **{k: math.nan for k in ("min", "max", "mean", "std", "absmax", "l2")}}
    exact = [Fraction(v) for v in finite]
    n = len(exact)
    mean = sum(exact) / n
    var = sum((v - mean) ** 2 for v in exact) / n
    sq = sum(v * v for v in exact)
    return {**out, "min": float(min(exact)), "max": float(max(exact)), "mean": _float(mean),
            "std": _sqrt(var), "absmax": float(max(abs(v) for v in exact)), "l2": _sqrt(sq),
            "mean_abs": _float(sum(abs(v) for v in exact) / n),
            "rounded": t.is_complex()}  # magnitudes: hypot is within an ulp, not exact


def _float(q: Fraction) -> float:
    try:
        return float(q)
    except OverflowError:
        return math.copysign(math.inf, q)


def _sqrt(q: Fraction) -> float:
    """sqrt of a non-negative rational, correctly scaled even beyond float range."""
    if q == 0:
        return 0.0
    shift = (q.numerator.bit_length() - q.denominator.bit_length()) // 2 * 2
    scaled = q / Fraction(2) ** shift if shift >= 0 else q * Fraction(2) ** -shift
    try:
        return math.ldexp(math.sqrt(float(scaled)), shift // 2)
    except OverflowError:
        return math.inf


def assert_stats_close(got: dict, ref: dict, what=""):
    """Counts, min, max, absmax exact (complex: within 2 ulps); mean within BOUND·mean(|x|); std within
    BOUND·(std + mean(|x|)); l2 within BOUND·l2."""
    for k in ("numel", "nan", "inf"):
        assert got[k] == ref[k], (what, k, got[k], ref[k])
    if math.isnan(ref["mean"]):
        assert all(math.isnan(got[k]) for k in ("min", "max", "mean", "std", "absmax", "l2")), what
        return
    for k in ("min", "max", "absmax"):
        ulps = 2 * EPS * abs(ref[k]) if ref.get("rounded") else 0.0
        assert abs(got[k] - ref[k]) <= ulps, (what, k, got[k], ref[k])
    scale = ref["mean_abs"]
    assert abs(got["mean"] - ref["mean"]) <= BOUND * scale, (what, "mean", got["mean"], ref["mean"])
    assert abs(got["std"] - ref["std"]) <= BOUND * (ref["std"] + scale), (what, "std", got, ref)
    if math.isinf(ref["l2"]):
        assert got["l2"] == math.inf, what
    else:
        assert abs(got["l2"] - ref["l2"]) <= BOUND * ref["l2"], (what, "l2", got["l2"], ref["l2"])


def both_paths(t):
    """The CPU path and the sync-free (accelerator) path, as dicts."""
    return [stats_to_dict(tensor_stats(t, sync_free=s)) for s in (False, True)]


# -- statistics -------------------------------------------------------------------------------

def test_large_float32_tensor_with_large_mean_and_tiny_std():
    """Issue 13: 1e7 float32 elements, mean 1e4, std 1e-3 gave std 738.5 (true 0.00104)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(10_000_000, generator=gen, dtype=torch.float64) * 1e-3 + 1e4).float()
    a = x.double().numpy()
    mean = math.fsum(a) / a.size
    std = math.sqrt(math.fsum(np.square(a - mean)) / a.size)
    l2 = math.sqrt(math.fsum(np.square(a)))
    for got in both_paths(x):
        assert got["mean"] == pytest.approx(mean, rel=1e-15, abs=0)
        assert got["std"] == pytest.approx(std, rel=1e-13, abs=0)
        assert got["l2"] == pytest.approx(l2, rel=1e-14, abs=0)


@pytest.mark.parametrize("values, dtype", [
    ([3.0e38, 3.1e38, -2.0e38, 3.3e38], torch.float32),      # squares overflow float32
    ([1e300, 1.5e300, -1e-300, 1.7e308], torch.float64),      # squares overflow float64
    ([1e-300, 1.5e-300, -1e-310, 4e-320], torch.float64),     # squares underflow float64
    ([2 ** 62, 2 ** 62 + 1, -(2 ** 62), 5], torch.int64),
    ([65504.0, -65504.0, 6e-8, 1.0], torch.float16),
    ([3e38, 1e-38, -3e38], torch.bfloat16),
])
def test_extreme_magnitudes(values, dtype):
    t = torch.tensor(values, dtype=dtype)
    for got in both_paths(t):
        assert_stats_close(got, reference_stats(t), (values, dtype))


def test_complex_statistics_are_of_magnitudes_in_float64():
    t = torch.tensor([3e38 + 3e38j, 1 - 1j, 0j], dtype=torch.complex64)
    for got in both_paths(t):
        assert_stats_close(got, reference_stats(t))


def test_strided_and_multi_chunk_tensors(monkeypatch):
    from tdinspect import stats

    monkeypatch.setattr(stats, "CHUNK", 7)  # many pieces, rows split, every path of _pieces
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, 4, generator=gen) * 1e3 + 1e6
    for t in (base, base.transpose(0, 2), base[:, 1:, ::2], base.permute(1, 2, 0)[2:]):
        got = stats_to_dict(tensor_stats(t, sync_free=False))
        assert_stats_close(got, reference_stats(t), t.shape)


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.uint8, torch.bool, torch.complex64, torch.complex128]


@st.composite
def tensors(draw, allow_nonfinite=True):
    """Random shapes, dtypes and magnitudes (float64 near 1e±300, int64 near 2**62)."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
    n = math.prod(shape)
    seed = draw(st.integers(0, 2 ** 31))
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        centre = draw(st.sampled_from([0, info.max // 2, info.max, info.min]))
        spread = draw(st.sampled_from([1, 100, 2 ** 20]))
        lo, hi = max(info.min, centre - spread), min(info.max, centre + spread)
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)
    real = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
    exp_range = 300 if real == torch.float64 else 30
    scale = 10.0 ** draw(st.integers(-exp_range, exp_range))
    offset = draw(st.sampled_from([0.0, 1.0, 1e4, -1e6])) * scale
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale + offset
    if dtype.is_complex:
        y = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
        return torch.complex(x, y).to(dtype)
    info = torch.finfo(dtype)
    x = x.clamp(-info.max, info.max).to(dtype)
    if allow_nonfinite and n and draw(st.booleans()):
        flat = x.reshape(-1)
        flat[draw(st.integers(0, n - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return x


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=tensors())
def test_statistics_property_against_exact_reference(t):
    ref = reference_stats(t)
    for got in both_paths(t):
        assert_stats_close(got, ref, (t.dtype, list(t.shape)))
    assert list(stats_to_dict(tensor_stats(t))) == list(STAT_NAMES)
