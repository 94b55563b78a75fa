"""Interactive explorers: ``tdinspect.explore(dumpset)`` and ``tdinspect.explore(diff)``.

Each explorer builds its figures once and updates their artists from
``observe`` callbacks; sliders only fire on release (``continuous_update=False``,
the debounce). Under ``%matplotlib widget`` (ipympl) a figure is its
interactive canvas (zoom, pan, click a point to select its entry); otherwise it
is a PNG in an ``Image`` widget, so a saved notebook keeps what it showed.
What does not change is cached: the diff table, and each side-by-side view
already drawn (moving the threshold re-reads nothing). The explorer objects
expose their widgets and methods, so the callbacks are testable without a
browser.

Examples
--------
>>> ex = tdinspect.explore(ds.diff(other))     # doctest: +SKIP
>>> ex                                         # doctest: +SKIP
"""

from __future__ import annotations

import io
import math
from collections import OrderedDict
from contextlib import contextmanager

import ipywidgets as W
import numpy as np
from IPython.display import display

from tdinspect.jupyter import plots
from tdinspect.jupyter.overview import Overview
from tdinspect.util.terminal import html_text, visible


def _labelled(names) -> list[tuple[str, str]]:
    """Dropdown options for names from a dump: each shown through :func:`visible` (a lone
    surrogate cannot be sent to the browser), picked as itself."""
    return [(visible(n), n) for n in names]


def interactive_backend() -> bool:
    """Whether matplotlib draws into ipympl canvases (``%matplotlib widget``)."""
    import matplotlib

    backend = matplotlib.get_backend().lower()
    return "ipympl" in backend or backend == "widget"


class FigureView:
    """One matplotlib figure shown as a widget: the ipympl canvas, or a PNG image.

    In the PNG case, :meth:`png` can keep what does not change: given the
    artists an interaction moves (``dynamic``) and a ``key`` naming everything
    else the figure shows, the rest is drawn once per key and kept as pixels;
    later calls with that key paste them back and draw only the dynamic
    artists (a threshold line, a marker, the legend), a few milliseconds
    instead of a full draw of every tick and label.

    Attributes
    ----------
    fig : matplotlib.figure.Figure
    widget : ipywidgets.DOMWidget
    """

    backgrounds = 8  # kept per figure: one per metric and axis range seen recently

    def __init__(self, figsize: tuple[float, float], dpi: int = 90):
        self.interactive = interactive_backend()
        self.dpi = dpi
        self._backgrounds: OrderedDict[object, object] = OrderedDict()
        if self.interactive:
            import matplotlib.pyplot as plt

            # at most ~880 pixels wide: a notebook cell's width, so no panel is clipped
            with plt.ioff():  # shown in the explorer's layout, not by the backend
                self.fig = plt.figure(figsize=figsize, dpi=min(100.0, 880 / figsize[0]))
            canvas = self.fig.canvas
            canvas.header_visible = False
            canvas.toolbar_position = "right"  # beside the figure, not over its y label
            canvas.layout.max_width = "100%"
            self.widget = canvas
        else:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            # no pyplot state: nothing displays it behind our back
            self.fig = Figure(figsize=figsize, dpi=dpi)
            FigureCanvasAgg(self.fig)
            self.widget = W.Image(format="png", layout=W.Layout(max_width="100%", height="auto"))

    def png(self, dynamic=(), key=None) -> bytes:
        """The figure as PNG bytes; with ``dynamic`` artists and a ``key``, drawn from the kept
        pixels of everything else when ``key`` was drawn before."""
        if self.interactive:  # ipympl draws its own canvas; this is a picture of it
            buf = io.BytesIO()
            self.fig.savefig(buf, format="png", dpi=self.dpi)
            return buf.getvalue()
        canvas = self.fig.canvas
        dynamic = [a for a in dynamic if a is not None]
        if key is None or not dynamic:
            canvas.draw()
        else:
            key = (key, canvas.get_width_height())
            background = self._backgrounds.get(key)
            if background is None:
                for a in dynamic:
                    a.set_animated(True)  # left out of the full draw ...
                try:
                    canvas.draw()
                finally:
                    for a in dynamic:
                        a.set_animated(False)  # ... and nowhere else (savefig draws all)
                self._backgrounds[key] = canvas.copy_from_bbox(self.fig.bbox)
                while len(self._backgrounds) > self.backgrounds:
                    self._backgrounds.popitem(last=False)
            else:
                self._backgrounds.move_to_end(key)
                canvas.restore_region(background)
            renderer = canvas.get_renderer()
            for a in dynamic:
                a.draw(renderer)
        return _encode_png(canvas)

    def forget(self) -> None:
        """Drop the kept pixels (the figure was cleared: its artists are new)."""
        self._backgrounds.clear()

    def refresh(self, png: bytes | None = None, dynamic=(), key=None) -> None:
        """Show the figure's current state (or an already rendered ``png`` of it)."""
        if self.interactive:
            self.fig.canvas.draw_idle()
        else:
            self.widget.value = png if png is not None else self.png(dynamic, key)


