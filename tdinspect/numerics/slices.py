"""Every slice judged: the worst slice of a pair made of slices, from sums read with the whole.

A comparison made of slices (decode calls put end to end by ``concat``, ranks by
``unshard``, a request's tokens lined up by ``tokens=True``) reads each slice's seven
sums anyway (they add up to the pair's: :class:`~tdinspect.numerics.kernels.PairSums`), so
judging each slice costs no second read. A whole-tensor metric dilutes a fault confined to
one slice: ``1e-3 x mean|out|`` added on one decode position of 127 is 20x past
``rel_diff``'s threshold on its own and 0.2x of it averaged over the whole.

The rule per slice is the rule of the whole (:func:`tdinspect.compare.thresholds.divergent`,
the same threshold, ``"auto"`` from the dtypes). Why no looser threshold for smaller slices:
``rel_diff``, ``cosine`` and ``sqnr_db`` are ratios of a slice's error energy to its own
signal energy, so rounding noise (a relative error of a few ``u`` an element) gives a slice
the ratio it gives the whole, whatever its size; the ``"auto"`` threshold ``u/4`` is a
relative L2 error of ``sqrt(u/2)``, orders of magnitude past that noise (float32: 1.7e-4
against about 1e-7). A slice is a token's row or a decode step (a hidden size of elements,
not one element), so a few elements that cancel (a large relative error on a small value)
weigh by their small magnitude. Measured on a tiny Hugging Face Llama (tests/test_slices.py):
float32 generate against one forward, eager or SDPA, peaks at 1e-5 of the threshold per
decode position; a float32 forward against a bfloat16 generate at 0.13 of bfloat16's (the
whole at 0.03).

:func:`worst_slices` gives, for each metric a slice can be worse in than its whole
(:data:`SLICE_METRICS`: ``max_abs``, ``max_rel`` and ``equal`` of the whole already are
their worst slice's), the worst slice's value; the diff keeps them in the row as
``slice_<metric>`` (NaN for a pair not made of slices).

Examples
--------
>>> import numpy as np
>>> sums = np.array([[4.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.02, 0.1, 0.1, 0.1, 1.0]])
>>> round(worst_slices(sums, np.array([4, 1]))["slice_rel_diff"], 6)
0.01
>>> near0 = np.array([[4.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1e-6, 1e-6, 1e-8, 0.0, 0.0, 0.0, 0.0]])
>>> worst_slices(near0, np.array([4, 1]))["slice_rel_diff"] < 1e-8   # judged at the pair's scale
True
"""

from __future__ import annotations

import math

import numpy as np

SLICE_METRICS = ("rel_diff", "mean_abs", "cosine", "sqnr_db", "mismatch", "rel_diff_cast")
SLICE_COLUMNS = tuple(f"slice_{m}" for m in SLICE_METRICS)
# A slice's relative metrics (rel_diff, sqnr_db) take as its energy at least its share of the
# whole pair's (its elements' share of Σx² + Σy²): a slice of values near 0 (an MoE block's
# per-token gate, a router's score) would otherwise read its own few roundings as a large share
# of itself (a tiny Qwen2-MoE, float32 against bfloat16 with tokens=True: its
# shared_expert_gate at 1.3x bfloat16's threshold at one token on a correct run, the whole at 1%
# of it), while a slice of the usual scale keeps its own energy: a fault there is judged as
# strictly as before, however few its elements.


