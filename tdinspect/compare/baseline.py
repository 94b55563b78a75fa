"""An error budget from a baseline run: B diverges where its error exceeds k times the baseline's.

A numerical analyst judges a port with three runs: a float64 reference A, the trusted
implementation C in the working precision (the baseline), and the candidate B. C's error
against A at each entry is the rounding noise of that entry; B is wrong where its error
against A exceeds a small multiple of it. A correct port's noise sits within about 1x of the
baseline's, so no hand-picked threshold is needed, and a fault far above the noise but below
the dtype's ``"auto"`` rule (an RMSNorm eps of 1e-5 for 1e-6 in float32: ``rel_diff`` 5e-10
against ``"auto"`` 1.5e-8) is found.

:class:`Budget` gives each row of a diff its threshold, ``max(k · baseline, floor)``, where
``baseline`` is the baseline's metric against A at the same A entry (C pairs with A by name,
whatever mapping pairs B). Rows the baseline lacks are judged by the ``"auto"`` rule and reported
(:meth:`Budget.lacking`), never passed silently.

**The floor** is for entries where the baseline makes no error (a lookup of exact weights, a
norm computed in float32 on both sides, a baseline bitwise equal to A): there ``k · 0`` would make
every last-bit difference of B a divergence. It is ``k`` times the *least error the baseline makes
anywhere in the pass at the entry's precision* (the noise a computation in that precision makes
where it makes any), never more than :data:`FLOOR_UNITS` units of roundoff of the coarser dtype
(:func:`tdinspect.numerics.metrics.roundoff_floor`), the floor of a baseline exact everywhere,
and never less than :data:`LEAST_UNITS` unit (``rel_diff`` ½u²: a relative L2 error of ``u``,
what about six independent roundings of every element add up to, at 0.08 u² each; a baseline whose
least error is one element's last bit would otherwise leave a budget that B computing the entry in
another order cannot meet). Where the baseline's error is not 0
the floor is at most ``k`` times it, or one unit: the budget is the baseline's, never the floor's.

Measured on the tiny Llama of :mod:`tdinspect.examples.port` (``initializer_range=0.1``) against
its float64 copy (``rel_diff``; one rounding of a tensor reads about 0.08 u²)::

    baseline C    u²        its errors                    least error         8 units: ½(8u)²
    float32       3.6e-15   0, then 4.3e-15 .. 6.5e-14     4.3e-15 (1.2 u²)    1.1e-13 (32 u²)
                            (1.2 .. 18 u²)
    bfloat16      1.5e-5    4.4e-7 .. 5.3e-5               4.4e-7 (0.03 u²,    4.9e-4 (32 u²)
                            (0.03 .. 3.5 u²)               the rotary cosine)

Eight units whatever the baseline (the rule before) sat 9x to 1,100x over bfloat16's errors, over
``k = 10`` times the baseline at every entry but the last ``down_proj``: the budget was the floor
alone (half the ``"auto"`` threshold), and a fault 12x the baseline's error at
``layers.1.mlp.up_proj`` was missed (issue 35 case 10). In float32 it swamped ``10x`` the baseline
at the first projections too. Correct bfloat16 variants stay within 1.6x of the baseline at every
entry (eager attention for SDPA 1.18x, matmuls split in two halves of K 1.51x, the port with fused
projections 1.12x), well inside ``k``. A float32 run against a baseline bitwise equal to the
float64 reference (no error above 0) keeps the 8 units: its own errors reach 18 u².

Examples
--------
>>> d = DumpSet.open("ref_fp64").diff("port_fp32", mapping=rules, baseline="ref_fp32")  # doctest: +SKIP
>>> d.first_divergence().reason                                                         # doctest: +SKIP
"rel_diff 5.49e-10, 25,637x the baseline's 2.14e-14 (budget 10x)"
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import pandas as pd

from tdinspect.compare.thresholds import Thresholds
from tdinspect.numerics.metrics import AUTO, dtype_named, roundoff_floor, unit_roundoff
from tdinspect.util.terminal import visible

FACTOR = 10.0  # k: how many times the baseline's error B may make
FLOOR_UNITS = 8  # the floor at most: units of roundoff of the coarser dtype (float32 rel_diff 1.1e-13)
LEAST_UNITS = 1  # ...and at least (bfloat16 rel_diff 7.6e-6): a few roundings of every element
LACKING = "no baseline entry"


def check_factor(factor) -> float:
    """``baseline_factor`` as a float: a finite number of at least 1 (the baseline's own noise
    passes its budget)."""
    try:
        if isinstance(factor, bool):  # float(True) is 1.0
            raise TypeError
        out = float(factor)
    except (TypeError, ValueError, OverflowError):  # OverflowError: 10**400
        shown = repr(factor) if len(repr(factor)) <= 40 else repr(factor)[:37] + "..."
        raise ValueError(f"baseline_factor: expected a number, got {shown}") from None
    if not (math.isfinite(out) and out >= 1):
        raise ValueError(f"baseline_factor={factor!r}: expected a finite number of at least 1")
    return out


def ratio_text(ratio: float) -> str:
    """``3,750x``, ``12.5x``: thousands separated, three significant digits below 100."""
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x"


class Budget(Thresholds):
    """Thresholds from a baseline diff (A against the baseline C), for one metric.

    Parameters
    ----------
    base : Diff
        A against the baseline, paired by name: its rows give each A entry's baseline error.
    metric_name : str
        An error metric (:func:`tdinspect.numerics.metrics.roundoff_floor` lists them).
    factor : float
        ``k`` (default :data:`FACTOR`).

    Examples
    --------
    >>> budget = Budget(DumpSet.open("ref64").diff("ref32"), "rel_diff")   # doctest: +SKIP
    >>> budget.given()                                                     # doctest: +SKIP
    'baseline 10x'
    """

    # a slice's error is not the whole's: the budget, set by the baseline's error over the
    # whole entry, is not a rule for slices (numerics/slices.py); only the whole is judged
    per_slice = False

    def __init__(self, base: Any, metric_name: str, factor: float = FACTOR):
        super().__init__(AUTO, metric_name)  # the rule of entries the baseline lacks
        roundoff_floor(self.metric.name, "", "")  # a metric that is not an error: ValueError
        self.base = base
        self.factor = check_factor(factor)
        self._values: dict[tuple[int, int], dict[str, float]] = {}
        self._least: dict[tuple[int, int], dict[float, tuple[float, str]]] = {}

    def baseline_values(self, rank: int, pass_: int) -> dict[str, float]:
        """``{A key: the baseline's metric}`` of one (rank, pass): entries compared in numbers."""
        k = (int(rank), int(pass_))
        if k not in self._values:
            rows = self.base.pass_rows(*k)
            values: dict[str, float] = {}
            least: dict[float, tuple[float, str]] = {}
            if rows is not None and len(rows):
                ok = ~rows["structural"].to_numpy(bool) & (rows["reason"].to_numpy(object) == "")
                vals = rows[self.metric.name].to_numpy(float)
                dtypes = zip(rows["dtype_a"].to_numpy(object), rows["dtype_b"].to_numpy(object))
                for key, v, good, (da, db) in zip(rows["key"], vals, ok, dtypes):
                    if not good or math.isnan(v):
                        continue
                    values[key] = v
                    u = _unit(da, db)
                    if v > 0 and u and (u not in least or v < least[u][0]):
                        least[u] = (v, key)
            self._values[k] = values
            self._least[k] = least
        return self._values[k]

    def least_error(self, rank: int, pass_: int, dtype_a, dtype_b) -> tuple[float, str] | None:
        """``(value, A key)``: the baseline's least error above 0 in one (rank, pass) among
        entries of the same coarser dtype as ``dtype_a``/``dtype_b``; ``None`` where it has none
        (exact everywhere, or no entry at that precision)."""
        self.baseline_values(rank, pass_)
        return self._least[(int(rank), int(pass_))].get(_unit(dtype_a, dtype_b))

    def baseline_of(self, row) -> float:
        """The baseline's metric at ``row``'s A entry (NaN when the baseline lacks it)."""
        return self.baseline_values(row["rank"], row["pass"]).get(row["key"], math.nan)

    def floor(self, row) -> float:
        """The least budget of ``row``: ``k`` times the baseline's least error at its precision,
        at most :data:`FLOOR_UNITS` units of roundoff (see the module docstring)."""
        return self._floor(
            row["rank"], row["pass"], row.get("dtype_a", "") or "", row.get("dtype_b", "") or ""
        )

    def _floor(self, rank: int, pass_: int, dtype_a, dtype_b) -> float:
        return self._floor_of(rank, pass_, dtype_a, dtype_b)[0]

    def _floor_of(self, rank: int, pass_: int, dtype_a, dtype_b) -> tuple[float, str, tuple | None]:
        """``(floor, which, least)``: which bound set it (``"most"``, ``"one"`` or ``"least"``)
        and the baseline's least error ``(value, key)``."""
        most = roundoff_floor(self.metric.name, dtype_a, dtype_b, FLOOR_UNITS)
        least = self.least_error(rank, pass_, dtype_a, dtype_b)
        if least is None or most <= self.factor * least[0]:
            return most, "most", least
        one = roundoff_floor(self.metric.name, dtype_a, dtype_b, LEAST_UNITS)
        if self.factor * least[0] < one:
            return one, "one", least
        return self.factor * least[0], "least", least

    def _floor_text(self, row) -> str:
        """What the floor of ``row`` is, in words."""
        da, db = row.get("dtype_a", "") or "", row.get("dtype_b", "") or ""
        _, which, least = self._floor_of(row["rank"], row["pass"], da, db)
        if which == "most":
            return f"{FLOOR_UNITS} units of {_coarser(row)} roundoff"
        if which == "one":
            return f"{LEAST_UNITS} unit of {_coarser(row)} roundoff"
        value, key = least
        return f"{self.factor:g}x the baseline's least {_coarser(row)} error {value:.3g} ({visible(key)})"

    def __call__(self, row) -> float:
        base = self.baseline_of(row)
        if math.isnan(base):
            return super().__call__(row)
        return max(self.factor * base, self.floor(row))

    def source(self, row) -> str:
        return "baseline" if not math.isnan(self.baseline_of(row)) else super().source(row)

    def of_rows(self, rows: pd.DataFrame) -> np.ndarray:
        n = len(rows)
        if not n:
            return np.zeros(0)
        base = self._base_column(rows)
        auto = super().of_rows(rows)
        floors = np.fromiter(
            (
                self._floor(r, p, a or "", b or "")
                for r, p, a, b in zip(
                    rows["rank"].to_numpy(),
                    rows["pass"].to_numpy(),
                    rows["dtype_a"].to_numpy(object),
                    rows["dtype_b"].to_numpy(object),
                )
            ),
            float,
            n,
        )
        return np.where(np.isnan(base), auto, np.maximum(self.factor * base, floors))

    def _base_column(self, rows: pd.DataFrame) -> np.ndarray:
        out = np.full(len(rows), math.nan)
        ranks, passes = rows["rank"].to_numpy(), rows["pass"].to_numpy()
        keys = rows["key"].to_numpy(object)
        for rank, p in dict.fromkeys(zip(ranks.tolist(), passes.tolist())):
            at = np.flatnonzero((ranks == rank) & (passes == p))
            values = self.baseline_values(rank, p)
            out[at] = [values.get(k, math.nan) for k in keys[at]]
        return out

    def lacking(self, rows: pd.DataFrame) -> np.ndarray:
        """Rows compared in numbers whose A entry the baseline lacks (judged by ``"auto"``)."""
        compared = ~rows["structural"].to_numpy(bool) & (rows["reason"].to_numpy(object) == "")
        return compared & np.isnan(self._base_column(rows))

    def explain(self, row, value: float) -> str | None:
        """The reason of a divergent row: ``rel_diff 5.49e-10, 25,637x the baseline's 2.14e-14
        (budget 10x)``, or over the roundoff floor, or under ``"auto"`` without a baseline entry."""
        name = self.metric.name
        base = self.baseline_of(row)
        if math.isnan(base):
            thr, source = self.lookup(*self._args(row))
            return f"{name} {value:.3g} > {thr:.3g} ({source}; {LACKING})"
        floor = self.floor(row)
        units = self._floor_text(row)
        if base == 0:
            return f"{name} {value:.3g} > {floor:.3g}, {units} (the baseline's error is 0)"
        least = f", at least {floor:.3g}: {units}" if floor > self.factor * base else ""
        return (
            f"{name} {value:.3g}, {ratio_text(value / base)} the baseline's {base:.3g} "
            f"(budget {self.factor:g}x{least})"
        )

    def given(self) -> str:
        return f"baseline {self.factor:g}x"

    def describe(self, rows: pd.DataFrame | None = None) -> str:
        return (
            f"{self.factor:g}x the baseline's {self.metric.name} against A ({self.base.b.path}), "
            f"at least {self.factor:g}x its least error at the entry's precision ({LEAST_UNITS} to "
            f"{FLOOR_UNITS} units of roundoff of the coarser dtype); auto where the baseline lacks an entry"
        )


@functools.lru_cache(maxsize=256)
def _unit(dtype_a, dtype_b) -> float | None:
    """The unit roundoff of the coarser of two dtypes; ``None`` when either is unknown."""
    ua, ub = unit_roundoff(dtype_a or ""), unit_roundoff(dtype_b or "")
    return None if ua is None or ub is None else max(ua, ub)


def _coarser(row) -> str:
    """The name of the coarser of ``row``'s two dtypes (``float32``)."""
    dtypes = [d for d in (row.get("dtype_a", ""), row.get("dtype_b", "")) if unit_roundoff(d)]
    if not dtypes:
        return "its dtype's"
    return str(dtype_named(max(dtypes, key=unit_roundoff))).removeprefix("torch.")
