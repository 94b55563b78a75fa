"""Cubes of a diff: one entry's metric along its positions, every metric as a Dataset.

:func:`per_position` and :func:`to_xarray` are the work of
:meth:`tdinspect.Diff.per_position` and :meth:`tdinspect.Diff.to_xarray`;
:func:`call_axis` is the ``call`` axis of a cube (a DumpSet's too). xarray
is imported when a cube is built (the CLI's answers need none).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from tdinspect.compare.rule import ROW_METRICS, apply_transform
from tdinspect.naming import split_call
from tdinspect.numerics.metrics_split import compare_positions
from tdinspect.store.restore import oversized

if TYPE_CHECKING:
    import pandas as pd
    import xarray as xr


def call_axis(calls) -> tuple[np.ndarray, np.ndarray]:
    """``(the call numbers present, sorted; each of ``calls``' position among them)``: a cube's
    ``call`` axis. It was every number up to the largest: one key named ``m::call3000000``
    made a 5-entry dump's cube 1.2 GB (the number is a file's text: any size).

    Examples
    --------
    >>> numbers, where = call_axis([0, 7, 0, 3])
    >>> numbers.tolist(), where.tolist()
    ([0, 3, 7], [0, 2, 0, 1])
    """
    numbers, where = np.unique(np.asarray(calls, dtype=np.int64), return_inverse=True)
    return (numbers, where) if len(numbers) else (np.zeros(1, np.int64), where)


def per_position(
    pass_rows: Iterable[tuple[tuple[int, int], pd.DataFrame]],
    a: Any,
    b: Any,
    key: str,
    dim: int | str,
    m,
    thr_fn,
    mapping,
    chunk: int,
) -> xr.DataArray:
    """The metric ``m`` of entry ``key`` along ``dim`` for every pass, call and rank of
    ``pass_rows`` (a diff's ``iter_passes()``) where both sides (DumpSets ``a``, ``b``) hold it;
    see :meth:`tdinspect.Diff.per_position`."""
    import xarray as xr

    from tdinspect.align.concat import dim_index

    base = split_call(key)[0]
    cells, skipped = [], []
    for (rank, p), rows in pass_rows:
        for row in rows[(rows["op"] == base) & (rows["key_b"] != "")].to_dict("records"):
            pa, pb = a.get_pass(p, rank), b.get_pass(p, rank)
            i = pa.position[row["key"]]
            ya, xb = pa.tensor(row["key"]), pb.tensor(row["key_b"])
            transform = mapping.partner(base)[1] if mapping is not None else None
            if transform is not None:
                xb, why = apply_transform(transform, xb, ya)  # a failing transform: the diff's reason
                if why:
                    skipped.append(f"pass {p} call {row['call']}: {why}")
                    continue
            if ya.shape != xb.shape:
                skipped.append(f"pass {p} call {row['call']}: shape {list(ya.shape)} vs {list(xb.shape)}")
                continue
            d = dim_index(dim, pa.dims[i], ya.dim(), row["key"])
            big = oversized(ya) or oversized(xb)
            if big or ya.numel() == 0:
                skipped.append(
                    f"pass {p} call {row['call']}: " + (big or f"no elements (shape {list(ya.shape)})")
                )
                continue
            # positions first, once: each slice is then contiguous, in the same element order
            ya, xb = ya.movedim(d, 0).contiguous(), xb.movedim(d, 0).contiguous()
            values = compare_positions(xb, ya, m.name, chunk=chunk).tolist()
            cells.append(
                (
                    rank,
                    p,
                    int(row["call"]),
                    values,
                    thr_fn.lookup(base, row["dtype_a"], row["dtype_b"], row.get("upstream", "") or ""),
                )
            )
    if not cells:
        raise KeyError(
            f"{key!r}: no pass where both sides hold it with one shape"
            + (f" ({'; '.join(skipped[:3])})" if skipped else "")
        )
    ranks = sorted({c[0] for c in cells})
    passes = sorted({c[1] for c in cells})
    calls, call_ix = call_axis([c[2] for c in cells])
    npos = max(len(c[3]) for c in cells)
    data = np.full((len(ranks), len(passes), len(calls), npos), np.nan)
    thrs = np.full((len(ranks), len(passes), len(calls), 1), np.nan)
    for (rank, p, _, values, (t, _)), c in zip(cells, call_ix):
        data[ranks.index(rank), passes.index(p), c, : len(values)] = values
        thrs[ranks.index(rank), passes.index(p), c] = t
    with np.errstate(invalid="ignore"):
        over = data > thrs if m.higher_is_worse else data < thrs
    thr, source = cells[0][4]
    hit = np.flatnonzero(over.any(axis=(0, 1, 2)))
    da = xr.DataArray(
        data,
        dims=("rank", "pass", "call", "position"),
        coords={"rank": ranks, "pass": passes, "call": calls, "position": np.arange(npos)},
        name=m.name,
        attrs={
            "key": base,
            "dim": str(dim),
            "metric": m.name,
            "threshold": thr,
            "threshold_source": source,
            "first_position": int(hit[0]) if len(hit) else -1,
        },
    )
    return da.isel(rank=0, drop=True) if len(ranks) == 1 else da


def to_xarray(df: pd.DataFrame, attrs: dict[str, Any]) -> xr.Dataset:
    """A diff's table (:meth:`tdinspect.Diff.table`) as a Dataset with dims ``op``, ``call``,
    ``pass`` (``rank`` first when several): each metric, ``order``, ``reason`` and the dtypes;
    ``attrs`` its attributes."""
    ops = list(dict.fromkeys(df["op"]))
    ranks = sorted(df["rank"].unique().tolist()) or [0]
    passes = sorted(df["pass"].unique().tolist())
    calls, call_ix = call_axis(df["call"].to_numpy())
    shape = (len(ranks), len(ops), len(calls), len(passes))
    ix = (
        df["rank"].map({r: i for i, r in enumerate(ranks)}).to_numpy(),
        df["op"].map({o: i for i, o in enumerate(ops)}).to_numpy(),
        call_ix,
        df["pass"].map({p: i for i, p in enumerate(passes)}).to_numpy(),
    )
    dims = ("rank", "op", "call", "pass")
    variables = {}
    for name in (*ROW_METRICS, "order"):
        arr = np.full(shape, np.nan)
        arr[ix] = df[name].to_numpy(dtype=float)
        variables[name] = (dims, arr)
    for name in ("reason", "dtype_a", "dtype_b"):
        arr = np.full(shape, "", dtype=object)
        arr[ix] = df[name].to_numpy(dtype=object)
        variables[name] = (dims, arr)
    import xarray as xr  # lazily: the CLI's answers need no cube (0.26 s)

    ds = xr.Dataset(
        variables,
        coords={"rank": ranks, "op": ops, "call": calls, "pass": passes},
        attrs=attrs,
    )
    return ds.isel(rank=0, drop=True) if len(ranks) == 1 else ds
