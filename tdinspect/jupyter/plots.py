"""Plots of dumps and diffs: plain matplotlib, each returns its figure.

Usable without widgets (``tdinspect.plot.divergence(diff)``), in scripts (the
demo writes a PNG) and by the widgets, which update the artists made here.

Examples
--------
>>> fig = tdinspect.plot.divergence(diff, threshold=1e-3)    # doctest: +SKIP
>>> fig.savefig("divergence.png")                            # doctest: +SKIP
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _plt():
    import matplotlib.pyplot as plt

    return plt


def divergence(diff, metric: str | None = None, threshold: float | None = None, *,
               pass_: int | None = None, rank: int | None = None, ax=None):
    """A metric along the reference's execution order, threshold line, first divergence marked.

    Parameters
    ----------
    diff : Diff
    metric : str, optional
        Default: the diff's (``rel_diff``).
    threshold : float, optional
        Default: the metric's default threshold.
    pass_, rank : int, optional
        Restrict to one pass / rank (default: all, pass after pass).
    ax : matplotlib Axes, optional

    Returns
    -------
    matplotlib.figure.Figure
    """
    from ..metrics import metric as get_metric

    plt = _plt()
    m = get_metric(metric or diff.default_metric)
    thr = m.default_threshold if threshold is None else threshold
    df = diff.table(progress=False)
    if pass_ is not None:
        df = df[df["pass"] == pass_]
    if rank is not None:
        df = df[df["rank"] == rank]
    df = df.sort_values(["pass", "order", "rank"]).reset_index(drop=True)
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(10, 3.5))
    y = df[m.name].to_numpy(dtype=float)
    x = np.arange(len(df))
    floor = _floor(y)
    ax.plot(x, np.where(np.isfinite(y) & (y > 0), y, floor), ".-", lw=0.8, ms=3, label=m.name)
    structural = df["structural"].to_numpy(dtype=bool)
    if structural.any():
        ax.plot(x[structural], np.full(structural.sum(), floor), "x", color="C3", label="structural")
    ax.axhline(thr, color="C1", ls="--", lw=1, label=f"threshold {thr:g}")
    if m.name not in ("equal",):
        ax.set_yscale("log")
    div = diff.first_divergence(thr, m.name)
    marker = ax.axvline(np.nan, color="C3", lw=1.2)
    label = ax.set_title("no divergence")
    if div is not None:
        hit = df.index[(df["pass"] == div.pass_) & (df["rank"] == div.rank) & (df["key"] == div.key)]
        if len(hit):
            marker.set_xdata([hit[0], hit[0]])
        label.set_text(f"first divergence: {div.key} (pass {div.pass_}) — {div.reason}")
    label.set_fontsize(9)
    ax.set_xlabel("entry, in the reference's execution order")
    ax.set_ylabel(m.name)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def _floor(y: np.ndarray) -> float:
    pos = y[np.isfinite(y) & (y > 0)]
    return float(pos.min() / 10) if pos.size else 1e-12


def heatmap(source, variable: str | None = None, *, pass_: int = 0, call: int = 0, ax=None):
    """A layer × leaf heatmap of a statistic (DumpSet) or metric (Diff).

    Entries without a layer index (embeddings, heads) are left out.
    """
    from ..diff import Diff
    from ..naming import split_module_path

    plt = _plt()
    if isinstance(source, Diff):
        variable = variable or source.default_metric
        df = source.table(progress=False)
        df = df[(df["pass"] == pass_) & (df["call"] == call)]
        names, values = df["op"].tolist(), df[variable].to_numpy(dtype=float)
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
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(
        figsize=(max(4, 0.5 * len(leaves) + 2), max(2.5, 0.35 * len(layers) + 1.5)))
    log_scale = variable in ("rel_diff", "max_abs", "mean_abs", "max_rel", "absmax", "l2")
    shown = np.log10(np.where(grid > 0, grid, np.nan)) if log_scale else grid
    im = ax.imshow(shown, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(leaves)), leaves, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(layers)), [f"layer {n}" for n in layers], fontsize=8)
    fig.colorbar(im, ax=ax, label=f"log10 {variable}" if log_scale else variable)
    ax.set_title(f"{variable}, pass {pass_}, call {call}", fontsize=9)
    fig.tight_layout()
    return fig


def _as_2d(t) -> np.ndarray:
    """A 2-D float view for heatmaps: rows are everything but the last dim."""
    t = t.detach()
    if t.is_complex():
        t = t.abs()
    a = t.to(dtype=torch.float32).numpy()
    if a.ndim == 0:
        return a.reshape(1, 1)
    return a.reshape(-1, a.shape[-1]) if a.ndim > 1 else a.reshape(1, -1)


def side_by_side(a, b, *, title: str = "", fig=None):
    """A, B and |A − B| of one tensor (heatmaps of its 2-D view), and histograms.

    Parameters
    ----------
    a, b : torch.Tensor
        Reference and compared tensor (same shape).
    """
    plt = _plt()
    xa, xb = _as_2d(a), _as_2d(b)
    fig = fig or plt.figure(figsize=(12, 5.5))
    fig.clear()
    axes = fig.subplots(2, 3)
    d = np.abs(xa.astype(np.float64) - xb.astype(np.float64))
    lim = float(np.nanmax(np.abs(np.concatenate([xa.ravel(), xb.ravel()])), initial=0)) or 1.0
    for ax, data, name, cmap, vmin in ((axes[0, 0], xa, "A (reference)", "RdBu_r", -lim),
                                       (axes[0, 1], xb, "B", "RdBu_r", -lim),
                                       (axes[0, 2], d, "|A - B|", "magma", 0)):
        im = ax.imshow(data, aspect="auto", cmap=cmap, vmin=vmin, vmax=lim if vmin else None,
                       interpolation="nearest")
        ax.set_title(name, fontsize=9)
        fig.colorbar(im, ax=ax)
    finite = np.isfinite(xa.ravel()) & np.isfinite(xb.ravel())
    axes[1, 0].hist([xa.ravel()[finite], xb.ravel()[finite]], bins=60, label=["A", "B"],
                    histtype="step")
    axes[1, 0].legend(fontsize=8)
    axes[1, 0].set_title("values", fontsize=9)
    dd = d.ravel()[np.isfinite(d.ravel())]
    axes[1, 1].hist(np.log10(dd[dd > 0]) if (dd > 0).any() else [0], bins=60, color="C3")
    axes[1, 1].set_title("log10 |A - B|" + ("" if (dd > 0).any() else " (identical)"), fontsize=9)
    axes[1, 2].axis("off")
    from ..metrics import compare_tensors

    m = compare_tensors(b, a) if a.shape == b.shape else {}
    axes[1, 2].text(0, 1, "\n".join(f"{k}: {v:.3g}" for k, v in m.items()
                                    if isinstance(v, float) and not math.isnan(v)),
                    va="top", family="monospace", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def tensor(t, *, title: str = "", fig=None):
    """Heatmap and histogram of one tensor (the DumpSet explorer's view)."""
    plt = _plt()
    x = _as_2d(t)
    fig = fig or plt.figure(figsize=(10, 3.5))
    fig.clear()
    ax1, ax2 = fig.subplots(1, 2)
    im = ax1.imshow(x, aspect="auto", cmap="RdBu_r", interpolation="nearest")
    fig.colorbar(im, ax=ax1)
    v = x.ravel()[np.isfinite(x.ravel())]
    ax2.hist(v, bins=60)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def rank_pass(diff, metric: str | None = None, threshold: float | None = None, ax=None):
    """Which ranks and steps part first: worst metric per (rank, pass), divergent cells outlined.

    Returns
    -------
    matplotlib.figure.Figure
    """
    from ..metrics import metric as get_metric

    plt = _plt()
    m = get_metric(metric or diff.default_metric)
    by = diff.by_rank_pass(threshold, m.name)
    ranks = sorted({r for r, _ in by.index})
    passes = sorted({p for _, p in by.index})
    grid = np.full((len(ranks), len(passes)), np.nan)
    bad = np.zeros_like(grid, dtype=bool)
    for (r, p), row in by.iterrows():
        grid[ranks.index(r), passes.index(p)] = row["worst"]
        bad[ranks.index(r), passes.index(p)] = row["n_divergent"] > 0
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(
        figsize=(max(4, 0.4 * len(passes) + 2), max(2, 0.4 * len(ranks) + 1.5)))
    shown = np.log10(np.where(grid > 0, grid, np.nan)) if m.higher_is_worse else grid
    im = ax.imshow(shown, aspect="auto", cmap="viridis")
    ys, xs = np.nonzero(bad)
    ax.scatter(xs, ys, marker="s", s=120, facecolors="none", edgecolors="red", label="diverges")
    ax.set_xticks(range(len(passes)), passes, fontsize=8)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks], fontsize=8)
    ax.set_xlabel("pass (step)")
    fig.colorbar(im, ax=ax, label=f"{'log10 ' if m.higher_is_worse else ''}worst {m.name}")
    first = by[by["n_divergent"] > 0].sort_index(level=["pass", "rank"])
    title = "no divergence" if first.empty else (
        f"first: rank {first.index[0][0]}, pass {first.index[0][1]}: {first.iloc[0]['first']}")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
