"""How the views draw: only what an interaction changes, once per picture; and laid out to fit.

Counted draws, not timed ones (speed lives in ``bench/explorer.py``); layouts read from the
drawn artists' boxes, on the sample model and a 32-layer Hugging Face Llama.
"""

from __future__ import annotations

import asyncio
import io

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch

import tdinspect
from tdinspect import DumpSet

matplotlib.use("Agg")


@pytest.fixture
def full_draws(monkeypatch):
    """How many full figure draws (every tick and label) the Agg canvas made."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    calls = []
    real = FigureCanvasAgg.draw

    def counted(self, *args, **kwargs):
        calls.append(self.figure)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FigureCanvasAgg, "draw", counted)
    return calls


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    """One pass of a 32-layer tiny-width HF Llama, and the same with layer 7's MLP 1% off."""
    pytest.importorskip("transformers")
    from tdinspect.examples.port import make_hf_llama

    root = tmp_path_factory.mktemp("llama32")
    for name, scale in (("a", 1.0), ("b", 1.01)):
        model = make_hf_llama(0, num_hidden_layers=32)
        with torch.no_grad():
            model.model.layers[7].mlp.up_proj.weight.mul_(scale)
            with tdinspect.capture(model, root / name) as cap:
                model(torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0)))
                cap.step()
    return root / "a", root / "b"


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_a_threshold_move_or_a_pick_redraws_only_what_moved(runs, full_draws):
    ex = tdinspect.explore(DumpSet.open(runs["ref"]).diff(runs["wrong"]), threshold=2e-3)
    plot_draws = lambda: sum(f is ex.fig for f in full_draws)  # noqa: E731
    before = plot_draws()
    first = ex.artists.first.get_xdata()[0]
    ex.threshold.value = 5e-3  # inside the same decades of the y axis: its ticks stay
    ex.threshold.value = 3e-3
    row = next(v for _, v in ex.entry.options if v == "model.lm_head")
    ex.entry.value = row
    assert plot_draws() == before  # threshold line, markers and legend drawn on kept pixels
    assert list(ex.artists.thr.get_ydata()) == [3e-3, 3e-3] and ex.artists.first.get_xdata()[0] == first
    shown = _pixels(ex.plot.widget.value)
    full = _pixels(ex.plot.png())  # a full draw of the same state
    assert shown.shape == full.shape
    # the same picture; only where a moved artist crosses another can the drawing order differ
    assert (shown != full).any(axis=2).mean() < 0.001
    ex.metric.value = "cosine"  # another axis: drawn in full once
    assert plot_draws() == before + 2  # the full draw above, and this


def test_an_entry_of_the_same_shape_keeps_the_heatmaps_frames(runs, full_draws):
    ex = tdinspect.explore(DumpSet.open(runs["ref"]).diff(runs["wrong"]))
    keys = [v for _, v in ex.entry.options if ".mlp.up" in v or ".mlp.down" in v]
    shape = ex.diff.a.tensor(keys[0]).shape
    assert ex.diff.a.tensor(keys[1]).shape != shape == ex.diff.a.tensor(keys[2]).shape
    view_draws = lambda: sum(f is ex.view_fig for f in full_draws)  # noqa: E731
    ex.entry.value = keys[0]
    before = view_draws()
    ex.entry.value = keys[2]  # same layer type, another layer: same view shape
    assert view_draws() == before
    assert ex.view_fig._suptitle.get_text().startswith(keys[2])
    shown = _pixels(ex.view.widget.value)
    assert (shown != _pixels(ex.view.png())).any(axis=2).mean() < 0.001


