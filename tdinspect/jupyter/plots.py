"""Plots of dumps and diffs: plain matplotlib, each returns its figure.

Usable without widgets (``tdinspect.plot.divergence(diff)``), in scripts (the
demo writes a PNG) and by the widgets, which update the artists made here.

Conventions: every metric has one axis scale (:func:`scale`: log for errors,
linear for cosine, SQNR, mismatch and equality); an exact zero is drawn as a
zero (a marked band, never a made-up value) and a missing value as missing,
each with its legend entry; legends sit beside the data, not on it.

Examples
--------
>>> fig = tdinspect.plot.divergence(diff)                    # doctest: +SKIP
>>> fig.savefig("divergence.png")                            # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tdinspect.util.terminal import visible


def _plt():
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True)
class Scale:
    """How a metric is drawn and chosen: axis scale and the threshold slider's range."""

    log: bool
    lo: float  # slider range: exponents for log scales, values otherwise
    hi: float
    step: float
    fmt: str  # the slider's readout format; thresholds are written the same way
    near_one: bool = False  # values crowd at 1 (cosine): written with the digits that tell them from 1

    def readout(self, value: float) -> str:
        """The slider's readout format for ``value`` (cosine: ``.8f`` for 0.99999999, never 1.000000)."""
        if self.near_one and math.isfinite(value):
            return f".{max(int(self.fmt[1:-1]), _digits_from_one(value))}f"
        return self.fmt

    def text(self, value: float) -> str:
        """A threshold written as the slider shows it."""
        return format(value, self.readout(value))


def _digits_from_one(value: float) -> int:
    """Significant digits that tell ``value`` from 1 (:func:`~tdinspect.compare.thresholds.digits_apart`)."""
    from tdinspect.compare.thresholds import digits_apart

    return digits_apart(value, 1.0)


def value_text(metric_name: str, value: float) -> str:
    """A metric's value as the views write it: 3 significant digits; a cosine with the digits
    that tell it from 1 (``0.99999999``, never ``1``), as the CLI does."""
    if value != value:
        return "-"
    if metric_name == "cosine" and math.isfinite(value):
        return f"{value:.{_digits_from_one(value)}g}"
    return f"{value:.3g}"


_SCALES = {
    "rel_diff": Scale(True, -12, 0, 0.25, ".1e"),
    "rel_diff_cast": Scale(True, -12, 0, 0.25, ".1e"),
    "max_abs": Scale(True, -12, 3, 0.25, ".1e"),
    "max_abs_cast": Scale(True, -12, 3, 0.25, ".1e"),
    "mean_abs": Scale(True, -12, 3, 0.25, ".1e"),
    "max_rel": Scale(True, -12, 3, 0.25, ".1e"),
    "stats_rel": Scale(True, -12, 3, 0.25, ".1e"),
    "cosine": Scale(False, 0.0, 1.0, 1e-6, ".6f", near_one=True),
    "sqnr_db": Scale(False, 0.0, 200.0, 0.5, ".1f"),
    "mismatch": Scale(False, 0.0, 1.0, 1e-3, ".3f"),
    "equal": Scale(False, 0.0, 1.0, 1.0, ".0f"),
}


def scale(metric_name: str) -> Scale:
    """The axis scale and slider range of a metric (log for errors, linear for the others)."""
    return _SCALES.get(metric_name, _SCALES["rel_diff"])


# the divergence plot's margins: room for the upright x labels and, on the right, the legend
DIVERGENCE_MARGINS = dict(left=0.07, right=0.76, bottom=0.22, top=0.85)


def _plain(text: str) -> str:
    """A name from a dump as literal text for matplotlib (no mathtext from ``$``; an
    undecodable byte, which matplotlib cannot draw, and control characters escaped)."""
    return visible(str(text).replace("$", r"\$"), keep="\n")


def _group(op: str) -> str:
    """The label of an entry's group on the x axis: its layer, else its leaf module."""
    from tdinspect.naming import split_module_path

    _, layer, leaf = split_module_path(op.split("/")[0])
    return f"L{layer}" if layer >= 0 else _plain(leaf)


