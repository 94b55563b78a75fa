"""Interactive explorers: ``tdinspect.explore(dumpset)`` and ``tdinspect.explore(diff)``.

Each explorer builds its figure once and updates its artists from ``observe``
callbacks; sliders only fire on release (``continuous_update=False``, the
debounce); callback output and errors go to an ``Output`` widget. The explorer
objects expose their widgets and an ``update`` method, so the callbacks are
testable without a browser.

Examples
--------
>>> ex = tdinspect.explore(ds.diff(other))     # doctest: +SKIP
>>> ex                                         # doctest: +SKIP
"""

from __future__ import annotations

import math

import ipywidgets as W
import numpy as np
from IPython.display import display

from . import plots


class DiffExplorer:
    """Metric along execution order, a threshold slider, and a side-by-side view of a picked entry.

    Attributes
    ----------
    threshold : ipywidgets.FloatLogSlider
    metric : ipywidgets.Dropdown
    entry : ipywidgets.Dropdown
        Picks the entry shown side by side (defaults to the first divergence).
    label : ipywidgets.HTML
        Describes the current first divergence.
    """

    def __init__(self, diff, metric: str | None = None, threshold: float | None = None):
        from ..metrics import METRICS

        self.diff = diff
        names = ["stats_rel"] if diff.mode == "stats" else [
            m for m in METRICS if m != "stats_rel"]
        metric = metric or diff.default_metric
        self.metric = W.Dropdown(options=names, value=metric, description="metric")
        thr = METRICS[metric].default_threshold if threshold is None else threshold
        self.threshold = W.FloatLogSlider(value=max(thr, 1e-12), base=10, min=-12, max=3, step=0.25,
                                          description="threshold", continuous_update=False,
                                          readout_format=".1e")
        self.table = diff.table(progress=False).sort_values(["pass", "order", "rank"]).reset_index(
            drop=True)
        keys = list(dict.fromkeys(self.table["key"]))
        self.entry = W.Dropdown(options=keys, description="entry")
        self.label = W.HTML()
        self.out = W.Output()
        self.fig = plots.divergence(diff, metric, thr)
        self.ax = self.fig.axes[0]
        self.divergence = None
        self.shown = None
        import matplotlib.pyplot as plt

        plt.close(self.fig)  # shown through the Output widget, not by the backend
        self.metric.observe(self._on_change, names="value")
        self.threshold.observe(self._on_change, names="value")
        self.entry.observe(self._on_entry, names="value")
        self.view = W.Output()
        self.widget = W.VBox([W.HBox([self.metric, self.threshold]), self.label, self.out,
                              self.entry, self.view])
        self.update()

    def _on_change(self, change) -> None:
        with self.out:
            self.update()

    def _on_entry(self, change) -> None:
        with self.view:
            self.show_entry(change["new"])

    def update(self) -> None:
        """Recompute the first divergence and move the marker (the figure is reused)."""
        m, thr = self.metric.value, self.threshold.value
        div = self.diff.first_divergence(thr, m)
        self.divergence = div
        y = self.table[m].to_numpy(dtype=float)
        line = self.ax.lines[0]
        line.set_ydata(np.where(np.isfinite(y) & (y > 0), y, plots._floor(y)))
        line.set_label(m)
        self.ax.lines[-2].set_ydata([thr, thr])  # the threshold line (see plots.divergence)
        self.ax.lines[-2].set_label(f"threshold {thr:g}")
        self.ax.legend(loc="upper left", fontsize=8)
        marker = self.ax.lines[-1]
        if div is None:
            marker.set_xdata([math.nan, math.nan])
            self.label.value = f"<b>no divergence</b> at {m} threshold {thr:.1e}"
        else:
            idx = self.table.index[(self.table["key"] == div.key) & (self.table["pass"] == div.pass_)
                                   & (self.table["rank"] == div.rank)]
            x = float(idx[0]) if len(idx) else math.nan
            marker.set_xdata([x, x])
            self.label.value = (f"first divergence: <b>{div.key}</b> (pass {div.pass_}, call "
                                f"{div.call}) — {div.reason}")
            if div.key in self.entry.options:
                self.entry.value = div.key
        self.ax.set_ylabel(m)
        self.ax.relim()
        self.ax.autoscale_view()
        self.ax.set_title(self.label.value.replace("<b>", "").replace("</b>", ""), fontsize=9)
        self.fig.canvas.draw_idle()  # ipympl redraws its canvas in place; inline needs the display below
        self.out.clear_output(wait=True)
        with self.out:
            display(self.fig)

    def show_entry(self, key: str, pass_: int = 0) -> None:
        """Side-by-side A, B and |A - B| of one entry."""
        if self.diff.mode == "stats":
            print("statistics-only dumps hold no tensors to show")
            return
        a = self.diff.a.tensor(key, pass_=pass_)
        b = self.diff.b.tensor(key, pass_=pass_)
        import matplotlib.pyplot as plt

        self.view.clear_output(wait=True)
        self.view_fig = plots.side_by_side(a, b, title=key)
        self.shown = key
        display(self.view_fig)
        plt.close(self.view_fig)

    def _ipython_display_(self) -> None:
        display(self.widget)