def _encode_png(canvas) -> bytes:
    """The canvas's pixels as an RGB PNG (no alpha channel: the figure is opaque), compressed
    lightly: a third faster to write than matplotlib's default, about as small."""
    from PIL import Image

    width, height = canvas.get_width_height(physical=True)
    image = Image.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="png", compress_level=1)
    return buf.getvalue()


def _wrapping() -> W.Layout:
    """A row of widgets that wraps in a narrow cell instead of running past it."""
    return W.Layout(flex_flow="row wrap", max_width="100%")


class _Quiet:
    """Widget callbacks that can be held quiet while several widgets change."""

    _quiet = False

    @contextmanager
    def _hold(self):
        """Change several widgets with one redraw at the end (callbacks stay quiet inside)."""
        quiet, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = quiet


class DiffExplorer(_Quiet):
    """Metric along execution order, a threshold slider, and a side-by-side view of a picked entry.

    Parameters
    ----------
    diff : Diff
    metric : str, optional
        The metric shown first (default: the diff's, ``rel_diff``).
    threshold : "auto" or float, optional
        The first threshold (default ``"auto"``: each entry's from its two
        dtypes, drawn as a step line; the slider then shows the value of the
        most common dtype pair). Moving the slider sets one number for every
        entry and clears the ``auto`` box; ticking it goes back. Switching
        the metric brings ``"auto"`` back, with that metric's slider range,
        direction and axis scale.
    positions : int or str, optional
        Add the entries × positions panel along this dim
        (:func:`tdinspect.plot.per_position`), redrawn with the metric and
        threshold: where along the tokens the runs part.

    Attributes
    ----------
    metric : ipywidgets.Dropdown
    threshold : ipywidgets.FloatLogSlider or ipywidgets.FloatSlider
        The slider of the current metric (log for errors, linear for cosine,
        SQNR and mismatch; fixed for ``equal``).
    auto : ipywidgets.Checkbox
        Whether the threshold is ``"auto"`` (:attr:`threshold_value`).
    entry, pass_, rank : ipywidgets.Dropdown
        What the side-by-side view shows (it opens on the first divergence).
    label : ipywidgets.HTML
        Describes the current first divergence.
    overview : Overview
        The module tree and the health table (sortable, with a name filter), linked both
        ways to the view (:mod:`tdinspect.jupyter.overview`).
    divergence : Divergence or None
    timings : dict
        Seconds the last build and the last callback of each kind took.
    """

    def __init__(
        self,
        diff,
        metric: str | None = None,
        threshold: float | str | None = None,
        positions: int | str | None = None,
    ):
        import time

        from tdinspect.numerics.metrics import METRICS

        t0 = time.perf_counter()
        self.diff = diff
        self.timings: dict[str, float] = {}
        names = ["stats_rel"] if diff.mode == "stats" else [m for m in METRICS if m != "stats_rel"]
        metric = (
            diff.default_metric if metric is None else metric
        )  # the diff's own spec, unless told otherwise
        if threshold is None and metric == diff.default_metric:
            threshold = diff.spec.threshold
        self.metric = W.Dropdown(options=names, value=metric, description="metric")
        self._log_slider = W.FloatLogSlider(
            base=10,
            min=-12,
            max=0,
            step=0.25,
            value=1e-3,
            description="threshold",
            continuous_update=False,
            readout_format=".1e",
        )
        self._lin_slider = W.FloatSlider(
            min=0, max=1, step=1e-3, value=0.5, description="threshold", continuous_update=False
        )
        self.auto = W.Checkbox(
            value=True,
            description="auto",
            indent=False,
            tooltip="each entry's threshold from its two dtypes",
            layout=W.Layout(width="70px"),
        )
        self.direction = W.HTML()
        self.table = plots.sorted_table(diff)
        self._keys = list(dict.fromkeys(self.table["key"]))
        # wide enough for a whole Hugging Face name (model.model.layers.31.mlp.up_proj)
        self.entry = W.Dropdown(
            options=_labelled(self._keys), description="entry", layout=W.Layout(width="62%", min_width="18em")
        )
        self.pass_ = W.Dropdown(
            options=sorted(set(self.table["pass"].tolist())),
            description="pass",
            layout=W.Layout(width="11em"),
        )
        self.rank = W.Dropdown(
            options=sorted(set(self.table["rank"].tolist())),
            description="rank",
            layout=W.Layout(width="11em", display="" if self.table["rank"].nunique() > 1 else "none"),
        )
        self.label = W.HTML()
        self.message = W.HTML()
        self.plot = FigureView((11, 3.8))
        self.fig = self.plot.fig
        self.ax = self.fig.add_subplot()
        self.fig.subplots_adjust(**plots.DIVERGENCE_MARGINS)
        self.artists = plots.DivergencePlot(self.table, self.ax)
        self.view = FigureView((12, 5.8), dpi=72)
        self.view_fig = self.view.fig
        self._sbs: plots.SideBySide | None = None  # its axes, made on the first entry shown
        self._views: OrderedDict[tuple, bytes] = OrderedDict()  # (key, pass, rank) -> PNG
        self.divergence = None
        self.verdict = None
        self.shown: str | None = None
        self.shown_at: tuple | None = None
        self._picked = False  # the user chose the entry shown: a new threshold keeps it
        self._quiet = False
        self.on_update: list = []  # called after each update (the dashboard's entry table)
        self.on_show: list = []  # called after each entry shown (the health table, the tree)
        self.threshold_box = W.HBox()
        self._configure_slider(metric, threshold)
        self.metric.observe(self._on_metric, names="value")
        for s in (self._log_slider, self._lin_slider):
            s.observe(self._on_threshold, names="value")
        self.auto.observe(self._on_auto, names="value")
        for w in (self.entry, self.pass_, self.rank):
            w.observe(self._on_pick, names="value")
        self.fig.canvas.mpl_connect("button_press_event", self._on_click)
        self.position_dim, self.positions, self.positions_fig = positions, W.Output(), None
        self.widget = W.VBox(
            [
                self.controls(),
                self.label,
                self.plot.widget,
                *([self.positions] if positions is not None else []),
                self.pickers(),
                self.message,
                self.view.widget,
            ],
            layout=W.Layout(max_width="100%"),
        )
        self.overview = Overview(self)  # the module tree and the health table
        self.widget.children = (*self.widget.children, self.overview.widget)
        self.update(follow=True)
        self.timings["build"] = time.perf_counter() - t0

    def controls(self) -> W.Box:
        """Metric, threshold and its direction, in a row that wraps in a narrow cell."""
        return W.HBox([self.metric, self.threshold_box, self.direction], layout=_wrapping())

    def pickers(self) -> W.Box:
        """Entry, pass and rank pickers, in a row that wraps in a narrow cell."""
        return W.HBox([self.entry, self.pass_, self.rank], layout=_wrapping())

    # -- the threshold slider follows the metric ---------------------------------------------
    @property
    def threshold(self):
        """The slider of the current metric."""
        return self._log_slider if plots.scale(self.metric.value).log else self._lin_slider

    @property
    def threshold_value(self) -> float | str | dict:
        """What the answers use: ``"auto"`` while the box is ticked (the diff's own
        ``{regex: value}`` thresholds when its spec has them), else the slider's value."""
        if not self.auto.value:
            return self.threshold.value
        own = self.diff.spec.threshold
        return own if isinstance(own, dict) and self.metric.value == self.diff.default_metric else "auto"

    def _auto_shown(self, name: str) -> float:
        """The slider's value under ``"auto"``: the threshold :class:`~tdinspect.Diff` applies
        to most entries (each row's from its dtypes and upstream dtype, as drawn)."""
        values = plots.drawn_threshold(self.diff, "auto", name, self.table)
        if not len(values):
            from tdinspect.compare.thresholds import threshold_fn

            return threshold_fn("auto", name).lookup("", "", "")[0]
        distinct, counts = np.unique(values, return_counts=True)
        return float(distinct[counts.argmax()])

    def _configure_slider(self, name: str, threshold: float | None = None) -> None:
        from tdinspect.numerics.metrics import metric

        m, sc = metric(name), plots.scale(name)
        auto = (
            threshold is None
            or isinstance(threshold, dict)
            or (isinstance(threshold, str) and threshold == "auto")
        )
        value = self._auto_shown(name) if auto else float(threshold)
        if not math.isfinite(value):  # sqnr_db of integers: any difference
            value = sc.hi
        slider = self.threshold
        with self._hold():
            self.auto.value = auto
            if sc.log:  # float64's "auto" (2.8e-17) widens the range below 1e-12
                lo = min(sc.lo, math.floor(math.log10(value))) if value > 0 else sc.lo
                value = max(value, 10.0**lo)
                slider.min, slider.max = lo, max(sc.hi, math.ceil(math.log10(value)))
            else:
                slider.min, slider.max = sc.lo, max(sc.hi, value)
            slider.step = sc.step
            slider.value = value
            self._readout(name)
            slider.disabled = name == "equal"  # bitwise equality has one threshold: 1
        self.threshold_box.children = [slider, self.auto]
        self.direction.value = (
            f"<small>diverges {'above' if m.higher_is_worse else 'below'}"
            f"{' (0 = not bitwise equal)' if name == 'equal' else ''}</small>"
        )

    def _readout(self, name: str) -> None:
        """The slider shows its value with the digits that tell it from 1 (cosine 0.99999999 is
        not 1.000000), and its step is fine enough to hold that value."""
        sc, slider = plots.scale(name), self.threshold
        fmt = sc.readout(slider.value)
        slider.readout_format = fmt
        if sc.near_one and fmt != sc.fmt:
            slider.step = min(sc.step, 10.0 ** -int(fmt[1:-1]))

    # -- callbacks ---------------------------------------------------------------------------
    def _timed(self, kind: str, fn, *args) -> None:
        import time

        t0 = time.perf_counter()
        try:
            fn(*args)
        except Exception as exc:  # shown in the explorer, not lost in the kernel's log
            self.message.value = f"<span style='color:var(--jp-error-color1)'>{html_text(repr(exc))}</span>"
            raise
        finally:
            self.timings[kind] = time.perf_counter() - t0

    def _on_metric(self, change) -> None:
        if not self._quiet:
            self._timed("metric", self._switch_metric, change["new"])

    def _switch_metric(self, name: str) -> None:
        self._configure_slider(name)
        self.update(follow=True)

    def _on_threshold(self, change) -> None:
        if not self._quiet and change["owner"] is self.threshold:
            with self._hold():
                self.auto.value = False  # a number for every entry now
                self._readout(self.metric.value)
            self._timed("threshold", self.update, not self._picked)

    def _on_auto(self, change) -> None:
        if self._quiet:
            return
        if change["new"]:
            with self._hold():
                self.threshold.value = self._auto_shown(self.metric.value)
                self._readout(self.metric.value)
        self._timed("threshold", self.update, not self._picked)

    def _on_pick(self, change) -> None:
        if not self._quiet:
            self._picked = True
            self._timed("pick", self._show_picked)

    def _on_click(self, event) -> None:
        """Clicking near a point of the divergence plot selects its entry (ipympl)."""
        if event.inaxes is not self.ax or event.xdata is None:
            return
        i = int(round(event.xdata))
        if 0 <= i < len(self.table):
            row = self.table.iloc[i]
            self._timed("click", self.select, row["key"], int(row["pass"]), int(row["rank"]))

    # -- what the callbacks do -------------------------------------------------------------
    def select(self, key: str, pass_: int | None = None, rank: int | None = None) -> None:
        """Show ``key`` (at ``pass_``, ``rank``) side by side and mark it on the plot; a new
        threshold keeps it shown (a pick: from code, a click, or the dashboard's table)."""
        self._picked = True
        self._select(key, pass_, rank)

    def _select(self, key: str, pass_: int | None = None, rank: int | None = None) -> None:
        with self._hold():
            if key in self._keys:
                self.entry.value = key
            if pass_ is not None and pass_ in self.pass_.options:
                self.pass_.value = pass_
            if rank is not None and rank in self.rank.options:
                self.rank.value = rank
        self._show_picked()

    def _selected_row(self) -> float:
        df = self.table
        hit = np.flatnonzero(
            (df["key"].to_numpy() == self.entry.value)
            & (df["pass"].to_numpy() == self.pass_.value)
            & (df["rank"].to_numpy() == self.rank.value)
        )
        return float(hit[0]) if len(hit) else math.nan

    def _show_picked(self) -> None:
        self.show_entry(self.entry.value, self.pass_.value, self.rank.value)
        self._redraw_plot()
        for fn in self.on_show:
            fn()

    def update(self, follow: bool = True) -> None:
        """Recompute the first divergence at the current metric and threshold; redraw the plot.

        With ``follow``, the side-by-side view moves to the new first
        divergence (drawn only if it is not the entry already shown).
        """
        from tdinspect.numerics.metrics import metric

        m, thr = metric(self.metric.value), self.threshold_value
        # the verdict of the diff's own spec (structural mode, allowed entries), as the CLI's
        self.verdict = self.diff.verdict(thr, m.name)
        div = self.divergence = self.verdict.divergence
        sc = plots.scale(m.name)
        if div is None:
            fixed = isinstance(thr, (int, float))
            text = sc.text(thr) if fixed else self.diff.thresholds(thr, m.name).describe(self.table)
            near = self.diff.nearest(thr, m.name, progress=False)
            head = "no divergence" if self.verdict.outcome == "matches" else "incomplete"
            self.label.value = (
                f"<b>{head}</b> at {html_text(m.name)} threshold {html_text(text)}"
                f"<br>{html_text(self.verdict.text)}"
                + (f"<br>nearest: {html_text(near['text'])}" if near else "")
            )
        else:
            self.label.value = (
                f"first divergence: <b>{html_text(div.key)}</b> (pass {div.pass_}, "
                f"call {div.call}"
                + (f", rank {div.rank}" if self.table["rank"].nunique() > 1 else "")
                + f") — {html_text(div.reason)}"
            )
        if follow and div is not None and div.key in self._keys:
            self._select(div.key, div.pass_, div.rank)  # redraws the plot with the selection
        elif follow and self.shown is None:
            self._show_picked()
        else:
            self._redraw_plot()
        for fn in self.on_update:
            fn()
        if getattr(self, "position_dim", None) is not None:
            self.show_positions()

    def show_positions(self) -> None:
        """Redraw the per-position panel (entries × positions, first divergent position marked)."""
        import matplotlib.pyplot as plt

        self.positions.clear_output(wait=True)
        with self.positions:
            self.positions_fig = plots.per_position(
                self.diff, dim=self.position_dim, metric=self.metric.value, threshold=self.threshold_value
            )
            display(self.positions_fig)
            plt.close(self.positions_fig)

    def _redraw_plot(self) -> None:
        from tdinspect.numerics.metrics import metric

        name = self.metric.value
        self.artists.draw(
            metric(name),
            plots.drawn_threshold(self.diff, self.threshold_value, name, self.table),
            self.divergence,
            self._selected_row(),
            verdict=self.verdict,
        )
        self.plot.refresh(dynamic=self.artists.dynamic(), key=self.artists.static_key)

    def show_entry(self, key: str, pass_: int | None = None, rank: int | None = None) -> None:
        """Side-by-side A, B and |A - B| of one entry (cached: drawn once per entry, pass, rank)."""
        pass_ = self.pass_.value if pass_ is None else pass_
        rank = self.rank.value if rank is None else rank
        where = (key, pass_, rank)
        if where == self.shown_at:
            return
        self.shown, self.shown_at = key, where
        if self.diff.mode == "stats":
            self.message.value = "statistics-only dumps hold no tensors to show"
            return
        if where in self._views:
            self._views.move_to_end(where)
            self.message.value = ""
            self.view.refresh(self._views[where])
            return
        sides = []
        for side in (self.diff.a, self.diff.b):
            try:
                sides.append(side.tensor(key, pass_=pass_, rank=rank if len(side.ranks) > 1 else None))
            except (KeyError, ValueError) as exc:
                self.message.value = f"{html_text(key)}, pass {pass_}: {html_text(exc)}"
                return
        a, b = sides
        if a.shape != b.shape:
            self.message.value = (
                f"{html_text(key)}: shapes differ ({list(a.shape)} vs "
                f"{list(b.shape)}); nothing to show side by side"
            )
            return
        self.message.value = ""
        if self._sbs is None:
            self._sbs = plots.SideBySide(self.view_fig)
        self._sbs.update(
            a,
            b,
            title=f"{key}  (pass {pass_}" + (f", rank {rank}" if len(self.rank.options) > 1 else "") + ")",
        )
        png = None if self.view.interactive else self.view.png(self._sbs.dynamic(), self._sbs.static_key)
        if png is not None:
            self._views[where] = png
            while len(self._views) > 32:
                self._views.popitem(last=False)
        self.view.refresh(png)

    def _ipython_display_(self) -> None:
        display(self.widget)