class DivergencePlot:
    """The artists of a divergence plot, made once and updated in place.

    ``table`` is a Diff table sorted by (pass, order, rank); x is the row.
    :meth:`draw` sets metric, threshold, first divergence and selected entry.
    A threshold move or a pick changes only :meth:`dynamic` artists; all else
    is the same while :attr:`static_key` is (a view keeps its pixels).
    """

    def __init__(self, table, ax):
        self.table, self.ax = table, ax
        n = len(table)
        self.x = np.arange(n, dtype=float)
        band = ax.get_xaxis_transform()  # x in data, y in axes: a band that never meets the data
        (self.line,) = ax.plot([], [], ".-", lw=0.8, ms=3)
        (self.zeros,) = ax.plot(
            [], [], "o", ms=3.5, mfc="none", color="C2", transform=band, label="exactly 0 (identical)"
        )
        (self.inf,) = ax.plot([], [], "^", ms=4, color="C2", transform=band, label="identical (inf)")
        (self.struct,) = ax.plot(
            [], [], "x", ms=5, color="C3", transform=band, label="structural\n(only one side, shape, NaN)"
        )
        (self.missing,) = ax.plot([], [], "|", ms=8, color="0.5", transform=band, label="not compared")
        self.thr = ax.axhline(np.nan, color="C1", ls="--", lw=1)
        (self.thr_rows,) = ax.plot([], [], ls="--", lw=1, color="C1", drawstyle="steps-mid")
        self.first = ax.axvline(np.nan, color="C3", lw=1.2, label="first divergence")
        self.selected = ax.axvline(np.nan, color="C0", lw=3, alpha=0.25, label="selected entry")
        self.static_key: tuple = ()
        self._label_x()

    def dynamic(self) -> list:
        """The artists a threshold move, a pick or a new first divergence redraws."""
        return [self.thr, self.thr_rows, self.first, self.selected, self.ax.get_legend(), self.ax.title]

    def _label_x(self) -> None:
        df, ax = self.table, self.ax
        passes = df["pass"].to_numpy()
        groups = [_group(op) for op in df["op"]]
        # each run of one group is labelled at its middle; labels closer than one upright 7-point
        # line (in rows, at the axes' width) would overprint: a pass's first label wins, else the later
        width = ax.get_position().width * ax.figure.get_figwidth() * 72
        gap = len(df) * 7 * 1.5 / max(width, 1.0)
        starts = [
            i for i in range(len(df)) if i == 0 or groups[i] != groups[i - 1] or passes[i] != passes[i - 1]
        ]
        ticks: list[float] = []
        labels: list[str] = []
        firsts: list[bool] = []
        for start, end in zip(starts, [*starts[1:], len(df)]):
            first = start == 0 or passes[start] != passes[start - 1]
            if ticks and (start + end - 1) / 2 - ticks[-1] < gap:
                if firsts[-1] and not first:
                    continue
                ticks.pop(), labels.pop(), firsts.pop()
            ticks.append((start + end - 1) / 2)
            labels.append(groups[start])
            firsts.append(first)
        ax.set_xticks(ticks, labels, rotation=90, fontsize=7)
        band = ax.get_xaxis_transform()
        # one tick per entry, drawn as one artist (hundreds of minor Tick objects cost most of a draw)
        ax.plot(
            self.x,
            np.zeros(len(df)),
            ls="none",
            marker=3,
            ms=3,
            mew=0.6,
            color="k",
            transform=band,
            clip_on=False,
        )
        for i in np.flatnonzero(np.diff(passes)) + 1:
            ax.axvline(i - 0.5, color="0.5", ls=":", lw=0.8)
        for p in dict.fromkeys(passes.tolist()):
            start = int(np.argmax(passes == p))
            ax.text(start, 1.01, f"pass {p}", transform=band, fontsize=7, va="bottom")
        ax.set_xlim(-1, max(len(df), 1))
        ax.set_xlabel("entry in the reference's execution order (L = layer)", fontsize=8)

    def row(self, div) -> float:
        """The x position of a divergence (NaN when it is not in the table)."""
        if div is None:
            return math.nan
        df = self.table
        hit = np.flatnonzero(
            (df["pass"].to_numpy() == div.pass_)
            & (df["rank"].to_numpy() == div.rank)
            & (df["key"].to_numpy() == div.key)
        )
        return float(hit[0]) if len(hit) else math.nan

    def draw(self, metric, threshold, div, selected: float = math.nan, verdict=None) -> None:
        """Show ``metric`` (a :class:`~tdinspect.numerics.metrics.Metric`) at ``threshold``: one
        number (a line across), or one per row (``"auto"``: a step line along the rows)."""
        ax, df, x = self.ax, self.table, self.x
        sc = scale(metric.name)
        y = df[metric.name].to_numpy(dtype=float)
        structural = df["structural"].to_numpy(dtype=bool)
        nan = np.isnan(y) & ~structural
        shown = np.isfinite(y) & ((y > 0) if sc.log else True)
        zero = (y == 0) if sc.log else np.zeros_like(shown)
        inf = np.isinf(y) & (y > 0)
        bad_band = 0.97 if metric.higher_is_worse else 0.03
        ax.set_yscale("log" if sc.log else "linear")
        if not sc.log:  # no "1e-6+9.9999e-1" offset over the labels: each tick written in full
            from matplotlib.ticker import ScalarFormatter

            ax.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))
        self.line.set_data(x, np.where(shown, y, np.nan))
        self.line.set_label(metric.name)
        for artist, mask, at in (
            (self.zeros, zero, 0.03),
            (self.inf, inf, 0.97),
            (self.struct, structural, bad_band),
            (self.missing, nan, bad_band),
        ):
            artist.set_data(x[mask], np.full(mask.sum(), at))
            artist.set_visible(bool(mask.any()))
        per_row = np.ndim(threshold) > 0
        thr_line = self.thr_rows if per_row else self.thr
        self.thr.set_visible(not per_row)
        self.thr_rows.set_visible(per_row)
        if per_row:
            threshold = np.asarray(threshold, float)
            self.thr_rows.set_data(x, threshold)
            text = "auto, per entry"
        else:
            self.thr.set_ydata([threshold, threshold])
            text = sc.text(threshold)
        # two lines: the legend stays inside the figure's right margin
        thr_line.set_label(f"threshold {text}\n({'above' if metric.higher_is_worse else 'below'} diverges)")
        self.first.set_xdata([self.row(div)] * 2)
        self.selected.set_xdata([selected, selected])
        thr_values = np.atleast_1d(threshold)
        values = np.append(
            y[shown], thr_values[np.isfinite(thr_values) & ((thr_values > 0) if sc.log else True)]
        )
        if sc.log:  # whole decades: a threshold moved inside them keeps the axis (and its pixels)
            lo = 10.0 ** math.floor(math.log10(values[values > 0].min() / 2))
            hi = 10.0 ** math.ceil(math.log10(values.max() * 2))
        else:
            pad = max(float(values.max() - values.min()) * 0.08, 1e-9)
            lo, hi = values.min() - pad, values.max() + pad
        ax.set_ylim(lo, hi)
        ax.set_ylabel(metric.name)
        handles = [
            a
            for a in (
                self.line,
                self.zeros,
                self.inf,
                self.struct,
                self.missing,
                self.thr,
                self.thr_rows,
                self.first,
                self.selected,
            )
            if a.get_visible() and not (a in (self.first, self.selected) and np.isnan(a.get_xdata()[0]))
        ]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
        if div is not None:
            title = f"first divergence: {div.key} (pass {div.pass_}) — {div.reason}"
        elif verdict is not None and verdict.outcome == "incomplete":
            title = f"incomplete: {verdict.uncompared} entries set aside or never compared"
        else:
            title = "no divergence"
        ax.set_title(_plain(title), fontsize=9, pad=14)
        self.static_key = (metric.name, ax.get_ylim(), hash(y.tobytes()), hash(structural.tobytes()))


