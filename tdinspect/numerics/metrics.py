"""Divergence metrics: the one definition used by Diff, replay, the CLI and the widgets.

``y`` is the reference run (the first argument of a diff), ``x`` the other.

=============  ================================================  ===========  =========  ===============
metric         definition                                        diverges     fixed      ``"auto"``
=============  ================================================  ===========  =========  ===============
rel_diff       ``1 - 2Σxy/(Σx²+Σy²)`` = ``Σ(x-y)²/(Σx²+Σy²)``    above        1e-3       ``u/4``
max_abs        ``max |x-y|``                                     above        1e-3       fixed
mean_abs       ``mean |x-y|``                                    above        1e-4       fixed
max_rel        ``max |x-y| / max(|y|, eps)``                     above        1e-2       fixed
cosine         ``Σxy / (‖x‖‖y‖)``, 1 when both are exactly 0     below        0.99       ``1 - u/4``
sqnr_db        ``10·log10(Σy² / Σ(x-y)²)``, inf when equal       below        30         ``10·log10(2/u)``
mismatch       fraction outside ``atol + rtol·|y|``              above        0          fixed
equal          same dtype and same bits (1 or 0)                 below (0)    1          fixed
rel_diff_cast  ``rel_diff`` after rounding the wider side        above        1e-3       ``u/4``
max_abs_cast   ``max_abs`` after rounding the wider side         above        1e-3       fixed
stats_rel      min, max, mean ``|a-b|/absmax_b``; l2 ``/l2_b``   above        1e-3       ``max(1e-3, 4u)``
=============  ================================================  ===========  =========  ===============

``rel_diff`` is computed in its second form, which is the same number without
the cancellation of the first when the runs are close (≈ ½·relative L2 error²,
so 1e-3 fires near 4.5%). Every element is compared in float64 and every sum
accumulated in float64, in one fused read of both tensors
(:mod:`tdinspect.numerics.kernels`).
``mismatch`` uses ``torch.testing.assert_close``'s default tolerances for the
pair's dtypes (the looser of the two). Only elements finite on both sides
enter the numbers; NaN/Inf where the other side is finite is a *structural*
divergence, reported with its reason.

When the dtypes differ, ``rel_diff_cast`` and ``max_abs_cast`` compare after
rounding the wider side to the narrower dtype (what the narrow run could at
best have produced); with one dtype they equal ``rel_diff`` and ``max_abs``.

Thresholds: ``threshold="auto"`` (the default everywhere a threshold is
taken) derives each entry's threshold from its two dtypes
(:func:`auto_threshold`); an explicit number keeps the *fixed* column.
``u`` is the unit roundoff (``finfo(dtype).eps / 2``) of the *coarser* of the
pair's dtypes (complex: its real dtype; integers and bool: ``u = 0``, exact;
a float facing an integer: the float's):

=============  ========  ========  ========  =========  =============  ===========
``"auto"``     float64   float32   float16   bfloat16   float8_e4m3fn  float8_e5m2
=============  ========  ========  ========  =========  =============  ===========
u              1.1e-16   6.0e-8    4.9e-4    3.9e-3     0.0625         0.125
rel_diff       2.8e-17   1.5e-8    1.2e-4    9.8e-4     0.016          0.031
cosine         1-8.9e-16 1-1.5e-8  1-1.2e-4  1-9.8e-4   0.984          0.969
sqnr_db        162.6     75.3      36.1      27.1       15.1           12.0
stats_rel      1e-3      1e-3      2.0e-3    0.016      0.25           0.5
=============  ========  ========  ========  =========  =============  ===========

Why ``u/4``: ``rel_diff ≈ ½·(relative L2 error)²``, so ``rel_diff > u/4``
means a relative L2 error above ``sqrt(u/2)``: the two runs agree to fewer
than about half the significant digits the coarser dtype carries. Ordinary
noise (another reduction order, another device, a fused kernel) stays a few
``u`` per element and grows slowly through a model, far below
``sqrt(u/2)`` (float32: 1.7e-4); a real bug (a 1% change of one norm weight,
another RoPE theta: rel_diff 5e-5 and 8e-5 in float32) is far above
``u/4`` (float32: 1.5e-8). A multiple of ``u`` squared (``(k·u)²``, 4e-15 ·
k² in float32) would sit inside that noise and fire on it. bfloat16 keeps
1e-3's old behaviour (9.8e-4). ``cosine`` uses the same quantity
(``1 - cosine ≈ rel_diff`` for close runs), floored at ``1 - 2^-50`` (four
ulps below 1, what a float64 cosine can resolve); ``sqnr_db =
-10·log10(2·rel_diff)`` gives ``10·log10(2/u)`` dB. Integers get 0 /
1 / inf: any difference diverges. The other metrics have no dtype-derived
scale and keep their fixed defaults under ``"auto"``; ``mismatch`` already
uses ``assert_close``'s per-dtype tolerances. A row whose dtypes are
unknown (an entry on one side only) uses the fixed default.

The precision the data has been through, not only the entry's own dtypes:
where rows are judged (:class:`tdinspect.compare.diff.Thresholds`, live comparison
included), a floating entry's ``u`` is the largest of its own and its
*upstream* one: for each side, the coarsest floating dtype among that side's
entries of the same (rank, pass) up to and including this one in execution
order, and of the two sides the coarser (:func:`tdinspect.compare.diff.upstream_of`;
integer, bool and unknown dtypes do not count). Why: a float32 op on
bfloat16-rounded values carries bfloat16 error. A bfloat16 model's RMSNorm
upcasts to float32 (``aten.pow`` 3e-5 against float32's 1.5e-8) and its
rotary ``inv_freq`` is rounded to bfloat16 before a float32 ``aten.sin``;
judged by their own float32 dtypes they fired on rounding alone. The
reason then names the source: ``rel_diff 3e-05 > 0.000977 (auto: bfloat16
upstream)``. An integer result stays exact (its own dtypes decide). This
function stays the rule of one dtype pair.

Exact in meaning at every magnitude:

- float64 sums of squares that would overflow (``1e200``) or underflow
  (``1e-200``) are recomputed on both sides scaled by one exact power of two
  (the ratios ``rel_diff``, ``cosine``, ``sqnr_db`` do not change);
- integers are compared as integers (``x - y`` exact in int64: ``2**60`` and
  ``2**60 + 1`` differ by 1, so ``max_abs`` is 1 and ``equal`` 0);
- ``equal`` compares bits: NaN equals the same NaN, ``-0.0`` differs from
  ``0.0``, two dtypes are never equal;
- complex tensors are compared as (real, imag) pairs, a real side facing a
  complex one as complex with imaginary part 0 (``max_abs`` is then the
  largest difference of a component);
- ``cosine`` is 1 only for two exactly-zero tensors (tiny ones are compared
  as they are: ``1e-14`` vs ``-1e-14`` is -1), and ``Σxy`` is summed directly
  when the norms are far apart (its derived form would cancel);
- a metric that comes out NaN counts as a divergence ("could not be
  computed"), never a silent pass.

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
import sys
from dataclasses import dataclass

import numpy as np
import torch

from tdinspect.numerics.kernels import EPS, NUMBA_MIN_BYTES, UINT_OF, PairSums, pair_sums
from tdinspect.numerics.shapes import broadcast_dims, first_slice

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
        """Whether ``value`` passes ``threshold`` in this metric's bad direction; a value
        that could not be computed (NaN) counts, never a silent pass."""
        if value is None or math.isnan(value):
            return True
        return value > threshold if self.higher_is_worse else value < threshold


METRICS: dict[str, Metric] = {
    m.name: m
    for m in [
        Metric("rel_diff", True, 1e-3, "1 - 2Σxy/(Σx²+Σy²), scale-free, 0 when identical"),
        Metric("max_abs", True, 1e-3, "max |x - y|"),
        Metric("mean_abs", True, 1e-4, "mean |x - y|"),
        Metric("max_rel", True, 1e-2, "max |x - y| / |y|"),
        Metric("cosine", False, 0.99, "cosine similarity; diverges below the threshold"),
        Metric("sqnr_db", False, 30.0, "signal-to-quantisation-noise ratio in dB; diverges below"),
        Metric("mismatch", True, 0.0, "fraction of elements outside assert_close's atol + rtol·|y|"),
        Metric("equal", False, 1.0, "1 when bitwise equal; diverges when 0"),
        Metric(
            "rel_diff_cast",
            True,
            1e-3,
            "rel_diff after rounding the wider side to the narrower dtype (rel_diff when the dtypes agree)",
        ),
        Metric(
            "max_abs_cast",
            True,
            1e-3,
            "max_abs after rounding the wider side to the narrower dtype (max_abs when the dtypes agree)",
        ),
        Metric(
            "stats_rel",
            True,
            1e-3,
            "statistics-only diff: max relative difference of min, max, "
            "mean (on the reference's absmax) and l2",
        ),
    ]
}
TENSOR_METRICS = (
    "rel_diff",
    "max_abs",
    "mean_abs",
    "max_rel",
    "cosine",
    "sqnr_db",
    "mismatch",
    "equal",
    "rel_diff_cast",
    "max_abs_cast",
)
_FLOAT8_RTOL = {
    "float8_e4m3fn": 0.125,
    "float8_e4m3fnuz": 0.125,
    "float8_e5m2": 0.25,
    "float8_e5m2fnuz": 0.25,
    "float8_e8m0fnu": 1.0,
}


def metric(name: str) -> Metric:
    """Look a metric up by name (clear error listing the known ones)."""
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; choose one of {sorted(METRICS)}") from None


AUTO = "auto"
# metrics whose "auto" threshold comes from the dtypes (the others keep their fixed default)
_AUTO_RULES = {
    "rel_diff": "u/4",
    "rel_diff_cast": "u/4",
    "cosine": "1 - u/4",
    "sqnr_db": "10·log10(2/u) dB",
    "stats_rel": "max(1e-3, 4·u)",
}
_COSINE_FLOOR = 1 - 2.0**-50  # four ulps below 1: what a float64 cosine resolves
_DTYPES = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}  # a fixed table: a dtype named in a file is looked up here
_INTEGER = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    *(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)),
}


def dtype_named(dtype) -> torch.dtype | None:
    """A ``torch.dtype`` from itself or its name (``"torch.float32"``, ``"float32"``);
    ``None`` for an empty or unknown name."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        return None
    return _DTYPES.get(dtype.removeprefix("torch."))


