"""The health table of a diff: per entry its error, its share of its threshold, its growth, and
whether it is one-sided or NaN/Inf on one side.

A function of a diff's table (:meth:`tdinspect.Diff.table`) at a metric and threshold;
:meth:`tdinspect.Diff.health` is its public face, and the module tree
(:mod:`tdinspect.compare.tree`), the HTML report and the notebook views read it. Which rows
diverge is :func:`~tdinspect.compare.thresholds.divergent`, the one rule.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tdinspect.compare.growth import as_error, growth
from tdinspect.compare.rule import NONFINITE
from tdinspect.compare.thresholds import (
    Thresholds,
    allowed_rows,
    divergent,
    explained,
    never_compared,
    set_aside,
    slice_hits,
)

HEALTH_COLUMNS = [
    "rank",
    "pass",
    "order",
    "op",
    "call",
    "key",
    "value",
    "threshold",
    "share",
    "growth",
    "nonfinite",
    "one_sided",
    "structural",
    "reason",
    "diverges",
]


def one_sided(reasons) -> np.ndarray:
    """Which reasons say an entry (or its rank or pass) is on one side only."""
    return np.fromiter(
        (isinstance(r, str) and (r.startswith("only in ") or " only in " in r) for r in reasons),
        bool,
        len(reasons),
    )


def health(
    table: pd.DataFrame,
    m,
    thr_fn: Thresholds,
    allowed: list | None = None,
    diverges: np.ndarray | None = None,
) -> pd.DataFrame:
    """One row per row of ``table`` in execution order (pass, order, rank), with :data:`HEALTH_COLUMNS`.

    Parameters
    ----------
    table : pandas.DataFrame
        A diff's table (:data:`tdinspect.compare.rule.COLUMNS`).
    m : Metric
    thr_fn : Thresholds
    allowed : list of re.Pattern, optional
        ``allow_uncompared``: rows it names that are one-sided or never compared never diverge.
    diverges : numpy.ndarray of bool, optional
        Which rows of ``table`` diverge, as the diff's verdict decides them
        (:meth:`tdinspect.Diff.diverging`: its spec's ``structural`` too); by default
        :func:`~tdinspect.compare.thresholds.divergent` alone.

    Returns
    -------
    pandas.DataFrame
        ``value`` (the metric), ``threshold`` (the row's), ``share`` (the error over the
        threshold as an error: ``(1 - cosine) / (1 - threshold)`` for cosine; ``inf`` for a
        structural row and for a metric that could not be computed, NaN for a row never
        compared or named by ``allowed``), ``growth`` (the error over the largest before it in its pass,
        :meth:`tdinspect.Diff.growth`), ``nonfinite``, ``one_sided``, ``structural``,
        ``reason`` and ``diverges`` (:func:`~tdinspect.compare.thresholds.divergent`).

    Examples
    --------
    >>> diff.health().sort_values("share", ascending=False).head(3)   # doctest: +SKIP
    """
    df, diverges = _in_order(table, diverges)
    reasons = df["reason"].to_numpy(object)
    grown = growth(df, m.name, all_entries=True)[["rank", "pass", "order", "key", "growth"]]
    out = df[["rank", "pass", "order", "op", "call", "key"]].copy()
    out["value"] = np.nan
    out["threshold"] = np.nan
    out["share"] = np.nan
    out = out.merge(grown, on=["rank", "pass", "order", "key"], how="left", sort=False)
    out["nonfinite"] = [isinstance(r, str) and r.startswith(NONFINITE) for r in reasons]
    out["one_sided"] = one_sided(reasons)
    out["structural"] = df["structural"].to_numpy(bool)
    out["reason"] = reasons
    out["diverges"] = False
    _judge(out, df, m, thr_fn, allowed, diverges)
    return out[HEALTH_COLUMNS]


def rethreshold(
    rows: pd.DataFrame,
    table: pd.DataFrame,
    m,
    thr_fn: Thresholds,
    allowed: list | None = None,
    diverges: np.ndarray | None = None,
) -> pd.DataFrame:
    """:func:`health` at another threshold, from ``rows``, its result at another threshold of
    the same metric ``m`` on the same ``table``: only ``value``, ``threshold``, ``share``
    and ``diverges`` are computed again (the error's growth and the flags do not depend on
    the threshold).

    Examples
    --------
    >>> rows = health(table, m, diff.thresholds(1e-3, m.name))                   # doctest: +SKIP
    >>> rethreshold(rows, table, m, diff.thresholds(1e-5, m.name))["diverges"]   # doctest: +SKIP
    """
    df, diverges = _in_order(table, diverges)
    out = rows.copy()
    _judge(out, df, m, thr_fn, allowed, diverges)
    return out


def _in_order(table: pd.DataFrame, diverges) -> tuple[pd.DataFrame, np.ndarray | None]:
    """``table``'s rows in execution order (pass, order, rank), and ``diverges`` in that order."""
    at = np.lexsort((table["rank"].to_numpy(), table["order"].to_numpy(), table["pass"].to_numpy()))
    df = table.iloc[at].reset_index(drop=True)
    return df, None if diverges is None else np.asarray(diverges, bool)[at]


def _judge(out: pd.DataFrame, df: pd.DataFrame, m, thr_fn: Thresholds, allowed, diverges) -> None:
    """Set ``out``'s value, threshold, share and diverges columns (rows of ``df``, in its order)."""
    values = df[m.name].to_numpy(float) if len(df) else np.zeros(0)
    thr = thr_fn.of_rows(df)
    structural = df["structural"].to_numpy(bool)
    reasons = df["reason"].to_numpy(object)
    skip = explained(reasons)
    hit = divergent(m, values, thr, structural, skip) | slice_hits(df, m, thr, skip, thr_fn)
    excused = np.zeros(len(df), bool)
    if allowed:
        aside = set_aside(structural, reasons) | never_compared(structural, reasons)
        names = (df[c].to_numpy(object) for c in ("op", "key_b", "key"))
        excused = allowed_rows(allowed, *names) & aside
        hit &= ~excused
    if diverges is not None:
        hit = diverges
    error = as_error(m.name, pd.Series(values)).to_numpy(float)
    limit = as_error(m.name, pd.Series(thr)).to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(limit > 0, error / limit, np.where(error > 0, np.inf, 0.0))
    share = np.where(structural | (np.isnan(values) & ~explained(reasons)), np.inf, share)
    out["value"] = values
    # a one-sided row has no pair and no dtypes: auto's fallback threshold would mean nothing
    out["threshold"] = np.where(one_sided(reasons), np.nan, thr)
    out["share"] = np.where(excused, np.nan, share)  # one-sided by design: not compared, not the worst
    out["diverges"] = hit
