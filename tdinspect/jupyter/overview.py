"""The model's shape beside an explorer: its module tree and health table, linked both ways.

Both read one health frame (:func:`tdinspect.compare.entries.health`) of the explorer's table
at its metric and threshold, recomputed once per change the explorer acts on. Picking a row or
a node shows that entry in the explorer; showing an entry (a pick in the plot, the entry or
pass pickers, a new first divergence) marks its row and its node.

Examples
--------
>>> ex = tdinspect.explore(diff)     # doctest: +SKIP
>>> ex.overview.tree.tree.first      # doctest: +SKIP
('model.layers.2.mlp.down', 0, 0)
"""

from __future__ import annotations

import ipywidgets as W

from tdinspect.jupyter.healthview import HealthTable
from tdinspect.jupyter.treeview import TreePanel


class Overview:
    """The module tree and the health table of a :class:`~tdinspect.jupyter.widgets.DiffExplorer`.

    Attributes
    ----------
    tree : TreePanel
    table : HealthTable
    health : pandas.DataFrame
        The rows both show (:meth:`tdinspect.Diff.health` of the explorer's table).
    widget : ipywidgets.HBox
    """

    def __init__(self, explorer, rows: int = 16):
        self.explorer = explorer
        self.tree = TreePanel()
        self.table = HealthTable(rows=rows)
        self.tree.on_pick = self.table.on_pick = self._pick
        self.health = None
        self._at = None  # (metric, threshold) of self.health
        self.widget = W.HBox(
            [
                W.Box([self.tree.widget], layout=W.Layout(width="40%")),
                W.Box([self.table.widget], layout=W.Layout(width="60%")),
            ]
        )
        self.widget.add_class("tdi-overview")  # a name for the page (tests, screenshots)
        explorer.on_update.append(self.refresh)
        explorer.on_show.append(self.follow)
        self.refresh()

    def refresh(self) -> None:
        """Recompute the health rows when the explorer's metric or threshold changed."""
        from tdinspect.compare.entries import health, rethreshold
        from tdinspect.compare.tree import ModuleTree
        from tdinspect.numerics.metrics import metric

        ex = self.explorer
        m, thr = metric(ex.metric.value), ex.threshold_value
        if self._at != (m.name, thr):
            # the diff's own rule (its spec's structural mode, a baseline's budget), as the verdict
            args = (
                ex.table,
                m,
                ex.diff.thresholds(thr, m.name),
                ex.diff.allow_uncompared,
                ex.diff.diverging(ex.table, m.name, thr),
            )
            same_metric = self._at is not None and self._at[0] == m.name
            # a threshold move changes only the threshold, share and diverges columns
            self.health = rethreshold(self.health, *args) if same_metric else health(*args)
            self._at = (m.name, thr)
            self.table.set_health(self.health, m.name)
            self.tree.set_tree(ModuleTree(self.health, m.name, ex.diff.thresholds(thr, m.name).given()))
        self.follow()

    def follow(self) -> None:
        """Mark the entry the explorer shows, in the table and in the tree."""
        at = self.explorer.shown_at
        self.table.select(at)
        self.tree.mark(at[0] if at else None)

    def _pick(self, key: str, pass_: int, rank: int) -> None:
        self.explorer._timed("pick", self.explorer.select, key, pass_, rank)
