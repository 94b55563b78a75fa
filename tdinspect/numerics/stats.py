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

Accuracy: every sum is accumulated in float64 (narrow floats and integers are
widened a chunk at a time, never as a whole copy), the variance is the
stable combination of per-chunk centred sums (Chan, Golub and LeVeque), and
float64 tensors whose magnitudes would overflow or underflow when squared
are scaled by a power of two first (exact). ``mean``, ``std`` and ``l2`` are
right to a few float64 ulps of ``mean(|x|)``, ``std`` and ``l2`` for any
finite input of any size (docs/reliability.md, "Numbers", states the bound
the property test checks); ``min``, ``max`` and ``absmax`` are exact.

Capture takes a cheaper contract (:func:`capture_stats`): a CPU float tensor of up to 32
bits is summed in float32 by torch's cascade summation (:func:`_row_float32_cpu`), ``mean``,
``std`` and ``l2`` right to 1e-6 relative, the rest exact, in half the time.

A big contiguous float32 CPU tensor is read once by a compiled loop instead
(:mod:`tdinspect.numerics.onepass`: chunked float64 sums added with compensation, within
the same bounds), unless the caller says ``compiled=False``: capture does
(:func:`capture_stats`, :func:`stats_and_checksum`), so that it never loads numba (torch
and the standard library only, on an engine's hot path); the loader keeps the compiled loop.

Examples
--------
>>> import torch
>>> from tdinspect.numerics.stats import tensor_stats, stats_to_dict
>>> stats_to_dict(tensor_stats(torch.tensor([1.0, -3.0, float("nan")])))["absmax"]
3.0
"""

from __future__ import annotations

import math
import threading

import torch

from tdinspect.numerics import onepass
from tdinspect.numerics.checksum import tensor_checksum
from tdinspect.numerics.shapes import broadcast_dims, first_slice

STAT_NAMES: tuple[str, ...] = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "numel")

_NAN_ROW = [math.nan] * 6
# Elements widened to float64 at a time on CPU: large enough that the per-op cost of
# torch's parallel regions stays small (smaller chunks ran 2-10x slower on 2 busy
# cores, measured), small enough to bound memory (8 MB a capturing thread).
CHUNK = 1 << 20
# Squares of values within [2**-400, 2**400] neither overflow nor lose bits in float64
# (even summed over 2**200 elements); only float64 tensors can lie outside.
_SAFE_EXP = 400
_local = threading.local()


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """A real tensor with the values the statistics describe (no copy for real dtypes).

    Complex tensors give their magnitudes (in float64, so nothing is lost to rounding),
    bool their 0/1 bytes, float8 formats float32 (exact).
    """
    if t.is_complex():
        return t.to(torch.complex128).abs()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_floating_point() and t.element_size() == 1:  # float8: few kernels (exact in float32)
        return t.to(torch.float32)
    if t.dtype in _FEW_KERNELS:  # uint16/32/64 have no min, max or abs on CPU
        return t.to(_FEW_KERNELS[t.dtype])
    return t


# unsigned integers wider than a byte, and the dtype their statistics are computed in
# (int64 holds uint16/uint32 exactly; uint64 beyond 2^53 rounds, as any float64 statistic)
_FEW_KERNELS = {
    d: torch.int64 if d != torch.uint64 else torch.float64
    for d in (getattr(torch, n, None) for n in ("uint16", "uint32", "uint64"))
    if d is not None
}


def _unexpand(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Undo broadcasting: the stored elements and how many times each appears."""
    dims = broadcast_dims(t)
    return first_slice(t, dims), math.prod(t.shape[d] for d in dims)


def power_of_two_scale(absmax: float) -> float:
    """An exact power of two that brings ``absmax`` near 1 when squaring it in float64
    would overflow or lose bits; 1.0 otherwise."""
    if absmax == 0 or not math.isfinite(absmax):
        return 1.0
    exponent = math.frexp(absmax)[1]
    # clamped: a subnormal absmax (float64's 1e-310, exponent -1029) asked for 2^1029, an OverflowError
    return math.ldexp(1.0, max(min(-exponent, 1023), -1022)) if abs(exponent) > _SAFE_EXP else 1.0


def _pieces(v: torch.Tensor, limit: int):
    """Sub-tensors of ``v`` of at most ``limit`` elements (whole rows where possible),
    covering it once, without copying a strided view."""
    if v.is_contiguous():
        flat = v.view(-1)
        for i in range(0, flat.numel(), limit):
            yield flat[i : i + limit]
        return
    per_row = math.prod(v.shape[1:])
    if per_row <= limit:
        step = max(1, limit // max(per_row, 1))
        for i in range(0, v.shape[0], step):
            yield v[i : i + step]
    else:
        for i in range(v.shape[0]):
            yield from _pieces(v[i], limit)


def _buffer(k: int) -> torch.Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < k:
        buf = _local.buf = torch.empty(max(k, min(CHUNK, 1 << 16)), dtype=torch.float64)
    return buf[:k]


def _load(piece: torch.Tensor, scale: float) -> torch.Tensor:
    """``piece·scale`` widened into this thread's float64 buffer (flat)."""
    b = _buffer(piece.numel())
    b.view(piece.shape).copy_(piece)
    if scale != 1.0:
        b.mul_(scale)
    return b


def _moments(v: torch.Tensor, scale: float) -> tuple[float, float, float]:
    """``(mean, M2, Σx²)`` of ``v·scale`` in float64, by the two-pass method.

    Pass one: the mean ``m`` (pairwise float64 sums). Pass two: ``M2 = Σ(x - m)²``
    and ``Σx² = M2 + n·m²``: centred, so nothing cancels whatever ``mean / std``.
    The correction term ``Σ(x - m)`` is left out: it is ``n`` times the mean's own
    rounding error, which changes ``M2`` by a relative ``(δm)²/var`` and ``Σx²`` by
    ``2·δm/m`` (a few ulps), at the price of a pass. A tensor of one chunk (the
    usual case) is widened once and used by both passes.
    """
    n = v.numel()
    pieces = list(_pieces(v, CHUNK))
    if len(pieces) == 1:
        b = _load(pieces[0], scale)
        mean = float(b.sum()) / n
        loaded = [b]
    else:
        mean = math.fsum(float(_load(piece, scale).sum()) for piece in pieces) / n
        loaded = (_load(piece, scale) for piece in pieces)
    m2 = math.fsum(float(b.sub_(mean).square_().sum()) for b in loaded)
    return mean, m2, m2 + n * mean * mean


def _finite_row_cpu(v: torch.Tensor, n: int) -> list[float] | None:
    """The statistics row in plain floats when ``v`` is all finite, else ``None``."""
    lo, hi = (float(x) for x in torch.aminmax(v))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    absmax = max(abs(lo), abs(hi))
    scale = power_of_two_scale(absmax)
    mean, m2, sq = _moments(v, scale)
    return [
        lo,
        hi,
        mean / scale,
        math.sqrt(m2 / n) / scale,
        absmax,
        math.sqrt(sq) / scale,
        0.0,
        0.0,
        float(n),
    ]


def _row_sync_free(v: torch.Tensor, n: int) -> torch.Tensor:
    """The statistics row without a host round trip (masked float64 reductions, two passes)."""
    f64 = torch.float64
    if not v.is_floating_point():
        v = v.to(f64)
    finite = torch.isfinite(v)
    n_finite = finite.sum()
    n_nan = torch.isnan(v).sum()
    n_inf = (n - n_finite - n_nan).double()
    inf = torch.tensor(math.inf, dtype=v.dtype, device=v.device)
    lo = torch.where(finite, v, inf).min().double()
    hi = torch.where(finite, v, -inf).max().double()
    if v.dtype == f64:  # only float64 squares can overflow or underflow: scaled first
        absmax = torch.maximum(lo.abs(), hi.abs())
        # an exact power of two near 1/absmax (frexp) when squares would overflow or underflow
        exponent = torch.frexp(
            torch.where(
                torch.isfinite(absmax) & (absmax > 0), absmax, torch.ones((), dtype=f64, device=v.device)
            )
        )[1]
        exponent = torch.where(exponent.abs() > _SAFE_EXP, exponent, torch.zeros_like(exponent))
        scale = torch.ldexp(torch.ones((), dtype=f64, device=v.device), -exponent)
    else:
        scale = 1.0
    zero = torch.zeros((), dtype=f64, device=v.device)
    x = torch.where(finite, v.to(f64) * scale, zero)
    cnt = n_finite.double()
    mean = x.sum() / cnt  # the two-pass method, as _moments
    m2 = torch.where(finite, x - mean, zero).square().sum()
    std = (m2 / cnt).sqrt() / scale
    l2 = (m2 + cnt * mean * mean).sqrt() / scale
    mean = mean / scale
    empty = n_finite == 0
    nan = torch.tensor(math.nan, dtype=f64, device=v.device)
    lo, hi, mean, std, l2 = (torch.where(empty, nan, x) for x in (lo, hi, mean, std, l2))
    return _stacked_row(lo, hi, mean, std, l2, n_nan.double(), n_inf, n)


def _stacked_row(lo, hi, mean, std, l2, n_nan, n_inf, n: int) -> torch.Tensor:
    """The statistics row of 0-d float64 tensors on the values' device, ordered like
    :data:`STAT_NAMES` (absmax from min and max, numel ``n``): no host round trip."""
    size = torch.full((), float(n), dtype=torch.float64, device=lo.device)
    return torch.stack([lo, hi, mean, std, torch.maximum(lo.abs(), hi.abs()), l2, n_nan, n_inf, size])


def tensor_stats(
    t: torch.Tensor, *, sync_free: bool | None = None, compiled: bool = True, exact: bool = True
) -> torch.Tensor:
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
        fast path (chunked float64 sums when everything is finite) is cheaper.
    compiled : bool
        Let a big contiguous float32 CPU tensor go through the compiled one-read loop
        (:mod:`tdinspect.numerics.onepass`, numba) where it loads. ``False``: torch's
        reductions only, never numba (capture: torch and the standard library only); the
        same values to float rounding.
    exact : bool
        ``True``: float64 accumulation, every statistic to a few float64 ulps (the readers).
        ``False`` (capture, :func:`capture_stats`): a CPU float tensor of up to 32 bits is
        summed in float32 by torch's cascade summation (:func:`_row_float32_cpu`), right to
        about ``1e-6`` relative, with the counts, min and max exact.

    Examples
    --------
    >>> tensor_stats(torch.ones(4))[:3].tolist()
    [1.0, 1.0, 1.0]
    """
    t = t.detach()
    n = t.numel()
    if n == 0:
        return torch.tensor(_NAN_ROW + [0.0, 0.0, 0.0], dtype=torch.float64, device=t.device)
    t, copies = _unexpand(t)
    if copies > 1:  # every stored element appears `copies` times: same min/max/mean/std
        row = tensor_stats(t, sync_free=sync_free, compiled=compiled, exact=exact)
        return row * torch.tensor(
            [1, 1, 1, 1, 1, math.sqrt(copies), copies, copies, copies], dtype=torch.float64, device=row.device
        )
    v = _as_real(t)  # full reductions need no reshape (which would copy a strided view)
    if sync_free is None:
        sync_free = v.device.type != "cpu"
    if sync_free:
        return _row_sync_free(v, n)
    if not v.is_floating_point():  # integers are finite
        return torch.tensor(_finite_row_cpu(v, n), dtype=torch.float64)
    if not exact and v.element_size() <= 4:
        row = _row_float32_cpu(v, n)
        if row is not None:
            return torch.tensor(row, dtype=torch.float64)
    if compiled and v.dtype == torch.float32 and onepass.enabled(v):
        return _float32_row(v, onepass.float32_sums(v))
    fast = _finite_row_cpu(v, n)
    if fast is not None:
        return torch.tensor(fast, dtype=torch.float64)
    return _masked_row_cpu(v, n)


def graph_stats(t: torch.Tensor) -> torch.Tensor:
    """:func:`tensor_stats` as torch operations that ``torch.compile`` traces, branch-free
    on the values, so inductor fuses the reductions with the kernel that produces ``t``
    (capture inside a compiled graph hands the record op this row instead of the tensor).

    On an accelerator, where reductions are bound by memory, not arithmetic: the
    definitions of :func:`tensor_stats` in one read (the counts, min, max and float64
    shifted sums of ``_row_one_pass``; float64 tensors, whose squares may need scaling,
    take two passes). Equal to :func:`capture_stats` within float reassociation.

    On the CPU, where they are bound by arithmetic (the masked float64 loop cost about
    1 ns an element, as much as a small model's matmuls): a float32 tensor takes five
    float32 reductions (min, max, the sum, then the sums about its mean, inductor's
    cascade summation: relative error about ``1e-7·log n``), a narrower float the same in
    float64, and both assume the values finite. A
    tensor holding NaN or Inf, or whose squares overflow float32, gives a row whose min,
    max, mean, std or l2 is not finite: :func:`complete_graph_row` measures those from the
    tensor. Other dtypes take the masked float64 passes (exact counts, no assumption).

    Examples
    --------
    >>> graph_stats(torch.tensor([1.0, -3.0, 2.0]))[[0, 1, 4, 8]].tolist()
    [-3.0, 2.0, 3.0, 3.0]
    >>> x = torch.tensor([1.0, -3.0, float("inf")])
    >>> complete_graph_row(graph_stats(x), x)[[4, 7, 8]].tolist()
    [3.0, 1.0, 3.0]
    """
    t = t.detach()
    n = t.numel()
    if n == 0:
        return torch.tensor(_NAN_ROW + [0.0, 0.0, 0.0], dtype=torch.float64, device=t.device)
    if t.dtype == torch.bool:  # the 0/1 values (a dtype view does not trace)
        t = t.to(torch.uint8)
    v = _as_real(t)
    if v.device.type == "cpu":
        if v.is_floating_point() and v.element_size() <= 4:
            return _row_assuming_finite(v, n)
        return _row_sync_free(v, n)
    # float64 squares may need scaling: two passes
    return _row_sync_free(v, n) if v.dtype == torch.float64 else _row_one_pass(v, n)


def _row_assuming_finite(v: torch.Tensor, n: int) -> torch.Tensor:
    """The statistics row of a CPU floating tensor of up to 32 bits from four reductions that
    inductor fuses into one read (min, max, ``Σx``, ``Σx²``; float32 sums, float64 for
    narrower floats), its values assumed finite (see :func:`graph_stats`).

    ``M2 = Σx² - (Σx)²/n`` loses to cancellation a factor ``1 + mean²/std²`` of float32's
    error; where that factor passes 128 (values far from 0 with little spread: 1e4 ± 1e-3),
    std is left NaN and the record op measures the tensor (:func:`complete_graph_row`).
    Unshifted sums keep an outlier harmless (a shift by the first element cancelled when it
    was an attention sink at token 0: std 5% off for 1000 among a million N(0, 1) values);
    centring on the mean first would read the tensor twice (1.35x the compiled model alone
    for statistics only, against 1.2x). NaN propagates through min and max (inductor's
    reductions, as torch's), Inf makes them infinite, a sum that overflows the mean: each
    leaves a non-finite value statistic. So does a float32 tensor whose values are all
    under ``2^-40`` (but not all 0): their squares fall below float32's range (std 0 for
    values of 1e-30).
    """
    f64 = torch.float64
    # narrower floats widen straight to float64: inductor's CPU kernels take a float32
    # widening of a value they just rounded to 16 bits for the unrounded float32 value, so
    # min, max and the counts were of values never stored (an fp16 overflow to Inf unseen)
    x = v.double() if v.element_size() < 4 else v.float()
    s1, s2 = x.sum().to(f64), (x * x).sum().to(f64)
    lo, hi = x.amin().to(f64), x.amax().to(f64)
    mean = s1 / n
    m2 = (s2 - s1 * mean).clamp_min(0.0)
    std, l2 = (m2 / n).sqrt(), s2.sqrt()
    if x.dtype == torch.float32:  # (float64 sums of narrower floats lose nothing that matters)
        # mean² > 127·std²: float32's cancellation; values under 2^-40: squares below its range
        peak = torch.maximum(lo.abs(), hi.abs())
        tiny = (peak > 0) & (peak < 2.0**-40)
        std = torch.where((m2 * 128 < s2) | tiny, math.nan, std)  # completed from the tensor
        l2 = torch.where(tiny, math.nan, l2)
    zero = torch.zeros((), dtype=f64, device=v.device)  # finite values assumed: completed otherwise
    return _stacked_row(lo, hi, mean, std, l2, zero, zero, n)


def complete_graph_row(row: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``row`` (:func:`graph_stats` of ``t``, computed in a compiled graph), or, when it is
    on the CPU with a non-finite min, max, mean, std, absmax or l2, :func:`capture_stats`
    of ``t``: the statistics over its finite elements, NaN and Inf counted apart.

    An accelerator's row is exact as it is (and reading it would wait for the device).

    Examples
    --------
    >>> x = torch.tensor([float("nan"), 2.0])
    >>> complete_graph_row(graph_stats(x), x)[[0, 6]].tolist()
    [2.0, 1.0]
    """
    if row.device.type != "cpu" or bool(torch.isfinite(row[:6]).all()):
        return row
    return capture_stats(t)


def _row_one_pass(v: torch.Tensor, n: int) -> torch.Tensor:
    """The statistics row of a float32 (or, on an accelerator, narrower) tensor from
    reductions that read it once, fused by inductor into the loop that produces it.

    Shifted sums: ``d = x - K`` with ``K`` the first element (0 when it is not finite),
    ``M2 = Σd² - (Σd)²/c`` over the ``c`` finite elements. Without the shift ``Σx²`` and
    ``n·mean²`` would cancel when ``|mean| >> std``; with it the relative error of ``M2``
    is about ``ε·log n·(1 + ((mean - K)/std)²)``: a few float64 ulps for ``K`` within a
    few standard deviations of the mean. Plain sums need no division per element, as
    Welford's update (inductor's ``var_mean``) does.
    """
    f64 = torch.float64
    finite = torch.isfinite(v)  # masks, counts, min and max in v's dtype: exact, half the lanes
    cnt = finite.sum().to(f64)
    n_nan = (v != v).sum().to(f64)  # isnan would not vectorise
    lo = torch.where(finite, v, math.inf).amin().to(f64)
    hi = torch.where(finite, v, -math.inf).amax().to(f64)
    first = v[(0,) * v.dim()]
    shift = torch.where(torch.isfinite(first), first, 0.0).to(f64)
    d = torch.where(finite, v.to(f64) - shift, 0.0)  # exact widening: every narrower dtype fits
    s1, s2 = d.sum(), (d * d).sum()
    mean = shift + s1 / cnt
    m2 = (s2 - s1 * s1 / cnt).clamp_min(0.0)
    empty = cnt == 0
    lo, hi, mean = (torch.where(empty, math.nan, s) for s in (lo, hi, mean))
    std = torch.where(empty, math.nan, (m2 / cnt).sqrt())
    l2 = torch.where(empty, math.nan, (m2 + cnt * mean * mean).sqrt())
    return _stacked_row(lo, hi, mean, std, l2, n_nan, n - cnt - n_nan, n)


def capture_stats(t: torch.Tensor) -> torch.Tensor:
    """:func:`tensor_stats` as capture takes it: torch's reductions only (``compiled=False``),
    never numba, and float32 sums for CPU floats of up to 32 bits (``exact=False``)."""
    return tensor_stats(t, compiled=False, exact=False)


# float32 values whose squares, summed over any tensor, stay well inside float32's range and
# above its subnormals: beyond them the float64 path scales and sums (exact, slower)
_FLOAT32_SAFE = (2.0**-40, 2.0**40)
# Σx² - n·mean² only while mean² <= 7·std² (Σx² <= 8·M2: float32's error amplified 8x at
# most), else a second, centred read
_CANCELLATION = 8.0


def _row_float32_cpu(v: torch.Tensor, n: int) -> list[float] | None:
    """The statistics row of a finite CPU floating tensor of up to 32 bits from float32 sums,
    or ``None`` for the exact float64 path (NaN/Inf, magnitudes outside
    :data:`_FLOAT32_SAFE`).

    Capture's trade (GUIDE: statistics recorded at capture are right to about 1e-6): min
    and max by one ``aminmax`` (exact), ``Σx`` and ``Σx²`` by torch's float32 cascade
    summation (relative error about ``eps32·log2(n)``: 1.2e-6 at 2^20 elements in the worst
    case, ~1e-8 measured), ``M2 = Σx² - n·mean²`` while that cancels by at most a factor
    of :data:`_CANCELLATION`, else ``Σ(x - m)² - (Σ(x - m))²/n`` about the float32 mean
    ``m`` (the correction term takes back ``m``'s rounding, which for a mean 1e7 times the
    spread would be most of the variance). Against five float64 reads of a widened copy:
    about half the time (docs/benchmarks.md). BLAS ``dot`` and ``vector_norm`` were
    measured and refused: their float32 accumulation drifts to 1e-4 at 2^24 elements.
    """
    lo, hi = (float(x) for x in torch.aminmax(v))
    absmax = max(abs(lo), abs(hi))
    if not math.isfinite(absmax) or (0 < absmax < _FLOAT32_SAFE[0]) or absmax > _FLOAT32_SAFE[1]:
        return None  # NaN/Inf (counted by the masked path), or squares near float32's limits
    x = v if v.dtype == torch.float32 else v.float()  # 16-bit and 8-bit floats: exact in float32
    total = float(x.sum())
    squares = float(x.square().sum())
    mean = total / n
    if _CANCELLATION * n * mean * mean <= squares:
        m2 = max(squares - n * mean * mean, 0.0)
    else:
        mean = float(torch.tensor(mean, dtype=torch.float32))  # the m subtracted, exactly
        centred = x - mean
        shift = float(centred.sum())
        m2 = max(float(centred.square_().sum()) - shift * shift / n, 0.0)
        mean += shift / n
        squares = m2 + n * mean * mean
    return [lo, hi, mean, math.sqrt(m2 / n), absmax, math.sqrt(squares), 0.0, 0.0, float(n)]


def _masked_row_cpu(v: torch.Tensor, n: int) -> torch.Tensor:
    """The statistics row of a CPU float tensor holding NaN or Inf (over its finite elements)."""
    finite = torch.isfinite(v)
    n_nan = int(torch.isnan(v).sum())
    kept = v[finite]
    row = _finite_row_cpu(kept, kept.numel()) if kept.numel() else _NAN_ROW + [0.0] * 3
    row[6:9] = [float(n_nan), float(n - kept.numel() - n_nan), float(n)]
    return torch.tensor(row, dtype=torch.float64)


def _float32_row(v: torch.Tensor, sums: onepass.Float32Sums) -> torch.Tensor:
    """The statistics row from one read of a float32 tensor (:mod:`tdinspect.numerics.onepass`).

    ``M2 = Σx² - n·mean²`` when ``mean² <= std²/7`` (so ``Σx² <= 8/7·M2``: no
    cancellation), else the second, centred pass. float32 squares never overflow
    or lose bits in float64: no scaling.
    """
    n = sums.numel
    if sums.nonfinite:
        return _masked_row_cpu(v, n)
    mean = sums.total / n
    if 8 * n * mean * mean <= sums.squares:
        m2, sq = max(sums.squares - n * mean * mean, 0.0), sums.squares
    else:
        m2 = onepass.centred_squares(v, mean)
        sq = m2 + n * mean * mean
    lo, hi = sums.minimum, sums.maximum
    return torch.tensor(
        [lo, hi, mean, math.sqrt(m2 / n), max(abs(lo), abs(hi)), math.sqrt(sq), 0.0, 0.0, float(n)],
        dtype=torch.float64,
    )


def stats_and_checksum(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`capture_stats` and :func:`tdinspect.numerics.checksum.tensor_checksum` of ``t``:
    what capture records with ``checksum=True``, torch's reductions only (never numba).

    Examples
    --------
    >>> row, digest = stats_and_checksum(torch.arange(4.0))
    >>> row[2].item(), digest.dtype
    (1.5, torch.int64)
    """
    return capture_stats(t), tensor_checksum(t)


def stats_to_dict(vec: torch.Tensor | list[float]) -> dict[str, float]:
    """Name the entries of a statistics vector (see :data:`STAT_NAMES`)."""
    values = vec.tolist() if isinstance(vec, torch.Tensor) else list(vec)
    return dict(zip(STAT_NAMES, values))
