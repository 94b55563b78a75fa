"""Where error is made: each entry's error against the largest before it, the entry closest
to its threshold, and modules ranked by the error they make themselves.

Functions of a diff's table (:meth:`tdinspect.Diff.table`); :meth:`~tdinspect.Diff.growth`,
:meth:`~tdinspect.Diff.nearest` and :meth:`~tdinspect.Diff.introduced` are their
public face.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from tdinspect.compare.thresholds import Thresholds, digits_apart
from tdinspect.naming import parse_key


def growth(table: pd.DataFrame, metric_name: str, all_entries: bool = False) -> pd.DataFrame:
    """The rows of ``table`` that add error (all with ``all_entries``): ``rank``, ``pass``,
    ``order``, ``key``, ``error``, ``prev_max``, ``growth``, ``added`` (see :meth:`tdinspect.Diff.growth`)."""
    df = _with_growth(table, metric_name)
    if not all_entries:
        df = df[df["added"] > 0].reset_index(drop=True)
    return df[["rank", "pass", "order", "key", "error", "prev_max", "growth", "added"]]


def nearest(table: pd.DataFrame, m, thr_fn: Thresholds, where: Callable[[int, int], str]) -> dict | None:
    """The row of ``table`` with the largest share of its threshold, as
    :meth:`tdinspect.Diff.nearest` says it; ``where(pass, rank)`` names its place."""
    df = _with_growth(table, m.name)
    df = df[~df["structural"].astype(bool)].reset_index(drop=True)
    if df.empty:
        return None
    df["threshold"] = thr_fn.of_rows(df)
    limit = as_error(m.name, df["threshold"])
    share = (df["error"] / limit.where(limit > 0)).replace([np.inf, -np.inf], np.nan)
    if not (share > 0).any():
        return None
    row = df.loc[share.idxmax()]
    grown = float(row["growth"]) if row["prev_max"] > 0 else None
    value, thr, part = float(row[m.name]), float(row["threshold"]), float(share.max())
    q = digits_apart(value, thr)  # cosine 0.99998 against 0.999, never "1"
    text = (
        f"{row['key']} ({where(row['pass'], row['rank'])}): {m.name} "
        f"{value:.{q}g}, {part * 100:.2g}% of its threshold {thr:.{q}g}; "
        + (
            f"{grown:.3g}x the largest error before it in its pass"
            if grown
            else "the first error of its pass"
        )
    )
    return {
        "key": row["key"],
        "pass": int(row["pass"]),
        "rank": int(row["rank"]),
        "call": int(row["call"]),
        "value": value,
        "threshold": thr,
        "share": part,
        "growth": grown,
        "text": text,
    }


def introduced(table: pd.DataFrame, m, reference: Any) -> pd.DataFrame:
    """Modules ranked by their worst output error in ``table`` (see :meth:`tdinspect.Diff.introduced`);
    ``reference``: the reference DumpSet (the kind of each entry: outputs only)."""
    df = table
    passes = reference.pass_map
    kinds = []
    for rank, p, key in zip(df["rank"], df["pass"], df["key"]):
        pi = passes.get((rank, p))
        i = pi.position.get(key) if pi is not None else None
        kinds.append(pi.kind[i] if i is not None and pi.kind else None)
    df = df[[k in (None, "output") for k in kinds]].copy()
    df["error"] = as_error(m.name, df[m.name]).where(~df["structural"].astype(bool), np.inf)
    df["module"] = [_module_of(op) for op in df["op"]]
    df = df.sort_values("error", ascending=False, na_position="last", kind="stable")
    worst = df.drop_duplicates("module")
    return worst[["module", "error", "key", "pass", "call", "reason"]].reset_index(drop=True)


def as_error(name: str, values: pd.Series) -> pd.Series:
    """A metric as an error, larger is worse (``cosine``, ``sqnr_db`` and ``equal`` turned)."""
    v = values.astype(float)
    if name in ("cosine", "equal"):
        return 1 - v
    if name == "sqnr_db":
        return 10 ** (-v / 10)
    return v


def _with_growth(table: pd.DataFrame, metric_name: str) -> pd.DataFrame:
    """``table`` in execution order with ``error`` (the metric as an error), ``prev_max`` (the
    largest error before it in its rank's pass), ``growth`` (their ratio; ``inf`` for a
    pass's first error, 1 with no error) and ``added`` (their difference).

    A row without an error (one side only, another shape, never compared: NaN) takes no
    part: it neither resets nor raises the running maximum, and its ``growth`` and ``added``
    are NaN (never listed, never ranked)."""
    df = table.sort_values(["rank", "pass", "order"]).reset_index(drop=True)
    df["error"] = err = as_error(metric_name, df[metric_name])
    passes = [df["rank"], df["pass"]]
    # cummax leaves NaN at a row without an error: carry the maximum over it, so that the
    # row after a one-sided entry is not measured against 0 (growth inf)
    running = err.groupby(passes).cummax().groupby(passes).ffill()
    prev = running.groupby(passes).shift(1).fillna(0.0)
    df["prev_max"] = prev
    grown = np.where(prev > 0, err / prev.where(prev > 0, 1.0), np.where(err > 0, np.inf, 1.0))
    df["growth"] = np.where(err.isna(), np.nan, grown)
    df["added"] = err - prev
    return df


def _module_of(op: str) -> str:
    try:
        return parse_key(op).module
    except ValueError:
        return op