def test_an_entry_of_a_new_shape_is_drawn_on_the_kept_frames(runs, full_draws):
    ex = tdinspect.explore(DumpSet.open(runs["ref"]).diff(runs["wrong"]))
    keys = [v for _, v in ex.entry.options if ".mlp.up" in v or ".mlp.down" in v]
    assert ex.diff.a.tensor(keys[1]).shape != ex.diff.a.tensor(keys[0]).shape
    view_draws = lambda: sum(f is ex.view_fig for f in full_draws)  # noqa: E731
    ex.entry.value = keys[0]
    before = view_draws()
    ex.entry.value = keys[1]  # another shape: its ticks and labels drawn on the kept frames
    assert view_draws() == before
    image = ex._sbs.images[0].get_array()
    assert image.shape == tuple(ex.diff.a.tensor(keys[1]).reshape(-1, image.shape[1]).shape)
    shown = _pixels(ex.view.widget.value)
    assert (shown != _pixels(ex.view.png())).any(axis=2).mean() < 0.001  # as a full draw


def test_dumpset_explorer_draws_a_new_shape_on_the_kept_frame(runs, full_draws):
    ds = DumpSet.open(runs["ref"])
    ex = tdinspect.explore(ds)
    shapes = {op: tuple(ds.tensor(op).shape) for op in ds.ops}
    other = next(op for op in ds.ops if shapes[op] != shapes[ex.op.value])
    before = sum(f is ex.fig for f in full_draws)
    ex.op.value = other  # another shape: its ticks, labels and title drawn on the kept frame
    assert sum(f is ex.fig for f in full_draws) == before
    assert ex._tensor_view.heat.get_title() == f"values {list(shapes[other])}"
    shown = _pixels(ex.view.widget.value)
    assert (shown != _pixels(ex.view.png())).any(axis=2).mean() < 0.001  # as a full draw


def test_a_threshold_move_recomputes_only_the_health_columns_it_changes(llama32, monkeypatch):
    from tdinspect.compare import entries
    from tdinspect.compare.tree import ModuleTree
    from tdinspect.numerics.metrics import metric

    ex = tdinspect.explore(DumpSet.open(llama32[0]).diff(llama32[1]))
    grown = []
    real = entries.growth
    monkeypatch.setattr(entries, "growth", lambda *a, **k: grown.append(a) or real(*a, **k))
    ex.threshold.value = 1e-2
    assert grown == []  # the error's growth does not depend on the threshold
    m, d = metric("rel_diff"), ex.diff
    full = entries.health(
        ex.table, m, d.thresholds(1e-2, m.name), d.allow_uncompared, d.diverging(ex.table, m.name, 1e-2)
    )
    pd.testing.assert_frame_equal(ex.overview.health, full)
    tree, fresh = ex.overview.tree.tree, ModuleTree(full, m.name)
    assert [(n.path, n.worst, n.diverging) for n in tree.root.walk()] == [
        (n.path, n.worst, n.diverging) for n in fresh.root.walk()
    ]
    grown.clear()
    ex.metric.value = "cosine"  # another metric: computed in full
    assert [name for _, name in grown] == ["cosine"]


def test_tree_rows_are_kept_by_position_not_made_per_node(llama32, monkeypatch):
    import ipywidgets as W

    from tdinspect.compare.tree import ModuleTree

    ex = tdinspect.explore(DumpSet.open(llama32[0]).diff(llama32[1]))
    panel, health = ex.overview.tree, ex.overview.health
    panel.set_tree(ModuleTree(health, "rel_diff"))
    panel.mark("model.model.layers.20.mlp.down_proj")  # layer 20 opened
    made = []

    class Counted(W.Button):
        def __init__(self, *a, **k):
            made.append(self)
            super().__init__(*a, **k)

    monkeypatch.setattr(W, "Button", Counted)
    panel.set_tree(ModuleTree(health, "rel_diff"))
    panel.mark("model.model.layers.25.mlp.down_proj")  # as many lines: layer 25's instead
    assert made == []
    lines = panel.tree.lines()
    buttons = [row.children[1] for row in panel.rows.children]
    assert [b.tooltip for b in buttons] == [n.path for n, _ in lines]
    assert [b.tooltip for b in buttons if b.button_style == "info"] == ["model.model.layers.25.mlp.down_proj"]
    mlp = next(b for b in buttons if b.tooltip == "model.model.layers.25.mlp")
    assert not ex.shown_at[0].startswith("model.model.layers.25.")
    mlp.click()  # a kept row clicks the node it shows now: its worst entry, side by side
    assert ex.shown_at[0].startswith("model.model.layers.25.mlp")