def worst_slices(sums: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """The worst slice's value of each metric of :data:`SLICE_METRICS`, as ``slice_<metric>``.

    Parameters
    ----------
    sums : numpy.ndarray
        ``[slices, 7]``, columns in :data:`~tdinspect.numerics.kernels.SEGMENT_SUMS` order
        (``Σx²``, ``Σy²``, ``Σ(x-y)²``, ``Σ|x-y|``, ``max|x-y|``, ``max_rel``, mismatches) of a
        pair of one float dtype whose sums are finite (the caller's check).
    counts : numpy.ndarray
        The elements of each slice.

    Returns
    -------
    dict
        ``{"slice_rel_diff": worst, ...}`` by :func:`tdinspect.numerics.metrics._from_sums`'
        formulas (worst: largest, smallest for ``cosine`` and ``sqnr_db``). A slice whose sums
        a formula cannot settle exactly (float64 sums out of range, ``Σxy`` to be summed
        directly: a slice's norms orders of magnitude apart, whose ``rel_diff`` is near 1
        anyway) is left out of that metric; NaN where none is left.
    """
    sums = floored(sums, counts)
    sxx, syy, sdd, sabs, _, _, mis = (sums[:, k] for k in range(7))
    fast = _usual(sxx, syy, sdd, sabs, mis, counts)
    if fast is not None:
        return fast
    n = np.maximum(counts.astype(np.float64), 1.0)
    with np.errstate(all="ignore"):
        denom = sxx + syy
        # float64 sums that underflowed (values near 1e-160): their ratios are not the slice's
        tiny = (np.maximum(sxx, syy) < 1e-250) & (sdd > 0)
        rel = np.where(denom > 0, sdd / denom, 0.0)
        rel[tiny] = np.nan
        root = np.sqrt(sxx) * np.sqrt(syy)
        derived = denom <= 16 * root
        cos = np.where(root > 0, np.clip((denom - sdd) / 2 / root, -1.0, 1.0), 0.0)
        cos = np.where((sxx == 0) & (syy == 0), 1.0, cos)
        cos[~derived & (root > 0)] = np.nan
        cos[tiny] = np.nan
        sqnr = np.where(
            sdd == 0, math.inf, np.where(syy > 0, 10 * (np.log10(syy) - np.log10(sdd)), -math.inf)
        )
        sqnr[tiny] = np.nan
    values = {
        "rel_diff": (rel, True),
        "mean_abs": (sabs / n, True),
        "cosine": (cos, False),
        "sqnr_db": (sqnr, False),
        "mismatch": (mis / n, True),
        "rel_diff_cast": (rel, True),  # one dtype: the cast changes nothing
    }
    out = {}
    for name, (v, higher_is_worse) in values.items():
        v = v[~np.isnan(v)]
        out[f"slice_{name}"] = math.nan if not len(v) else float(v.max() if higher_is_worse else v.min())
    return out


def _usual(sxx, syy, sdd, sabs, mis, counts) -> dict[str, float] | None:
    """:func:`worst_slices` where every slice has both norms in float64's comfortable range and
    ``Σxy`` derived exactly (the usual case), in a few whole-array steps (a call is a pair's:
    thousands a diff); ``None`` for the general steps."""
    low = min(sxx.min(), syy.min())
    if not low > 1e-250 or counts.min() <= 0:
        return None
    with np.errstate(all="ignore"):
        denom = sxx + syy
        root = np.sqrt(sxx * syy)
        if not (denom <= 16 * root).all():  # norms orders of magnitude apart somewhere
            return None
        n = counts if counts.min() != counts.max() else counts[0]
        rel = float((sdd / denom).max())
        cos = float(np.clip(((denom - sdd) / (2 * root)).min(), -1.0, 1.0))
        ratio = float((syy / sdd).min())  # inf where a slice is exact
    sqnr = math.inf if ratio == math.inf else 10 * math.log10(ratio) if ratio > 0 else -math.inf
    if np.ndim(n):
        mean_abs, mismatch = float((sabs / n).max()), float((mis / n).max())
    else:
        mean_abs, mismatch = float(sabs.max()) / n, float(mis.max()) / n
    return {
        "slice_rel_diff": rel,
        "slice_mean_abs": mean_abs,
        "slice_cosine": cos,
        "slice_sqnr_db": sqnr,
        "slice_mismatch": mismatch,
        "slice_rel_diff_cast": rel,
    }


def floored(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``sums`` (:func:`worst_slices`' layout) with each slice's ``Σx²`` and ``Σy²`` raised to
    at least its elements' share of the whole pair's, for its relative metrics (see the module's
    constants); a copy where any is raised."""
    total = counts.sum()
    if total <= 0:
        return sums
    share = counts / total
    floor_x, floor_y = share * sums[:, 0].sum(), share * sums[:, 1].sum()
    if (sums[:, 0] >= floor_x).all() and (sums[:, 1] >= floor_y).all():
        return sums
    out = sums.copy()
    out[:, 0], out[:, 1] = np.maximum(sums[:, 0], floor_x), np.maximum(sums[:, 1], floor_y)
    return out