class DumpSetExplorer:
    """Search an op, pick call and pass, see its statistics, heatmap and histogram."""

    def __init__(self, ds):
        self.ds = ds
        self.entries = ds.entries(progress=False)
        self.search = W.Text(description="search", placeholder="regex on names")
        self.op = W.Dropdown(options=ds.ops, description="op")
        calls = int(self.entries["call"].max())
        self.call = W.IntSlider(0, 0, max(calls, 0), description="call", continuous_update=False)
        self.pass_ = W.SelectionSlider(options=ds.passes, description="pass", continuous_update=False)
        self.stats = W.HTML()
        self.out = W.Output()
        import matplotlib.pyplot as plt

        self.fig = plt.figure(figsize=(10, 3.5))
        plt.close(self.fig)
        self.search.observe(self._on_search, names="value")
        for w in (self.op, self.call, self.pass_):
            w.observe(self._on_change, names="value")
        self.widget = W.VBox([W.HBox([self.search, self.op]), W.HBox([self.call, self.pass_]),
                              self.stats, self.out])
        self.update()

    def _on_search(self, change) -> None:
        import re

        try:
            pattern = re.compile(change["new"])
        except re.error:
            return
        self.op.options = [o for o in self.ds.ops if pattern.search(o)]

    def _on_change(self, change) -> None:
        with self.out:
            self.update()

    def update(self) -> None:
        from ..report import _table

        if self.op.value is None:
            self.stats.value = "no op matches"
            return
        rows = self.entries[(self.entries["op"] == self.op.value) & (self.entries["call"] == self.call.value)
                            & (self.entries["pass"] == self.pass_.value)]
        if rows.empty:
            self.stats.value = f"{self.op.value} has no call {self.call.value} in pass {self.pass_.value}"
            self.out.clear_output()
            return
        r = rows.iloc[0]
        self.stats.value = _table(["key", "dtype", "shape", "min", "max", "mean", "std", "nan", "inf"],
                                  [[r["key"], r["dtype"], r["shape"], r["min"], r["max"], r["mean"],
                                    r["std"], r["nan"], r["inf"]]])
        if self.ds.stats_only:
            return
        t = self.ds.tensor(self.op.value, call=int(self.call.value), pass_=int(self.pass_.value))
        plots.tensor(t, title=r["key"], fig=self.fig)
        self.out.clear_output(wait=True)
        with self.out:
            display(self.fig)

    def _ipython_display_(self) -> None:
        display(self.widget)


def explore(obj, **kwargs):
    """An interactive explorer for a DumpSet or a Diff.

    Examples
    --------
    >>> tdinspect.explore(DumpSet.open("sample_dumps/float32"))   # doctest: +SKIP
    """
    from ..diff import Diff
    from ..dumpset import DumpSet

    if isinstance(obj, Diff):
        return DiffExplorer(obj, **kwargs)
    if isinstance(obj, DumpSet):
        return DumpSetExplorer(obj, **kwargs)
    raise TypeError(f"explore() takes a DumpSet or a Diff, not {type(obj).__name__}")
