"""Names from a dump reach HTML and matplotlib as text: escaped, never markup or mathtext."""

from __future__ import annotations

import io

import matplotlib
import pytest
import torch

import tdinspect
from tdinspect import DumpSet

matplotlib.use("Agg")

SCRIPT = "<img src=x onerror=alert(1)>"
MATH = "$_{a}^{b}^{c}$"  # mathtext refuses a double superscript: parsing it raises


class _Hostile(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module(SCRIPT, torch.nn.Linear(4, 4))
        self.add_module(MATH, torch.nn.Linear(4, 4))

    def forward(self, x):
        for child in self.children():
            x = child(x)
        return x


def _runs(tmp_path):
    for name, scale in (("a", 1.0), ("b", 1.5)):
        torch.manual_seed(0)
        model = _Hostile()
        with torch.no_grad():
            getattr(model, SCRIPT).weight.mul_(scale)  # the script-named layer diverges
            with tdinspect.capture(model, tmp_path / name) as dump:
                model(torch.ones(2, 4))
                dump.step()
    return DumpSet.open(tmp_path / "a"), DumpSet.open(tmp_path / "b")


def _drawn(fig) -> str:
    """Render the figure (mathtext is parsed at draw time) and return every text in it."""
    fig.savefig(io.BytesIO(), format="png")
    return " ".join(t.get_text() for t in fig.findobj(matplotlib.text.Text))


def _no_markup(html: str) -> None:
    assert SCRIPT not in html and "<img" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html


def test_diff_explorer_escapes_names_and_draws_them_literally(tmp_path):
    a, b = _runs(tmp_path)
    diff = a.diff(b)
    assert diff.first_divergence().key == f"model.{SCRIPT}"
    ex = tdinspect.explore(diff, threshold=1e-6)
    _no_markup(ex.label.value)
    _drawn(ex.fig)
    for key in (f"model.{SCRIPT}", f"model.{MATH}"):
        ex.show_entry(key)
        assert MATH not in ex.message.value or "$" in ex.message.value
        _drawn(ex.view_fig)
    _no_markup(diff._repr_html_())
    _no_markup(diff.first_divergence()._repr_html_())


def test_dumpset_explorer_and_repr_escape_names(tmp_path):
    a, _ = _runs(tmp_path)
    _no_markup(a._repr_html_())
    ex = tdinspect.explore(a)
    for op in (f"model.{SCRIPT}", f"model.{MATH}"):
        ex.op.value = op
        if op.endswith(SCRIPT):
            _no_markup(ex.stats.value)
        assert op.split(".", 1)[1].replace("$", r"\$") in _drawn(ex.fig) or MATH not in op
    ex.search.value = r"\$"
    assert [v for _, v in ex.op.options] == [f"model.{MATH}"]


@pytest.mark.parametrize("plot", ["divergence", "heatmap", "rank_pass"])
def test_plots_draw_hostile_names_as_text(tmp_path, plot):
    a, b = _runs(tmp_path)
    fig = (
        getattr(tdinspect.plot, plot)(a.diff(b), threshold=1e-6)
        if plot != "heatmap"
        else tdinspect.plot.heatmap(a.diff(b))
    )
    _drawn(fig)


def test_side_by_side_and_tensor_titles_are_literal():
    t = torch.arange(6.0).reshape(2, 3)
    assert MATH.replace("$", r"\$") in _drawn(tdinspect.plot.tensor(t, title=MATH))
    _drawn(tdinspect.plot.side_by_side(t, t + 1, title=MATH))


def test_per_position_plot_draws_names_literally(tmp_path):
    a, b = _runs(tmp_path)
    fig = tdinspect.plot.per_position(a.diff(b), dim=1)
    assert MATH.replace("$", r"\$") in _drawn(fig)  # mathtext would raise at draw time