def divergence(
    diff,
    metric: str | None = None,
    threshold: float | None = None,
    *,
    pass_: int | None = None,
    rank: int | None = None,
    ax=None,
):
    """A metric along the reference's execution order, threshold line, first divergence marked.

    Exact zeros (identical entries) are marked on a band at the bottom,
    structural divergences and entries never compared on a band at the bad
    side, each with a legend entry; the x axis is labelled with the layers
    and passes.

    Parameters
    ----------
    diff : Diff
    metric : str, optional
        Default: the diff's (``rel_diff``).
    threshold : "auto", float or dict, optional
        Default ``"auto"``: each entry's from its dtypes (drawn as a step
        line); see :meth:`tdinspect.compare.diff.Diff.first_divergence`.
    pass_, rank : int, optional
        Restrict to one pass / rank (default: all, pass after pass).
    ax : matplotlib Axes, optional

    Returns
    -------
    matplotlib.figure.Figure
    """
    from tdinspect.numerics.metrics import metric as get_metric

    m = get_metric(diff.default_metric if metric is None else metric)
    df = sorted_table(diff)
    if pass_ is not None:
        df = df[df["pass"] == pass_]
    if rank is not None:
        df = df[df["rank"] == rank]
    df = df.reset_index(drop=True)
    if ax is None:
        fig, ax = _plt().subplots(figsize=(11, 3.8))
        fig.subplots_adjust(**DIVERGENCE_MARGINS)
    else:
        fig = ax.figure
    verdict = diff.verdict(threshold, m.name)  # the diff's spec: structural mode, allowed entries
    DivergencePlot(df, ax).draw(
        m, drawn_threshold(diff, threshold, m.name, df), verdict.divergence, verdict=verdict
    )
    return fig