class DumpSetExplorer(_Quiet):
    """Search an op, pick call and pass, see its statistics, heatmap and histogram.

    The search waits for typing to pause (:attr:`search_delay` seconds, in a
    running event loop such as the kernel's) and then redraws once; each
    (op, call, pass) is drawn once and kept.

    Parameters
    ----------
    ds : DumpSet

    Attributes
    ----------
    search : ipywidgets.Text
    op : ipywidgets.Dropdown
    call : ipywidgets.IntSlider
    pass_ : ipywidgets.SelectionSlider
    timings : dict
        Seconds the last update took (``"update"``).
    """

    search_delay = 0.3  # seconds without a key before the search redraws
    views = 32  # (op, call, pass) pictures kept

    def __init__(self, ds):
        self.ds = ds
        self.entries = ds.entries(progress=False)
        self.timings: dict[str, float] = {}
        self.search = W.Text(description="search", placeholder="regex on names")
        self.op = W.Dropdown(options=_labelled(ds.ops), description="op", layout=W.Layout(width="auto"))
        self.call = W.IntSlider(0, 0, 0, description="call", continuous_update=False)
        self._quiet = False
        self._pending = None  # the debounced search's timer handle
        self.pass_ = W.SelectionSlider(options=ds.passes, description="pass", continuous_update=False)
        self.stats = W.HTML(layout=W.Layout(max_width="100%", overflow="auto"))
        self.view = FigureView((10, 3.5))
        self.fig = self.view.fig
        self._tensor_view: plots.TensorView | None = None
        self._shown: tuple | None = None
        self._views: OrderedDict[tuple, tuple] = OrderedDict()  # -> (stats, PNG, drawn view)
        self.search.observe(self._on_search, names="value")
        for w in (self.op, self.call, self.pass_):
            w.observe(self._on_change, names="value")
        self.widget = W.VBox(
            [W.HBox([self.search, self.op]), W.HBox([self.call, self.pass_]), self.stats, self.view.widget],
            layout=W.Layout(max_width="100%"),
        )
        self.update()

    def _on_search(self, change) -> None:
        import asyncio

        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a script, a test): search at once
            loop = None
        if loop is None or self.search_delay <= 0:
            self._apply_search(change["new"])
        else:
            self._pending = loop.call_later(self.search_delay, self._apply_search, change["new"])

    def _apply_search(self, text: str) -> None:
        import re

        self._pending = None
        try:
            pattern = re.compile(text)
        except re.error as exc:
            self.stats.value = f"invalid regex: {html_text(exc)}"
            return
        options = [o for o in self.ds.ops if pattern.search(o)]
        with self._hold():  # one redraw below, not one per widget the options move
            self.op.options = _labelled(options)  # ipywidgets keeps the old value only if still an option
            if options and self.op.value not in options:
                self.op.value = options[0]
        self.update()

    def _on_change(self, change) -> None:
        if not self._quiet:
            self.update()

    def _follow_calls(self) -> None:
        """The call slider spans the picked op's calls (its value clamped into them)."""
        calls = self.entries.loc[self.entries["op"] == self.op.value, "call"]
        top = int(calls.max()) if len(calls) else 0
        with self._hold():
            if self.call.value > top:
                self.call.value = top
            self.call.max = top

    def _blank(self, message: str) -> None:
        """Nothing to draw: an empty axes saying why (never the previous op's picture)."""
        self.fig.clear()
        self.view.forget()
        self._tensor_view = None
        ax = self.fig.add_subplot()
        ax.set_axis_off()
        ax.set_title(plots._plain(message), fontsize=9)
        self.view.refresh()

    def update(self) -> None:
        """Show the picked op's statistics and tensor."""
        import time

        t0 = time.perf_counter()
        try:
            self._update()
        finally:
            self.timings["update"] = time.perf_counter() - t0

    def _update(self) -> None:
        import pandas as pd

        from tdinspect.report import styled

        if self.op.value is None:
            self._shown = None
            self.stats.value = f"no op matches {html_text(repr(self.search.value))}"
            self._blank(f"no op matches {self.search.value!r}")
            return
        self._follow_calls()
        where = (self.op.value, int(self.call.value), self.pass_.value)
        if where == self._shown:
            return
        if where in self._views:
            self._views.move_to_end(where)
            self._shown = where
            self.stats.value, png, drawn = self._views[where]
            if drawn is not None:  # the figure shows it too (its artists, not drawn again)
                self._tensor_view = self._tensor_view or plots.TensorView(self.fig)
                self._tensor_view.show(*drawn)
                self.view.refresh(png)
            return
        rows = self.entries[
            (self.entries["op"] == self.op.value)
            & (self.entries["call"] == self.call.value)
            & (self.entries["pass"] == self.pass_.value)
        ]
        self._shown = None
        if rows.empty:
            text = f"{self.op.value} has no call {self.call.value} in pass {self.pass_.value}"
            self.stats.value = html_text(text)
            self._blank(text)
            return
        r = rows.iloc[0]
        cols = ["key", "dtype", "shape", "min", "max", "mean", "std", "nan", "inf"]
        self.stats.value = styled(pd.DataFrame([[r[c] for c in cols]], columns=cols))
        png = drawn = None
        if not self.ds.stats_only:
            t = self.ds.tensor(self.op.value, call=int(self.call.value), pass_=int(self.pass_.value))
            if self._tensor_view is None:
                self._tensor_view = plots.TensorView(self.fig)
            drawn = self._tensor_view.update(t, title=r["key"])
            tv = self._tensor_view
            png = None if self.view.interactive else self.view.png(tv.dynamic(), tv.static_key)
            self.view.refresh(png)
        self._shown = where
        if not self.view.interactive:
            self._views[where] = (self.stats.value, png, drawn)
            while len(self._views) > self.views:
                self._views.popitem(last=False)

    def _ipython_display_(self) -> None:
        display(self.widget)