def test_dumpset_explorer_draws_each_pick_once_and_its_search_once_typing_pauses(runs):
    ds = DumpSet.open(runs["ref"])
    ex = tdinspect.explore(ds)
    reads, pictures = [], []
    real = ds.tensor
    ds.tensor = lambda *a, **k: reads.append(a) or real(*a, **k)
    ex.view.widget.observe(pictures.append, names="value")  # each new picture the browser gets
    ex.pass_.value = 1
    ex.pass_.value = 0  # drawn before: the kept picture, nothing read
    assert len(reads) == 1 and len(pictures) == 2 and ex._shown == (ex.op.value, 0, 0)
    ex.search_delay = 1.0

    async def type_then_wait():
        shown = len(pictures)
        for i in range(1, len("expert") + 1):
            ex.search.value = "expert"[:i]
            await asyncio.sleep(0)
        typing = len(pictures) - shown
        while ex._pending is not None:
            await asyncio.sleep(0.05)
        return typing, len(pictures) - shown

    typing, settled = asyncio.run(type_then_wait())
    assert typing == 0 and settled == 1  # no redraw per key; one when typing paused
    assert ex.op.value == "model.expert" and "model.expert" in ex.stats.value and len(reads) == 2
    ex.search.value = "embed"  # outside an event loop (a script): at once
    assert ex.op.value == "model.embed"


def test_x_labels_and_legend_fit_where_passes_meet(runs, llama32):
    for diff in (
        DumpSet.open(runs["ref"]).diff(runs["bf16"]),  # notebook 02's figure
        DumpSet.open(llama32[0]).diff(llama32[1]),
    ):
        fig = tdinspect.plot.divergence(diff)
        ax = fig.axes[0]
        renderer = fig.canvas.get_renderer()
        fig.draw(renderer)
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert len(boxes) > 5
        for left, right in zip(boxes, boxes[1:]):
            assert left.x1 <= right.x0  # no two labels overprint
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.x1 <= fig.bbox.x1  # the legend is inside the figure, not cut off


def test_views_fit_the_cell_and_name_whole_hf_entries(runs, llama32):
    board = tdinspect.dashboard(*llama32)
    ex = board.explorer
    assert board.widget.layout.width == "100%" and board.widget.layout.max_width == "100%"
    columns = board.widget.children[1].children
    assert sum(float(c.layout.width.rstrip("%")) for c in columns) <= 100
    assert all(box.layout.flex_flow == "row wrap" for box in (ex.controls(), ex.pickers()))
    assert "model.model.layers.31.mlp.up_proj" in [v for _, v in ex.entry.options]
    assert ex.entry.layout.width.endswith("%") and ex.entry.layout.min_width == "18em"


def test_ipympl_canvas_fits_the_cell_and_its_toolbar_is_beside_the_figure(runs):
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend()  # before ipympl's import, which selects itself
    pytest.importorskip("ipympl")
    plt.switch_backend("module://ipympl.backend_nbagg")
    try:
        ex = tdinspect.explore(DumpSet.open(runs["ref"]).diff(runs["wrong"]))
        for fig in (ex.fig, ex.view_fig):
            assert fig.canvas.toolbar_position == "right"  # not over the y label
            assert fig.get_figwidth() * fig.dpi <= 880  # the right panel is not clipped
        assert ex.plot.png()[:4] == b"\x89PNG"  # a picture of the live canvas, which stays live
        assert type(ex.fig.canvas).__module__.startswith("ipympl")
    finally:
        plt.close("all")
        plt.switch_backend(backend)