def drawn_threshold(diff, threshold, metric_name: str, table):
    """The threshold as drawn: one number when one was given, else one per row of ``table``
    (the diff's own rule: its spec's threshold, a baseline's budget)."""
    t = diff.thresholds(threshold, metric_name)
    return t.fixed if t.fixed is not None else t.of_rows(table)


def sorted_table(diff):
    """The diff's table in the order the divergence plot uses (pass, order, rank)."""
    return diff.table(progress=False).sort_values(["pass", "order", "rank"]).reset_index(drop=True)


def _zero_missing_image(ax, grid: np.ndarray, log_scale: bool, cmap: str = "viridis"):
    """``imshow`` a grid where exact zeros get their own colour and missing cells a hatch, with a legend."""
    import matplotlib as mpl
    from matplotlib.patches import Patch

    # missing: transparent over a hatched background; exact zero: the "under" colour
    cm = mpl.colormaps[cmap].with_extremes(bad=(0, 0, 0, 0), under="black")
    zero = grid == 0
    if log_scale:
        with np.errstate(divide="ignore", invalid="ignore"):
            shown = np.log10(np.where(grid > 0, grid, np.nan))
    else:
        shown = grid.astype(float).copy()
    finite = shown[np.isfinite(shown)]
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if vmax - vmin < 1e-12:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    if log_scale:
        shown = np.where(zero, vmin - 1, shown)  # below the colour range: drawn in the "under" colour
    ax.patch.set_hatch("///")
    ax.patch.set_edgecolor("0.6")
    im = ax.imshow(
        np.ma.masked_invalid(shown), aspect="auto", cmap=cm, vmin=vmin, vmax=vmax, interpolation="nearest"
    )
    handles = [Patch(facecolor="none", edgecolor="0.6", hatch="///", label="missing")]
    if log_scale and zero.any():
        handles.insert(0, Patch(facecolor="black", label="exactly 0"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.25, 1.0), fontsize=7, frameon=False)
    return im


def heatmap(source, variable: str | None = None, *, pass_: int = 0, call: int = 0, ax=None):
    """A layer × leaf heatmap of a statistic (DumpSet) or metric (Diff).

    Entries without a layer index (embeddings, heads) are left out. Exact
    zeros are drawn in black ("exactly 0") and missing cells hatched
    ("missing"), each in the legend.
    """
    from tdinspect.compare.diff import Diff
    from tdinspect.naming import split_module_path

    plt = _plt()
    if isinstance(source, Diff):
        variable = source.default_metric if variable is None else variable
        df = source.table(progress=False)
    else:
        variable = variable or "absmax"
        df = source.entries(progress=False)
    df = df[(df["pass"] == pass_) & (df["call"] == call)]
    names, values = df["op"].tolist(), df[variable].to_numpy(dtype=float)
    cells: dict[tuple[int, str], float] = {}
    for name, v in zip(names, values):
        _, layer, leaf = split_module_path(name.split("/")[0])
        if layer >= 0:
            leaf = leaf + ("/" + name.split("/", 1)[1] if "/" in name else "")
            cells[(layer, leaf)] = v
    layers = sorted({k[0] for k in cells})
    leaves = list(dict.fromkeys(k[1] for k in cells))
    grid = np.full((len(layers), len(leaves)), np.nan)
    for (layer, leaf), v in cells.items():
        grid[layers.index(layer), leaves.index(leaf)] = v
    fig, ax = (
        (ax.figure, ax)
        if ax is not None
        else plt.subplots(figsize=(max(5, 0.5 * len(leaves) + 3.5), max(2.5, 0.35 * len(layers) + 1.5)))
    )
    log_scale = variable in ("absmax", "l2") or (variable in _SCALES and scale(variable).log)
    im = _zero_missing_image(ax, grid, log_scale)
    ax.set_xticks(range(len(leaves)), [_plain(v) for v in leaves], rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(layers)), [f"layer {n}" for n in layers], fontsize=8)
    ax.set_xlabel("module inside the layer", fontsize=8)
    fig.colorbar(im, ax=ax, label=f"log10 {variable}" if log_scale else variable)
    ax.set_title(f"{variable}, pass {pass_}, call {call}", fontsize=9)
    fig.tight_layout()
    return fig


