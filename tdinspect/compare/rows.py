"""Entries paired row by row along a checksum dim: batch invariance from fingerprints.

``capture(checksum=True, checksum_dim=d)`` stores one fingerprint per index along ``d``
(:func:`tdinspect.numerics.checksum.row_checksums`; the sidecar's ``checksum_rows``). Two entries
whose shapes differ only in ``d`` (a batch of 4 against a batch of 1) are then not a structural
mismatch: their first ``min(n_a, n_b)`` rows are compared, bitwise from the fingerprints alone
(statistics-only dumps, ``metric="equal"``), or in numbers from the tensors' rows.

Examples
--------
>>> rows = {"dim": 0, "rows": ["00000000000000aa"] * 4}
>>> paired_rows([4, 8], [1, 8], rows, {"dim": 0, "rows": ["00000000000000aa"]})
(0, 1)
>>> paired_rows([4, 8], [4, 8], rows, rows) is None   # same shapes: compared whole
True
"""

from __future__ import annotations

from typing import Any


def paired_rows(shape_a, shape_b, rows_a: Any, rows_b: Any) -> tuple[int, int] | None:
    """``(dim, rows compared)`` when both sides hold row fingerprints along one dim and their
    shapes differ in that dim only; ``None`` otherwise (compared as usual)."""
    if not (isinstance(rows_a, dict) and isinstance(rows_b, dict)) or rows_a["dim"] != rows_b["dim"]:
        return None
    if shape_a is None or shape_b is None or len(shape_a) != len(shape_b):
        return None
    d = rows_a["dim"]
    if d >= len(shape_a) or list(shape_a) == list(shape_b):
        return None
    if any(x != y for i, (x, y) in enumerate(zip(shape_a, shape_b)) if i != d):
        return None
    n = min(shape_a[d], shape_b[d])
    if len(rows_a["rows"]) < n or len(rows_b["rows"]) < n:
        return None
    return d, n


def differing_rows(rows_a: dict, rows_b: dict, n: int) -> list[int]:
    """The indices among the first ``n`` rows whose fingerprints differ."""
    return [i for i, (x, y) in enumerate(zip(rows_a["rows"][:n], rows_b["rows"][:n])) if x != y]


def rows_text(shape_a, shape_b, rows_a: Any, rows_b: Any) -> str:
    """What a row-paired entry's answer adds (``""`` for others): ``; not batch-invariant:
    row 0 of dim 0 differs in its bits (1 row compared, 4 vs 1)``."""
    paired = paired_rows(shape_a, shape_b, rows_a, rows_b)
    if paired is None:
        return _same_shape_rows(shape_a, shape_b, rows_a, rows_b)
    d, n = paired
    bad = differing_rows(rows_a, rows_b, n)
    sizes = f"{n} {'row' if n == 1 else 'rows'} compared, {shape_a[d]} vs {shape_b[d]}"
    if not bad:
        return f"; rows along dim {d} hold the same bits ({sizes})"
    verb = "differs in its" if len(bad) == 1 else "differ in their"
    return f"; not batch-invariant: {_rows_named(bad, d)} {verb} bits ({sizes})"


def _rows_named(bad: list[int], d: int) -> str:
    """``row 3 of dim 0``, ``rows 1, 2 of dim 0`` (the first five, then ``...``)."""
    shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
    return f"{'row' if len(bad) == 1 else 'rows'} {shown} of dim {d}"


def _same_shape_rows(shape_a, shape_b, rows_a: Any, rows_b: Any) -> str:
    """For entries of one shape that both hold row fingerprints along one dim: which rows differ
    in their bits (every slice named, not only the whole entry: ``; in row 1 of dim 0 (its
    bits differ; 2 rows)``), ``""`` otherwise."""
    if not (isinstance(rows_a, dict) and isinstance(rows_b, dict)) or rows_a["dim"] != rows_b["dim"]:
        return ""
    if shape_a is None or list(shape_a) != list(shape_b or []) or rows_a["dim"] >= len(shape_a):
        return ""
    d = rows_a["dim"]
    n = shape_a[d]
    if len(rows_a["rows"]) != n or len(rows_b["rows"]) != n:
        return ""
    bad = differing_rows(rows_a, rows_b, n)
    if not bad or len(bad) == n:
        return ""  # every row: the whole entry says it
    return f"; in {_rows_named(bad, d)} ({'its' if len(bad) == 1 else 'their'} bits differ; {n} rows)"
