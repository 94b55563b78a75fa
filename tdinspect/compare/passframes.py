"""Compared passes kept as typed columns; a pass's DataFrame is built when it is asked for.

A pandas frame costs about 10 µs a column to build, whatever its rows: 0.25 ms
for one pass of :data:`tdinspect.compare.diff.COLUMNS`, and as much again to put
the frames of a diff end to end. So each pass's rows (dicts) become one numpy
array a column, of the dtype pandas infers from those rows; ``Diff.table``
joins the arrays of every pass and builds one frame, and a pass's own frame
is built on first access (``first_divergence``, the cube, the report).

Examples
--------
>>> frames = PassFrames()
>>> frames[0, 0] = typed_columns([{"x": 1.5, "k": "a"}], ["x", "k"])
>>> frames[(0, 0)].dtypes["x"]
dtype('float64')
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

# value types whose column pandas infers as one numpy dtype (Python's and numpy's scalars)
_KINDS = (
    (frozenset({float, np.float64}), np.float64),
    (frozenset({int, np.int64}), np.int64),
    (frozenset({bool, np.bool_}), np.bool_),
    (frozenset({str}), object),
)

Columns = dict  # column name -> numpy array, one element a row
# rows of a pass taken a column at a time at most: beyond, pandas' own loop over the rows is
# faster (one pass of 2,000 rows: 2.7 ms either way; 10^5 rows: 0.21 s here, 0.17 s pandas)
MAX_ROWS = 1024


def typed_columns(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> Columns | None:
    """``rows`` a column at a time, as the arrays ``pd.DataFrame(rows, columns=names)`` holds.

    A column of floats is float64, of ints int64, of bools bool, of strings an
    object array (pandas makes it its string dtype, as it does from rows). None
    when there are no rows or a column mixes kinds: only pandas' own inference
    from the rows then says what the column becomes; None too beyond
    :data:`MAX_ROWS` rows, where pandas' compiled loop over the rows is faster.
    """
    if not rows or len(rows) > MAX_ROWS:
        return None
    columns = {}
    for name in names:
        values = [r[name] for r in rows]
        kinds = set(map(type, values))
        dtype = next((d for k, d in _KINDS if kinds <= k), None)
        if dtype is None:
            return None
        try:
            columns[name] = np.array(values, dtype)
        except OverflowError:  # an int beyond int64: pandas makes it uint64 or object
            return None
    return columns


def frame_of(columns: Columns) -> pd.DataFrame:
    """The DataFrame of :func:`typed_columns` (no copy)."""
    return pd.DataFrame(columns, copy=False)


class PassFrames(MutableMapping):
    """``(rank, pass) -> DataFrame`` of compared passes, each stored as columns (or a frame)
    until first asked for."""

    def __init__(self) -> None:
        self._data: dict[tuple[int, int], Columns | pd.DataFrame] = {}

    def __setitem__(self, key: tuple[int, int], value: Columns | pd.DataFrame) -> None:
        """Keep a pass as :func:`typed_columns` (a frame when first asked for) or a frame."""
        self._data[key] = value

    def __getitem__(self, key: tuple[int, int]) -> pd.DataFrame:
        value = self._data[key]
        if not isinstance(value, pd.DataFrame):
            value = self._data[key] = frame_of(value)
        return value

    def __delitem__(self, key: tuple[int, int]) -> None:
        del self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def joined(self, keys: Sequence[tuple[int, int]]) -> pd.DataFrame | None:
        """The non-empty passes of ``keys`` end to end as one frame built from their columns
        (``pd.concat`` of their frames, ``ignore_index=True``, without building them). None
        when a pass with rows is held as a frame (it may have been changed since: the
        caller concatenates the frames) or no pass has rows."""
        parts = []
        for value in map(self._data.__getitem__, keys):
            if not isinstance(value, pd.DataFrame):
                parts.append(value)
            elif len(value):
                return None
        if not parts:
            return None
        return frame_of({name: np.concatenate([p[name] for p in parts]) for name in parts[0]})