def unit_roundoff(dtype) -> float | None:
    """``u = finfo(dtype).eps / 2`` (complex: of its real dtype); 0 for integers and bool
    (exact); ``None`` when unknown (no dtype, a quantized or packed one).

    Examples
    --------
    >>> unit_roundoff("torch.bfloat16"), unit_roundoff(torch.int64)
    (0.00390625, 0.0)
    """
    dt = dtype_named(dtype)
    if dt is None:
        return None
    if dt.is_complex:
        dt = dt.to_real()
    if dt.is_floating_point:
        return torch.finfo(dt).eps / 2
    return 0.0 if dt in _INTEGER else None


@functools.lru_cache(maxsize=4096)
def auto_threshold(metric_name: str, dtype_a, dtype_b) -> tuple[float, str]:
    """The ``threshold="auto"`` of one entry: ``(value, where it came from)``.

    ``u`` is the unit roundoff of the coarser of the two dtypes (see the module
    docstring's table): ``rel_diff`` and ``rel_diff_cast`` ``u/4``, ``cosine``
    ``1 - u/4`` (at most ``1 - 2^-50``), ``sqnr_db`` ``10·log10(2/u)``, ``stats_rel``
    ``max(1e-3, 4·u)``; the source is ``"auto: <coarser dtype>"``. Other metrics, and entries whose
    dtypes are unknown (on one side only), get the metric's fixed default and
    the source ``"default"``.

    Examples
    --------
    >>> auto_threshold("rel_diff", "torch.float32", "torch.float32")
    (1.4901161193847656e-08, 'auto: float32')
    >>> auto_threshold("rel_diff", "torch.float32", "torch.bfloat16")
    (0.0009765625, 'auto: bfloat16')
    >>> auto_threshold("max_abs", "torch.float32", "torch.float32")
    (0.001, 'default')
    """
    m = metric(metric_name)
    ua, ub = unit_roundoff(dtype_a), unit_roundoff(dtype_b)
    if m.name not in _AUTO_RULES or ua is None or ub is None:
        return m.default_threshold, "default"
    u, coarser = max((ua, dtype_a), (ub, dtype_b), key=lambda t: t[0])
    source = f"auto: {str(dtype_named(coarser)).removeprefix('torch.')}"
    if m.name == "cosine":
        return min(1 - u / 4, _COSINE_FLOOR) if u else 1.0, source
    if m.name == "sqnr_db":
        return (10 * math.log10(2 / u) if u else math.inf), source
    if m.name == "stats_rel":
        # a max or mean a few roundings apart reads as a few u: 1e-3 sat below bfloat16's
        # (a compiled bf16 model's statistics, 0.0063 from eager, were called a divergence)
        return max(m.default_threshold, 4 * u), source
    return u / 4, source