def explore(
    obj,
    *,
    metric: str | None = None,
    threshold: float | str | None = None,
    positions: int | str | None = None,
):
    """An interactive explorer for a DumpSet or a Diff.

    Parameters
    ----------
    obj : DumpSet or Diff
        A DumpSet gives a search box, call and pass sliders, statistics, a
        heatmap and a histogram; a Diff gives the metric along execution
        order, a threshold slider and a side-by-side view.
    metric : str, optional
        Diff only: the metric shown first (``rel_diff``, ``cosine``, ...).
    threshold : "auto" or float, optional
        Diff only: the first threshold (default ``"auto"``: each entry's from
        its dtypes; a number for every entry).
    positions : int or str, optional
        Diff only: add the entries × positions panel along this dim (a decode
        run against a full forward: the first divergent token at a glance).

    Returns
    -------
    DiffExplorer or DumpSetExplorer
        Displays itself; its widgets are attributes (``ex.threshold.value = 1e-5``,
        ``ex.auto.value = True``).

    Examples
    --------
    >>> tdinspect.explore(DumpSet.open("sample_dumps/float32"))   # doctest: +SKIP
    >>> tdinspect.explore(diff, metric="cosine", threshold=0.9999)  # doctest: +SKIP
    """
    from tdinspect.compare.diff import Diff
    from tdinspect.dumpset import DumpSet

    if isinstance(obj, Diff):
        return DiffExplorer(obj, metric=metric, threshold=threshold, positions=positions)
    if isinstance(obj, DumpSet):
        if metric is not None or threshold is not None or positions is not None:
            raise TypeError("explore(DumpSet) takes no metric, threshold or positions (those are for a Diff)")
        return DumpSetExplorer(obj)
    raise TypeError(f"explore() takes a DumpSet or a Diff, not {type(obj).__name__}")
