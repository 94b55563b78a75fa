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
whatever mapping pairs B), and ``floor`` a few units of roundoff of the row's coarser dtype
(:func:`tdinspect.numerics.metrics.roundoff_floor`). Rows the baseline lacks are judged by the
``"auto"`` rule and reported (:meth:`Budget.lacking`), never passed silently.

Examples
--------
>>> d = DumpSet.open("ref_fp64").diff("port_fp32", mapping=rules, baseline="ref_fp32")  # doctest: +SKIP
>>> d.first_divergence().reason                                                         # doctest: +SKIP
"rel_diff 5.49e-10, 25,637x the baseline's 2.14e-14 (budget 10x)"
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from tdinspect.compare.thresholds import Thresholds
from tdinspect.numerics.metrics import AUTO, dtype_named, roundoff_floor, unit_roundoff

FACTOR = 10.0  # k: how many times the baseline's error B may make
FLOOR_UNITS = 8  # the floor: this many units of roundoff of the coarser dtype (float32 rel_diff 1.1e-13)
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

    def __init__(self, base: Any, metric_name: str, factor: float = FACTOR):
        super().__init__(AUTO, metric_name)  # the rule of entries the baseline lacks
        roundoff_floor(self.metric.name, "", "")  # a metric that is not an error: ValueError
        self.base = base
        self.factor = check_factor(factor)
        self._values: dict[tuple[int, int], dict[str, float]] = {}

    def baseline_values(self, rank: int, pass_: int) -> dict[str, float]:
        """``{A key: the baseline's metric}`` of one (rank, pass): entries compared in numbers."""
        k = (int(rank), int(pass_))
        if k not in self._values:
            rows = self.base.pass_rows(*k)
            values: dict[str, float] = {}
            if rows is not None and len(rows):
                ok = ~rows["structural"].to_numpy(bool) & (rows["reason"].to_numpy(object) == "")
                vals = rows[self.metric.name].to_numpy(float)
                values = {key: v for key, v, good in zip(rows["key"], vals, ok) if good and not math.isnan(v)}
            self._values[k] = values
        return self._values[k]

    def baseline_of(self, row) -> float:
        """The baseline's metric at ``row``'s A entry (NaN when the baseline lacks it)."""
        return self.baseline_values(row["rank"], row["pass"]).get(row["key"], math.nan)

    def floor(self, row) -> float:
        return roundoff_floor(
            self.metric.name, row.get("dtype_a", "") or "", row.get("dtype_b", "") or "", FLOOR_UNITS
        )

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
                roundoff_floor(self.metric.name, a or "", b or "", FLOOR_UNITS)
                for a, b in zip(rows["dtype_a"].to_numpy(object), rows["dtype_b"].to_numpy(object))
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
        units = f"{FLOOR_UNITS} units of {_coarser(row)} roundoff"
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
            f"at least {FLOOR_UNITS} units of roundoff of the coarser dtype; auto where the "
            f"baseline lacks an entry"
        )


def _coarser(row) -> str:
    """The name of the coarser of ``row``'s two dtypes (``float32``)."""
    dtypes = [d for d in (row.get("dtype_a", ""), row.get("dtype_b", "")) if unit_roundoff(d)]
    if not dtypes:
        return "its dtype's"
    return str(dtype_named(max(dtypes, key=unit_roundoff))).removeprefix("torch.")