def auto_rule(metric_name: str) -> str:
    """How ``"auto"`` sets ``metric_name``'s threshold, in words (for reprs and help)."""
    m = metric(metric_name)
    rule = _AUTO_RULES.get(m.name)
    if rule is None:
        return f"{m.name} has no dtype-derived scale: {m.default_threshold:g}"
    return f"{m.name} {rule}, u = unit roundoff of the coarser dtype"


# metrics a baseline run can budget (errors: 0 when equal, growing with the difference), and how
# an error of n units of roundoff reads in each (values of order 1 for the absolute ones)
_FLOOR_RULES = {
    "rel_diff": "½·(n·u)²",
    "rel_diff_cast": "½·(n·u)²",
    "max_rel": "n·u",
    "max_abs": "n·u",
    "max_abs_cast": "n·u",
    "mean_abs": "n·u",
    "stats_rel": "n·u",
    "mismatch": "0",
}


@functools.lru_cache(maxsize=1024)
def roundoff_floor(metric_name: str, dtype_a, dtype_b, units: float = 4) -> float:
    """The error of ``units`` units of roundoff of the coarser dtype, as ``metric_name`` reads it.

    The least error a baseline's budget allows (:mod:`tdinspect.compare.baseline`): a baseline
    bitwise equal to the reference would otherwise make every last-bit difference a divergence.
    A relative error ``ε`` gives ``rel_diff ≈ ½·ε²``, so ``rel_diff`` gets ``½·(n·u)²``
    (float32, n = 4: 2.8e-14); ``max_rel``, ``stats_rel`` and the absolute metrics ``n·u`` (for
    values of order 1); ``mismatch`` 0. 0 when a dtype is unknown or integer (exact).

    Raises
    ------
    ValueError
        For metrics that are not errors (``cosine``, ``sqnr_db``, ``equal``).

    Examples
    --------
    >>> f"{roundoff_floor('rel_diff', 'torch.float64', 'torch.float32'):.2g}"
    '2.8e-14'
    """
    m = metric(metric_name)
    if m.name not in _FLOOR_RULES:
        raise ValueError(
            f"metric {m.name!r} is not an error a baseline can budget: use one of {sorted(_FLOOR_RULES)}"
        )
    ua, ub = unit_roundoff(dtype_a), unit_roundoff(dtype_b)
    u = max(ua or 0.0, ub or 0.0) if ua is not None and ub is not None else 0.0
    if m.name == "mismatch":
        return 0.0
    if m.name in ("rel_diff", "rel_diff_cast"):
        return 0.5 * (units * u) ** 2
    return units * u


