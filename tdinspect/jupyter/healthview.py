"""The health table widget: one row per entry (its share of its threshold, metric value, growth,
NaN/Inf and one-sided marks), with a name filter and a sort; picking a row shows that entry.

Rows come from :func:`tdinspect.compare.entries.health` (what :meth:`tdinspect.Diff.health`
gives); the widget is an ``ipywidgets.Select``, so it needs no script of its own.

Examples
--------
>>> ex = tdinspect.explore(diff)           # doctest: +SKIP
>>> ex.overview.table.filter.value = "mlp"  # doctest: +SKIP
>>> ex.overview.table.sort.value = "share"  # doctest: +SKIP
"""

from __future__ import annotations

import math
import re

import ipywidgets as W

from tdinspect.jupyter.plots import value_text
from tdinspect.report import share_text
from tdinspect.util.terminal import html_text, visible

# a monospace list, so that the columns of the rows line up (CSS only)
MONO_CSS = (
    "<style>.tdi-mono select, .tdi-mono option, .tdi-mono-head"
    "{font-family:var(--jp-code-font-family,monospace);font-size:12px;white-space:pre}</style>"
)
SORTS = [
    ("execution order", "order"),
    ("share of threshold (worst first)", "share"),
    ("growth (largest first)", "growth"),
    ("name", "key"),
]
HEADER = "  share        value    growth  !   pass  entry"


def _flags(nonfinite: bool, one: bool, structural: bool) -> str:
    """``N`` NaN/Inf on one side, ``1`` one side only, ``S`` another structural problem."""
    return (
        ("N" if nonfinite else "")
        + ("1" if one else "")
        + ("S" if structural and not (nonfinite or one) else "")
    )


def row_label(metric_name: str, r: dict) -> str:
    """One row's text: divergence mark, share, value, growth, flags, pass (and rank), name."""
    g = r["growth"]
    # no error (identical): no growth to speak of
    grown = "-" if g != g or r["share"] == 0 else ("first" if math.isinf(g) else f"{g:.3g}x")
    value = "-" if r["structural"] else value_text(metric_name, r["value"])
    where = f"p{r['pass']}" + (f"r{r['rank']}" if r["rank"] else "")
    mark = "⚠" if r["diverges"] else " "
    flags = _flags(r["nonfinite"], r["one_sided"], r["structural"])
    return visible(
        f"{mark} {share_text(r['share']):>10} {value:>12} {grown:>9} {flags:<3} {where:>5}  {r['key']}"
    )


class HealthTable:
    """The health table of a diff at the explorer's metric and threshold.

    Attributes
    ----------
    rows : ipywidgets.Select
        One option per shown row, its value ``(key, pass, rank)``; ``⚠`` marks the divergent.
    filter : ipywidgets.Text
        A regex on names (applied on Enter or when the box loses focus: no redraw per key).
    sort : ipywidgets.Dropdown
        ``"order"`` (execution), ``"share"``, ``"growth"`` or ``"key"``.
    count : ipywidgets.HTML
    widget : ipywidgets.VBox
    on_pick : callable or None
        Called with ``(key, pass, rank)`` when a person picks a row.
    """

    def __init__(self, rows: int = 16):
        self.filter = W.Text(
            description="filter",
            placeholder="regex on names",
            continuous_update=False,
            layout=W.Layout(width="260px"),
        )
        self.sort = W.Dropdown(
            options=SORTS, value="order", description="sort", layout=W.Layout(width="300px")
        )
        self.rows = W.Select(rows=rows, layout=W.Layout(width="100%"))
        self.rows.add_class("tdi-mono")
        self.count = W.HTML()
        head = W.HTML(f"{MONO_CSS}<div class='tdi-mono-head'>{html_text(HEADER)}</div>")
        self.widget = W.VBox([W.HBox([self.filter, self.sort]), self.count, head, self.rows])
        self.on_pick = None
        self._health = None
        self._labels: list[str] = []
        self._values: list[tuple] = []
        self._selected: tuple | None = None
        self._quiet = False
        self.filter.observe(lambda _: self._show(), names="value")
        self.sort.observe(lambda _: self._show(), names="value")
        self.rows.observe(self._on_row, names="value")

    def set_health(self, health, metric_name: str) -> None:
        """Show ``health`` (a :meth:`tdinspect.Diff.health` frame) at ``metric_name``."""
        self._health = health
        cols = ["key", "pass", "rank", "value", "share", "growth", "nonfinite", "one_sided", "structural"]
        cols.append("diverges")
        records = [dict(zip(cols, row)) for row in zip(*(health[c].tolist() for c in cols))]
        self._labels = [row_label(metric_name, r) for r in records]
        self._values = [(r["key"], int(r["pass"]), int(r["rank"])) for r in records]
        self._show()

    def shown(self) -> list[int]:
        """Positions (in the health frame) of the rows shown, in their shown order (every row
        while the filter is not a valid regex)."""
        df = self._health
        if df is None:
            return []
        try:
            pattern = re.compile(self.filter.value) if self.filter.value else None
        except re.error:
            pattern = None
        keep = [i for i, k in enumerate(df["key"].tolist()) if pattern is None or pattern.search(k)]
        by = self.sort.value
        if by == "order":
            return keep
        if by == "key":
            return sorted(keep, key=lambda i: self._values[i])
        col = df[by].tolist()
        # worst first (inf: structural or a first error), rows without a number last
        return sorted(keep, key=lambda i: (col[i] != col[i], -col[i] if col[i] == col[i] else 0.0))

    def _show(self) -> None:
        order = self.shown()
        options = [(self._labels[i], self._values[i]) for i in order]
        try:
            re.compile(self.filter.value)
            bad = int(self._health["diverges"].sum()) if self._health is not None else 0
            self.count.value = (
                f"<small>{bad} diverging &middot; showing {len(options)} of {len(self._values)} "
                "(&#9888; diverges; N NaN/Inf on one side; 1 one side only; S structural)</small>"
            )
        except re.error as exc:
            self.count.value = f"invalid regex {html_text(repr(self.filter.value))}: {html_text(exc)}"
        self._quiet = True
        try:
            if list(self.rows.options) != options:
                self.rows.options = options
            self.rows.value = self._selected if self._selected in {v for _, v in options} else None
        finally:
            self._quiet = False

    def select(self, at: tuple | None) -> None:
        """Highlight the row ``(key, pass, rank)`` (the entry the view shows), when it is shown."""
        self._selected = at
        self._quiet = True
        try:
            if at in self._values and any(v == at for _, v in self.rows.options):
                self.rows.value = at
            else:
                self.rows.value = None
        finally:
            self._quiet = False

    def _on_row(self, change) -> None:
        if self._quiet or change["new"] is None:
            return
        self._selected = change["new"]
        if self.on_pick is not None:
            self.on_pick(*change["new"])