def _as_2d(t, limit: int = 256) -> tuple[np.ndarray, bool]:
    """A 2-D float view for heatmaps (rows are everything but the last dim), strided down to
    ``limit`` × ``limit`` for drawing; returns ``(array, strided)``."""
    t = t.detach()
    if t.is_complex():
        t = t.abs()
    t = t.reshape(1, 1) if t.dim() == 0 else (t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1))
    sr, sc = max(1, -(-t.shape[0] // limit)), max(1, -(-t.shape[1] // limit))
    return t[::sr, ::sc].to(dtype=torch.float32).numpy(), sr * sc > 1


def _label_image(ax, strided: bool) -> None:
    ax.set_xlabel("last dim" + (" (strided)" if strided else ""), fontsize=8)
    ax.set_ylabel("other dims, flattened", fontsize=8)


class SideBySide:
    """The side-by-side figure's artists, made once; :meth:`update` swaps the tensors in.

    Re-drawing into the same axes (image data, colour limits, histogram
    steps, texts) instead of building six axes and colour bars again keeps
    a new entry cheap. What a new entry changes is :meth:`dynamic` (images,
    colour bars, histograms, texts); the heatmaps' frames, ticks and labels
    are the same while :attr:`static_key` is, so a view can keep their
    pixels. The heatmaps' ticks and labels (which follow the tensor's shape)
    are dynamic too: an entry of a shape not drawn before draws a dozen tick
    labels on the kept frames, not the whole figure.
    """

    def __init__(self, fig):
        self.fig = fig
        from matplotlib.ticker import MaxNLocator

        fig.clear()
        axes = fig.subplots(2, 3)
        fig.subplots_adjust(left=0.06, right=0.97, bottom=0.09, top=0.88, wspace=0.42, hspace=0.5)
        self.axes = axes
        empty = np.zeros((1, 1))
        self.images: list = []
        self.colorbars: list = []
        self.static_key: tuple = ()
        for ax, name, cmap in (
            (axes[0, 0], "A (reference)", "RdBu_r"),
            (axes[0, 1], "B", "RdBu_r"),
            (axes[0, 2], "|A - B|", "magma"),
        ):
            im = ax.imshow(empty, aspect="auto", cmap=cmap, interpolation="nearest")
            ax.set_title(name, fontsize=9)
            self.images.append(im)
        # A and B share their colour limits: one colour bar for both (fewer labels to draw)
        for shown, beside, label in (
            (self.images[1], axes[0, :2], "value"),
            (self.images[2], axes[0, 2], "|A - B|"),
        ):
            cb = fig.colorbar(
                shown, ax=beside, label=label, fraction=0.04 if shown is self.images[1] else 0.15
            )
            cb.locator = MaxNLocator(5)
            self.colorbars.append(cb)
        h = axes[1, 0]
        self.hist_a = h.stairs([0], [0, 1], label="A")
        self.hist_b = h.stairs([0], [0, 1], label="B")
        h.legend(fontsize=8)
        h.set_title("values", fontsize=9)
        h.set_xlabel("value", fontsize=8)
        h.set_ylabel("elements", fontsize=8)
        d = axes[1, 1]
        self.hist_d = d.stairs([0], [0, 1], color="C3", fill=True)
        d.set_xlabel("log10 |A - B|", fontsize=8)
        d.set_ylabel("elements", fontsize=8)
        self.same = d.text(0.5, 0.5, "", ha="center", va="center", fontsize=10, transform=d.transAxes)
        axes[1, 2].axis("off")
        self.metrics = axes[1, 2].text(0, 1, "", va="top", family="monospace", fontsize=8)
        self.title = fig.suptitle("", fontsize=10)
        for ax in axes[1, :2]:  # a handful of ticks: each label is text drawn for every entry
            ax.xaxis.set_major_locator(MaxNLocator(5))
            ax.yaxis.set_major_locator(MaxNLocator(4))

    def dynamic(self) -> list:
        """What a new entry of the same shape redraws: images, colour bars, histograms, texts."""
        values, diffs = self.axes[1, 0], self.axes[1, 1]
        return [
            *self.images,
            *(spine for ax in self.axes[0] for spine in ax.spines.values()),  # drawn over the image edge
            *(axis for ax in self.axes[0] for axis in (ax.xaxis, ax.yaxis)),  # ticks follow the shape
            *(cb.ax for cb in self.colorbars),
            self.axes[0, 2].title,
            self.hist_a,
            self.hist_b,
            self.hist_d,
            self.same,
            diffs.title,
            *(axis for ax in (values, diffs) if ax.axison for axis in (ax.xaxis, ax.yaxis)),
            self.metrics,
            self.title,
        ]

    def update(self, a, b, title: str = "") -> None:
        """Show reference ``a`` and compared ``b`` (same shape)."""
        from tdinspect.numerics.metrics import compare_tensors

        xa, strided = _as_2d(a)
        xb, _ = _as_2d(b)
        d = np.abs(xa.astype(np.float64) - xb.astype(np.float64))
        both = np.concatenate([xa.ravel(), xb.ravel()])
        lim = float(np.nanmax(np.abs(both[np.isfinite(both)]), initial=0)) or 1.0
        dd = d.ravel()[np.isfinite(d.ravel())]
        identical = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        top = float(dd.max()) if dd.size and dd.max() > 0 else 1.0
        for im, data, lo, hi in zip(self.images, (xa, xb, d), (-lim, -lim, 0), (lim, lim, top)):
            im.set_data(data)
            im.set_extent((-0.5, data.shape[1] - 0.5, data.shape[0] - 0.5, -0.5))
            im.set_clim(lo, hi)
        for ax in self.axes[0]:
            _label_image(ax, strided)
        self.axes[0, 2].set_title("|A - B|" + (" (identical: 0 everywhere)" if identical else ""), fontsize=9)
        finite = np.isfinite(xa.ravel()) & np.isfinite(xb.ravel())
        va, vb = xa.ravel()[finite], xb.ravel()[finite]
        edges = np.histogram_bin_edges(np.concatenate([va, vb]) if va.size else [0.0, 1.0], bins=60)
        self.hist_a.set_data(np.histogram(va, edges)[0], edges)
        self.hist_b.set_data(np.histogram(vb, edges)[0], edges)
        self._fit(
            self.axes[1, 0],
            edges,
            max(self.hist_a.get_data().values.max(), self.hist_b.get_data().values.max()),
        )
        ax = self.axes[1, 1]
        nonzero = dd[dd > 0]
        if nonzero.size:
            counts, edges = np.histogram(np.log10(nonzero), bins=60)
            self.hist_d.set_data(counts, edges)
            self._fit(ax, edges, counts.max())
            ax.set_title(f"log10 |A - B| ({nonzero.size} of {dd.size} shown elements differ)", fontsize=9)
            self.same.set_text("")
        else:  # nothing to draw: say so, no made-up bar
            self.hist_d.set_data([0], [0, 1])
            ax.set_title("log10 |A - B|", fontsize=9)
            self.same.set_text(
                "A and B are identical\n(|A - B| = 0 everywhere)"
                if identical
                else "no element differs as a number\n(only the dtypes differ)"
            )
        ax.axis("on" if nonzero.size else "off")
        m = compare_tensors(b, a) if a.shape == b.shape else {}
        self.metrics.set_text(
            "\n".join(
                f"{k}: {value_text(k, v)}" for k, v in m.items() if isinstance(v, float) and not math.isnan(v)
            )
        )
        self.title.set_text(_plain(title))
        self.static_key = (bool(nonzero.size),)

    @staticmethod
    def _fit(ax, edges, top) -> None:
        ax.set_xlim(edges[0], edges[-1] if edges[-1] > edges[0] else edges[0] + 1)
        ax.set_ylim(0, max(float(top), 1.0) * 1.05)


def side_by_side(a, b, *, title: str = "", fig=None):
    """A, B and ``|A − B|`` of one tensor (heatmaps of its 2-D view), and histograms.

    Identical tensors are said to be identical (no made-up bar for a
    difference that does not exist). Every axis is labelled.

    Parameters
    ----------
    a, b : torch.Tensor
        Reference and compared tensor (same shape).
    fig : matplotlib Figure, optional
        Drawn into (cleared first).

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig = fig or _plt().figure(figsize=(12, 5.8))
    SideBySide(fig).update(a, b, title)
    return fig


class TensorView:
    """The DumpSet explorer's figure (heatmap and histogram of one tensor), made once;
    :meth:`update` swaps a tensor in: image data, colour limits, histogram, texts."""

    def __init__(self, fig):
        from matplotlib.ticker import MaxNLocator

        self.fig = fig
        fig.clear()
        self.heat, self.hist = fig.subplots(1, 2)
        fig.subplots_adjust(left=0.08, right=0.97, bottom=0.16, top=0.8, wspace=0.45)
        self.image = self.heat.imshow(np.zeros((1, 1)), aspect="auto", cmap="RdBu_r", interpolation="nearest")
        self.colorbar = fig.colorbar(self.image, ax=self.heat, label="value")
        self.static_key: tuple = ()
        self.bars = self.hist.stairs([0], [0, 1], fill=True)
        self.hist.set_xlabel("value", fontsize=8)
        self.hist.set_ylabel("elements", fontsize=8)
        self.hist.set_title("histogram (finite values)", fontsize=9)
        self.hist.xaxis.set_major_locator(MaxNLocator(5))
        self.hist.yaxis.set_major_locator(MaxNLocator(4))
        self.title = fig.suptitle("", fontsize=10)

    def dynamic(self) -> list:
        """What another tensor of the same shape redraws (as :meth:`SideBySide.dynamic`)."""
        return [
            self.image,
            *self.heat.spines.values(),
            self.heat.xaxis,  # its ticks and labels follow the tensor's shape
            self.heat.yaxis,
            self.heat.title,
            self.colorbar.ax,
            self.bars,
            self.hist.xaxis,
            self.hist.yaxis,
            self.title,
        ]

    def update(self, t, title: str = "") -> tuple:
        """Show tensor ``t`` under ``title``; returns what :meth:`show` takes to show it again
        (its 2-D view, at most 256 × 256, not the tensor)."""
        x, strided = _as_2d(t)
        drawn = (x, strided, tuple(t.shape), title)
        self.show(*drawn)
        return drawn

    def show(self, x: np.ndarray, strided: bool, shape: tuple, title: str = "") -> None:
        """Show a 2-D view ``x`` (from :func:`_as_2d`) of a tensor of ``shape``."""
        finite = x[np.isfinite(x)]
        lim = float(np.abs(finite).max(initial=0)) or 1.0
        self.image.set_data(x)
        self.image.set_extent((-0.5, x.shape[1] - 0.5, x.shape[0] - 0.5, -0.5))
        self.image.set_clim(-lim, lim)
        _label_image(self.heat, strided)
        self.heat.set_title(f"values {list(shape)}", fontsize=9)
        edges = np.histogram_bin_edges(finite if finite.size else [0.0, 1.0], bins=60)
        counts = np.histogram(finite, edges)[0]
        self.bars.set_data(counts, edges)
        SideBySide._fit(self.hist, edges, counts.max(initial=0))
        self.title.set_text(_plain(title))
        self.static_key = ()  # nothing else changes: every tensor is drawn on the kept frame


def tensor(t, *, title: str = "", fig=None):
    """Heatmap and histogram of one tensor (the DumpSet explorer's view), axes labelled."""
    fig = fig or _plt().figure(figsize=(10, 3.5))
    TensorView(fig).update(t, title)
    return fig


def rank_pass(diff, metric: str | None = None, threshold=None, ax=None):
    """Which ranks and steps part first: worst metric per (rank, pass), divergent cells outlined.

    The colour scale spans at least a decade (log metrics) around the data
    and the threshold, so a tiny spread is not blown up into the full
    colour range; exact zeros and missing cells are marked as such.

    Returns
    -------
    matplotlib.figure.Figure
    """
    from tdinspect.numerics.metrics import metric as get_metric

    plt = _plt()
    m = get_metric(diff.default_metric if metric is None else metric)
    by = diff.by_rank_pass(threshold, m.name)
    thrs = np.unique(np.atleast_1d(drawn_threshold(diff, threshold, m.name, diff.table(progress=False))))
    ranks = sorted({r for r, _ in by.index})
    passes = sorted({p for _, p in by.index})
    grid = np.full((len(ranks), len(passes)), np.nan)
    bad = np.zeros_like(grid, dtype=bool)
    for (r, p), row in by.iterrows():
        grid[ranks.index(r), passes.index(p)] = row["worst"]
        bad[ranks.index(r), passes.index(p)] = row["n_divergent"] > 0
    fig, ax = (
        (ax.figure, ax)
        if ax is not None
        else plt.subplots(figsize=(max(5, 0.4 * len(passes) + 3.5), max(2, 0.4 * len(ranks) + 1.5)))
    )
    log_scale = scale(m.name).log
    im = _zero_missing_image(ax, grid, log_scale)
    lo, hi = im.get_clim()
    ts = [math.log10(t) if log_scale and t > 0 else t for t in thrs if math.isfinite(t)]
    if log_scale and ts:  # at least one decade, and the thresholds inside the range
        lo, hi = min(lo, min(ts) - 0.5), max(hi, max(ts) + 0.5)
        if hi - lo < 1:
            mid = (hi + lo) / 2
            lo, hi = mid - 0.5, mid + 0.5
        im.set_clim(lo, hi)
    ys, xs = np.nonzero(bad)
    ax.scatter(xs, ys, marker="s", s=120, facecolors="none", edgecolors="red", label="diverges")
    ax.set_xticks(range(len(passes)), passes, fontsize=8)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks], fontsize=8)
    ax.set_xlabel("pass (step)")
    cb = fig.colorbar(im, ax=ax, label=f"{'log10 ' if log_scale else ''}worst {m.name}")
    for t in ts:  # one line per threshold ("auto": one per dtype pair)
        if lo <= t <= hi:
            cb.ax.axhline(t, color="C1", lw=1.5)
    first = by[by["n_divergent"] > 0].sort_index(level=["pass", "rank"])
    title = (
        "no divergence"
        if first.empty
        else (f"first: rank {first.index[0][0]}, pass {first.index[0][1]}: {first.iloc[0]['first']}")
    )
    ax.set_title(_plain(title), fontsize=9)
    fig.tight_layout()
    return fig


def per_position(diff, dim: int | str = 1, keys=None, metric: str | None = None, threshold=None, *, ax=None):
    """Entries × positions: the metric of each entry along ``dim``, first divergent position marked.

    Each row is :meth:`tdinspect.compare.diff.Diff.per_position` of one entry, reduced
    over passes and calls (and ranks) to its worst value; each row's first
    position past the threshold is marked, and the earliest of them is drawn
    as a line and written in the title ("diverges from position 16 on"), so a
    RoPE or KV-cache bug (error from the first decode token on) tells itself
    from a layer bug (error at every position) at a glance.

    Parameters
    ----------
    diff : Diff
    dim : int or str
        The position dim (or its dims name).
    keys : list of str, optional
        Entries (default: every entry both sides hold with one shape, in execution order).
    metric, threshold : optional
        Default: the diff's metric at ``"auto"`` (each entry's threshold from
        its dtypes).
    ax : matplotlib Axes, optional

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    >>> fig = tdinspect.plot.per_position(full.diff(decode, concat="call:1"), dim=1)  # doctest: +SKIP
    """
    from tdinspect.numerics.metrics import metric as get_metric

    plt = _plt()
    m = get_metric(diff.default_metric if metric is None else metric)
    if keys is None:
        table = diff.table(progress=False)
        table = table[~table["structural"]].sort_values(["pass", "order", "rank"])
        keys = list(dict.fromkeys(table["op"]))
    rows, names, thrs = [], [], []
    for key in keys:
        try:
            da = diff.per_position(key, dim=dim, metric=m.name, threshold=threshold)
        except (KeyError, ValueError):
            continue  # no such dim, or not held by both sides with one shape
        worst = da.max if m.higher_is_worse else da.min
        rows.append(worst([d for d in da.dims if d != "position"]).to_numpy())
        names.append(_plain(key))
        thrs.append(da.attrs["threshold"])
    if not rows:
        raise ValueError(f"no entry of this diff has a dim {dim!r} held by both sides")
    npos = max(len(r) for r in rows)
    grid = np.full((len(rows), npos), np.nan)
    for i, r in enumerate(rows):
        grid[i, : len(r)] = r
    thr = np.asarray(thrs, float)[:, None]  # each entry's own ("auto": from its dtypes)
    with np.errstate(invalid="ignore"):
        over = grid > thr if m.higher_is_worse else grid < thr
    log = scale(m.name).log
    fig, ax = (
        (ax.figure, ax)
        if ax is not None
        else plt.subplots(figsize=(min(14, 5 + 0.25 * npos), 1.5 + 0.22 * len(rows)))
    )
    im = _zero_missing_image(ax, grid, log)
    fig.colorbar(im, ax=ax, label=f"log10 {m.name}" if log else m.name)
    firsts = [int(np.flatnonzero(o)[0]) if o.any() else -1 for o in over]
    for i, f in enumerate(firsts):
        if f >= 0:
            ax.plot(f, i, marker="x", color="red", ms=7, mew=2)
    start = min((f for f in firsts if f >= 0), default=-1)
    if start >= 0:
        ax.axvline(start - 0.5, color="red", ls="--", lw=1)
        verdict = f"diverges from position {start} on"
    else:
        verdict = "no position past the threshold"
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel(f"position along dim {dim}")
    given = _plain(diff.thresholds(threshold, m.name).given())  # a dict's regexes are the user's
    ax.set_title(f"{m.name} per position (threshold {given}): {verdict}")
    fig.tight_layout()
    return fig