@functools.cache  # torch's lookup costs ~60 us; diffs call it per entry
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
            r, a = {
                torch.float16: (1e-3, 1e-5),
                torch.bfloat16: (1.6e-2, 1e-5),
                torch.float32: (1.3e-6, 1e-5),
                torch.float64: (1e-7, 1e-7),
            }.get(dt, (0.0, 0.0))
        rtol, atol = max(rtol, r), max(atol, a)
    return rtol, atol


def _real_pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Complex tensors as (real, imag) pairs; a real side facing a complex one gets imag 0."""
    if not (x.is_complex() or y.is_complex()):
        return x, y
    if not x.is_complex():
        x = torch.complex(x.double(), torch.zeros((), dtype=torch.float64).expand(x.shape))
    if not y.is_complex():
        y = torch.complex(y.double(), torch.zeros((), dtype=torch.float64).expand(y.shape))
    return torch.view_as_real(x), torch.view_as_real(y)


_PREFIX = 256  # elements compared first by same_bits (below torch's parallel grain)
# torch's own bit views (signed: torch >= 2.4's uint16/32/64 lack most ops; kernels.UINT_OF is
# numpy's)
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` have one dtype, one shape and the same bits everywhere.

    NaN equals the same NaN, ``-0.0`` differs from ``0.0`` (the metric ``equal``).
    """
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    if x.is_floating_point():
        x, y = x.view(_BITS_VIEW[x.element_size()]), y.view(_BITS_VIEW[y.element_size()])
    xb, yb = _raw_bytes(x), _raw_bytes(y)
    if xb is None or yb is None:
        if (
            x.numel() > _PREFIX
            and x.is_contiguous()
            and y.is_contiguous()
            and not torch.equal(x.view(-1)[:_PREFIX], y.view(-1)[:_PREFIX])
        ):
            # most differing pairs differ at once: a whole-tensor torch.equal is a parallel op,
            # and on a busy machine its threads' rendezvous took 20-40 ms a 512 KB pair
            return False
        return torch.equal(x, y)
    return equal_bytes(xb, yb)


def _raw_bytes(t: torch.Tensor) -> np.ndarray | None:
    """The bytes of a dense contiguous CPU tensor as a numpy array (no copy), else ``None``."""
    if (
        t.device.type != "cpu"
        or t.layout != torch.strided
        or not t.is_contiguous()
        or t.is_conj()
        or t.is_neg()
    ):
        return None
    try:
        return t.detach().reshape(-1).view(torch.uint8).numpy()
    except RuntimeError:  # "contiguous" with a stride-0 size-1 dim, which view() refuses
        return None


def equal_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two uint8 arrays hold the same bytes, compared 8 at a time (about memcmp's
    speed: 36 GB/s measured for 1 MB, against 6 GB/s for ``torch.equal`` on one thread, whose
    thread pool also waits milliseconds for a busy core); a first block settles most
    differing pairs without reading the rest."""
    if a.shape != b.shape:
        return False
    head = 4096
    # the first block as bytes objects: 0.5 us (array_equal: 2.4 us)
    if a.shape[0] > head and a[:head].tobytes() != b[:head].tobytes():
        return False
    if a.shape[0] % 8 == 0:
        a, b = a.view(np.uint64), b.view(np.uint64)
    return bool(np.array_equal(a, b))


def _compute_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """The dtype both sides are handed to the kernel in (exact for every float up to 32 bits)."""
    return (
        torch.float64
        if torch.float64 in (a.dtype, b.dtype) or not (a.is_floating_point() and b.is_floating_point())
        else torch.float32
    )


def _nonfinite_mismatch(x: torch.Tensor, y: torch.Tensor) -> int:
    """Elements where NaN/Inf on one side meets something else on the other."""
    xn, yn = torch.isnan(x), torch.isnan(y)
    bad = xn != yn
    xi, yi = torch.isinf(x), torch.isinf(y)
    bad |= (xi | yi) & ~(xn | yn) & (x != y)
    return int(bad.sum())


# narrow floats handed to the kernel as their raw bits (torch has no uint16 <-> numpy for
# bf16, and a float32 copy would cost a write and a read of twice the bytes)
_CODED = {
    dt: torch.uint8 if torch.empty((), dtype=dt).element_size() == 1 else torch.uint16
    for dt in (torch.bfloat16, torch.float16, *(getattr(torch, n) for n in _FLOAT8_RTOL if hasattr(torch, n)))
}


# every dtype compared as stored when both sides have it (no copy): the numpy dtype of its
# elements as the kernel reads them (narrow floats: their bits) and the kernel's codec name
STORED = {
    torch.float32: (np.float32, None),
    torch.float64: (np.float64, None),
    **{dt: (UINT_OF[dt.itemsize], str(dt).removeprefix("torch.")) for dt in _CODED},
}


def stored_metrics(
    x: np.ndarray, y: np.ndarray, dtype: torch.dtype
) -> tuple[dict[str, float] | None, PairSums | None]:
    """:func:`compare_tensors` of two flat, non-empty arrays of one dtype of :data:`STORED`,
    as stored (``x`` the compared side, ``y`` the reference), where its plain course
    settles them: ``(metrics, None)``; else ``(None, the kernel's sums)`` (NaN/Inf, float64
    sums beyond range, ``Σxy`` to sum directly: :func:`compare_tensors`' other steps).

    The one per-pair computation of :func:`compare_tensors` for contiguous tensors of one
    dtype, and of :mod:`tdinspect.compare.plainpairs` on a pass file's bytes: the same bits either
    way.

    Examples
    --------
    >>> y = np.array([1.0, 2.0], np.float32)
    >>> stored_metrics(np.array([1.0, 2.5], np.float32), y, torch.float32)[0]["max_abs"]
    0.5
    """
    out = dict.fromkeys(TENSOR_METRICS, math.nan)
    out["nonfinite_mismatch"] = 0.0
    if equal_bytes(x.view(np.uint8), y.view(np.uint8)):
        out.update(_IDENTICAL)
        return out, None
    rtol, atol = tolerances(dtype, dtype)
    s = pair_sums(x, y, rtol=rtol, atol=atol, codes=STORED[dtype][1])
    found = settled(s, dtype == torch.float64)
    if found is None:
        return None, s
    out.update(found)
    return out, None


def settled(s: PairSums, wide: bool) -> dict[str, float] | None:
    """:func:`compare_tensors`' metrics from the sums of a pair of one float dtype that is not
    bitwise equal (``wide``: float64), or ``None`` where it takes a special road: a NaN or
    Inf (masked), float64 sums out of range (rescaled), ``Σxy`` summed directly."""
    if not (math.isfinite(s.sxx) and math.isfinite(s.syy)):
        return None
    if wide and needs_rescaling(s):
        return None
    sxy = sxy_derived(s)
    return None if sxy is None else _from_sums(s, sxy)


def _stored_pair(x: torch.Tensor, y: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """Two non-empty dense contiguous CPU tensors of one dtype of :data:`STORED` as flat numpy
    arrays of what they store (no copy), else ``None``."""
    if x.dtype != y.dtype or not x.numel():
        return None
    xs, ys = as_stored(x, x.dtype), as_stored(y, x.dtype)
    return None if xs is None or ys is None else (xs, ys)


def as_stored(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray | None:
    """A dense contiguous CPU tensor of ``dtype`` (one of :data:`STORED`) as a flat numpy array
    of what it stores (narrow floats: their bits; no copy), else ``None``."""
    if (
        t.dtype != dtype
        or dtype not in STORED
        or t.device.type != "cpu"
        or t.layout != torch.strided
        or not t.is_contiguous()
        or t.is_conj()
        or t.is_neg()
    ):
        return None
    bits = _CODED.get(dtype)
    if bits is None and STORED[dtype][1] is not None:  # not handed as bits: the float32 copy
        return None
    try:
        return (t if bits is None else t.view(bits)).detach().numpy().reshape(-1)
    except (RuntimeError, TypeError):  # a size-1 dim of stride 0, which view() refuses
        return None


def _sums(
    xr: torch.Tensor,
    yr: torch.Tensor,
    dt: torch.dtype,
    rtol: float,
    atol: float,
    chunk: int,
    scale: float = 1.0,
    min_numba: int = NUMBA_MIN_BYTES,
) -> PairSums:
    """The kernel's sums of two flat tensors (times ``scale``), converted to ``dt`` a chunk
    at a time if needed (``min_numba``: see :func:`~tdinspect.numerics.kernels.pair_sums`)."""
    if scale == 1.0 and xr.is_contiguous() and yr.is_contiguous():
        if xr.dtype == yr.dtype == dt:  # no copy at all
            return pair_sums(xr.numpy(), yr.numpy(), rtol=rtol, atol=atol, min_numba=min_numba)
        if xr.dtype == yr.dtype and xr.dtype in _CODED:  # bf16/fp16/fp8: decoded in the loop
            bits = _CODED[xr.dtype]
            return pair_sums(
                xr.view(bits).numpy(),
                yr.view(bits).numpy(),
                rtol=rtol,
                atol=atol,
                codes=str(xr.dtype).removeprefix("torch."),
                min_numba=min_numba,
            )
    s = PairSums()
    for i in range(0, xr.numel(), chunk):  # memory stays bounded for huge tensors
        xc, yc = xr[i : i + chunk].to(dt), yr[i : i + chunk].to(dt)
        if scale != 1.0:
            xc, yc = xc * scale, yc * scale
        s += pair_sums(
            xc.contiguous().numpy(), yc.contiguous().numpy(), rtol=rtol, atol=atol, min_numba=min_numba
        )
    return s


def _integer_sums(xr: torch.Tensor, yr: torch.Tensor, chunk: int) -> tuple[PairSums, float]:
    """The sums (and ``Σxy``) of two integer tensors with ``x - y`` taken exactly (as
    integers), so that ``2**60`` and ``2**60 + 1`` differ by 1; tolerances are zero (torch's
    for integers)."""
    s, sxy = PairSums(n=xr.numel()), 0.0
    f64 = torch.float64
    for i in range(0, xr.numel(), chunk):
        x, y = xr[i : i + chunk].to(torch.int64), yr[i : i + chunk].to(torch.int64)
        d = x - y  # wraps only when the signs differ and |x - y| > 2**63 - 1 ...
        wrapped = ((x < 0) != (y < 0)) & ((d < 0) != (x < 0))
        ad = torch.where(wrapped, x.to(f64) - y.to(f64), d.to(f64)).abs()  # ... then it is huge
        xf, yf = x.to(f64), y.to(f64)
        s.sxx += float(xf.square().sum())
        s.syy += float(yf.square().sum())
        sxy += float((xf * yf).sum())
        s.sdd += float(ad.square().sum())
        s.sabs += float(ad.sum())
        if ad.numel():
            s.max_abs = max(s.max_abs, float(ad.max()))
            s.max_rel = max(s.max_rel, float((ad / yf.abs().clamp_min(EPS)).max()))
        s.mismatch += int((ad > 0).sum())
    return s, sxy


_TINY_SUMS = 2.0**-600  # sums of squares below this lost bits to underflow (float64 only)


def needs_rescaling(s: PairSums) -> bool:
    """Whether float64 sums overflowed or underflowed (not two all-zero sides)."""
    if s.max_abs == 0 and s.sxx == 0 and s.syy == 0:
        return False  # zeros (or signed zeros) on both sides
    return not (math.isfinite(s.sxx + s.syy + s.sdd) and max(s.sxx, s.syy) >= _TINY_SUMS)


def sxy_derived(s: PairSums) -> float | None:
    """``Σxy`` as ``(Σx² + Σy² - Σ(x-y)²) / 2`` where that is accurate (see :func:`_sxy`),
    else ``None`` (it must be summed directly)."""
    if s.sxx == 0 or s.syy == 0:
        return 0.0  # exactly: a side is all zeros (cosine is then 1 or 0 without it)
    if s.sxx + s.syy <= 16 * math.sqrt(s.sxx) * math.sqrt(s.syy):
        return (s.sxx + s.syy - s.sdd) / 2
    return None


def _rescaled(s: PairSums, xr, yr, dt, rtol, atol, chunk) -> tuple[PairSums, float]:
    """Float64 sums of squares that overflowed or underflowed, recomputed on ``x·2^-e, y·2^-e``
    (``2^e`` near the largest magnitude: exact), as far as the ratios need them; and the
    scale used (1.0: none)."""
    if not needs_rescaling(s):
        return s, 1.0
    top = max(float(xr.abs().max()), float(yr.abs().max())) if xr.numel() else 0.0
    if top == 0 or not math.isfinite(top):
        return s, 1.0
    scale = math.ldexp(1.0, min(1000, -math.frexp(top)[1]))  # 2**1074 is past float64's range
    t = _sums(xr, yr, dt, rtol, atol, chunk, scale)
    # ratios of the scaled sums are the metrics' ratios; Σ|d| scales back (it may overflow:
    # then the true mean_abs is beyond float64 too); max_abs, max_rel, mismatch stay unscaled
    return PairSums(s.n, t.sxx, t.syy, t.sdd, t.sabs / scale, s.max_abs, s.max_rel, s.mismatch), scale


def _sxy(s: PairSums, xr, yr, dt, chunk, scale) -> float:
    """``Σxy``: from the kernel's sums, ``(Σx² + Σy² - Σ(x-y)²) / 2``, whose error is a few
    ulps of ``Σx² + Σy²``; that is a few ulps of ``‖x‖‖y‖`` (what cosine divides by) unless
    the norms differ by orders of magnitude. Then it is summed directly (a second read;
    ``[1e10, 0]`` vs ``[1e-3, 1]`` had cosine off by 6e-4 the other way)."""
    derived = sxy_derived(s)
    if derived is not None:
        return derived
    total = 0.0
    for i in range(0, xr.numel(), chunk):
        xc = xr[i : i + chunk].to(torch.float64)
        yc = yr[i : i + chunk].to(torch.float64)
        if scale != 1.0:
            xc, yc = xc * scale, yc * scale
        total += float(torch.dot(xc, yc))
    return total


def _from_sums(s: PairSums, sxy: float) -> dict[str, float]:
    m = s.n
    denom = s.sxx + s.syy
    out = {
        "rel_diff": s.sdd / denom if denom > 0 else 0.0,
        "max_abs": s.max_abs,
        "mean_abs": s.sabs / m if m else 0.0,
        "max_rel": s.max_rel,
    }
    if s.sxx == 0 and s.syy == 0:
        out["cosine"] = 1.0  # two zero vectors (exactly zero: tiny ones are compared as they are)
    elif s.sxx == 0 or s.syy == 0:
        out["cosine"] = 0.0
    else:  # clamp: rounding may carry |cos| a hair past 1
        out["cosine"] = max(-1.0, min(1.0, sxy / (math.sqrt(s.sxx) * math.sqrt(s.syy))))
    out["sqnr_db"] = math.inf if s.sdd == 0 else (sqnr_of_ratio(s.syy, s.sdd) if s.syy > 0 else -math.inf)
    out["mismatch"] = s.mismatch / m if m else 0.0
    out["equal"] = 0.0  # called for pairs that are not bitwise equal
    out["rel_diff_cast"], out["max_abs_cast"] = out["rel_diff"], out["max_abs"]  # one dtype
    return out


_NORMAL_MIN = sys.float_info.min  # the smallest normal float64


def sqnr_of_ratio(syy: float, sdd: float) -> float:
    """``10·log10(Σy² / Σ(x-y)²)`` for two positive sums, also where their quotient leaves
    float64's normal range (``Σy²`` of 1e-300 against 1e300: the logarithms' difference, finite).

    Examples
    --------
    >>> sqnr_of_ratio(100.0, 1.0), sqnr_of_ratio(1e-300, 1e300)
    (20.0, -6000.0)
    """
    ratio = syy / sdd
    if not _NORMAL_MIN <= ratio < math.inf:  # 0, subnormal (few bits left) or inf
        return 10 * (math.log10(syy) - math.log10(sdd))
    return 10 * math.log10(ratio)


_IDENTICAL = dict(
    rel_diff=0.0,
    max_abs=0.0,
    mean_abs=0.0,
    max_rel=0.0,
    cosine=1.0,
    sqnr_db=math.inf,
    mismatch=0.0,
    equal=1.0,
    rel_diff_cast=0.0,
    max_abs_cast=0.0,
)


def compare_tensors(x: torch.Tensor, y: torch.Tensor, *, chunk: int = 1 << 18) -> dict[str, float]:
    """All tensor metrics of ``x`` against the reference ``y`` (same shape).

    Parameters
    ----------
    x, y : torch.Tensor
        The compared tensor and the reference; any dtypes (compared as numbers:
        integers as integers, complex as (real, imag) pairs, a real side
        facing a complex one as complex with imaginary part 0).
    chunk : int
        Elements converted at a time when a dtype conversion or a copy is
        needed: memory stays bounded for huge tensors.

    Returns
    -------
    dict
        The metrics of the module table, plus ``nonfinite_mismatch`` (count of
        NaN/Inf positions that differ) and the ``_cast`` metrics (equal to
        their plain versions when the dtypes are the same).
    """
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: {list(x.shape)} vs {list(y.shape)}")
    s = None
    stored = _stored_pair(x, y)
    if stored is not None:  # the usual pair, in few calls: one dtype, contiguous, as stored
        found, s = stored_metrics(*stored, x.dtype)
        if found is not None:
            return found
    else:
        both = broadcast_dims(x) & broadcast_dims(y)  # broadcast on both sides: one copy says all
        x, y = first_slice(x, both), first_slice(y, both)
    out = {k: math.nan for k in TENSOR_METRICS}
    out["nonfinite_mismatch"] = 0.0
    if s is None and same_bits(x, y):  # the common case in same-backend runs: nothing to do
        out.update(_IDENTICAL)
        return out
    rtol, atol = tolerances(x.dtype, y.dtype)
    xr, yr = (t.detach().reshape(-1) for t in _real_pair(x, y))
    if not (xr.is_floating_point() or yr.is_floating_point()):
        s, sxy = _integer_sums(xr, yr, chunk)
    else:
        dt = _compute_dtype(xr, yr)
        if s is None:  # (a stored pair's sums are these: the same call on the same arrays)
            s = _sums(xr, yr, dt, rtol, atol, chunk)
        if not (math.isfinite(s.sxx) and math.isfinite(s.syy)):
            # A NaN/Inf somewhere (or float64 squares beyond its range): count where the sides
            # disagree, then compare only the elements finite on both. Finite tensors, the
            # usual case, are read once.
            # torch has no isinf/isfinite for float8: its masks come from a float32 copy
            xm, ym = (t.float() if t.is_floating_point() and t.element_size() == 1 else t for t in (xr, yr))
            out["nonfinite_mismatch"] = float(_nonfinite_mismatch(xm, ym))
            keep = torch.isfinite(xm) & torch.isfinite(ym)
            if not bool(keep.all()):
                xr, yr = xr[keep], yr[keep]
                s = _sums(xr, yr, dt, rtol, atol, chunk)
        scale = 1.0
        if dt == torch.float64:
            s, scale = _rescaled(s, xr, yr, dt, rtol, atol, chunk)
        sxy = _sxy(s, xr, yr, dt, chunk, scale)
    out.update(_from_sums(s, sxy))
    if x.dtype != y.dtype and x.is_floating_point() and y.is_floating_point():
        narrow = min((x.dtype, y.dtype), key=lambda d: torch.finfo(d).bits)
        cast = compare_tensors(x.to(narrow), y.to(narrow), chunk=chunk)
        out["rel_diff_cast"], out["max_abs_cast"] = cast["rel_diff"], cast["max_abs"]
    return out


STAT_COMPARED = ("min", "max", "mean", "l2")


def stats_rel(a: dict[str, float], b: dict[str, float]) -> float:
    """Statistics-only divergence: the largest relative difference of min, max, mean and l2.

    ``b`` is the reference. min, max and mean are compared on the scale of the
    reference's values, ``|a-b| / max(|b_min|, |b_max|)`` (a mean near 0, a
    LayerNorm output's, is no scale: divided by itself, its rounding read as
    3300%); l2 against itself. NaN statistics (empty tensors) are skipped.

    Examples
    --------
    >>> ref = {"min": -2.0, "max": 2.0, "mean": 1e-9, "l2": 8.0}
    >>> f"{stats_rel({'min': -2.0, 'max': 2.0, 'mean': 3e-9, 'l2': 8.0}, ref):.3g}"
    '1e-09'
    >>> f"{stats_rel({'min': -2.0, 'max': 2.02, 'mean': 1e-9, 'l2': 8.0}, ref):.3g}"
    '0.01'
    """
    worst = 0.0
    scale = max(
        (abs(v) for v in (b.get("min", math.nan), b.get("max", math.nan)) if not math.isnan(v)),
        default=math.nan,
    )
    for s in STAT_COMPARED:
        va, vb = a.get(s, math.nan), b.get(s, math.nan)
        if math.isnan(va) and math.isnan(vb):
            continue
        if math.isnan(va) or math.isnan(vb):
            return math.inf
        floor = 0.0 if s == "l2" or math.isnan(scale) else scale
        worst = max(worst, abs(va - vb) / max(abs(vb), floor, EPS))
    return worst
