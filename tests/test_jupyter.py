"""Views: widget callbacks (no browser), plots, and the magics in a real IPython kernel."""

from __future__ import annotations

import matplotlib
import nbformat
import pytest
from nbclient import NotebookClient

import tdinspect
from tdinspect import DumpSet

from .conftest import ROOT

matplotlib.use("Agg")


def test_diff_explorer_threshold_moves_the_marker(runs):
    diff = DumpSet.open(runs["ref"]).diff(runs["bf16"])
    early, late = diff.first_divergence(1e-7), diff.first_divergence(1e-5)
    assert early.order < late.order  # bf16 error grows along the network
    ex = tdinspect.explore(diff, threshold=1e-7)
    assert ex.divergence.key == early.key and early.key in ex.label.value
    marker_before = list(ex.ax.lines[-1].get_xdata())
    ex.threshold.value = 1e-5  # the callback runs as it would from the browser
    assert ex.divergence.key == late.key and late.key in ex.label.value
    assert list(ex.ax.lines[-1].get_xdata()) != marker_before
    assert list(ex.ax.lines[-2].get_ydata()) == [1e-5, 1e-5]
    ex.threshold.value = 10.0
    assert ex.divergence is None and "no divergence" in ex.label.value
    wrong = tdinspect.explore(DumpSet.open(runs["ref"]).diff(runs["wrong"]))
    wrong.metric.value = "cosine"
    wrong.threshold.value = 0.99999
    assert wrong.divergence.key == "model.layers.2.mlp.down"
    wrong.entry.value = "model.lm_head"  # picking an entry shows the side-by-side view
    assert wrong.shown == "model.lm_head" and wrong.view_fig._suptitle.get_text() == "model.lm_head"


def test_dumpset_explorer_search_and_sliders(runs):
    ex = tdinspect.explore(DumpSet.open(runs["ref"]))
    ex.search.value = r"expert"
    assert list(ex.op.options) == ["model.expert"]
    ex.call.value = 2
    ex.pass_.value = 1
    assert "model.expert::call2" in ex.stats.value
    assert ex.fig.axes  # the heatmap and histogram were drawn into the one figure
    with pytest.raises(TypeError, match="DumpSet or a Diff"):
        tdinspect.explore(42)


def test_plots_return_figures(runs):
    diff = DumpSet.open(runs["ref"]).diff(runs["wrong"])
    fig = tdinspect.plot.divergence(diff, threshold=1e-3)
    assert "model.layers.2.mlp.down" in fig.axes[0].get_title()
    hm = tdinspect.plot.heatmap(diff)
    assert "layer 3" in [t.get_text() for t in hm.axes[0].get_yticklabels()]
    a = diff.a.tensor("model.layers.2.mlp.down")
    b = diff.b.tensor("model.layers.2.mlp.down")
    sbs = tdinspect.plot.side_by_side(a, b, title="down")
    assert len(sbs.axes) >= 6


def test_magics_in_a_real_kernel(runs, tmp_path):
    nb = nbformat.v4.new_notebook()
    cells = [
        "%load_ext tdinspect\n%load_ext tdinspect",
        f"%tdi_open ref {runs['ref']}\nprint(type(ref).__name__, ref.passes)",
        f"div = %tdi_diff ref {runs['wrong']} --as d\nprint(div.key, type(d).__name__)",
        "%tdi_open broken /no/such/dump",
        "import torch\nfrom tdinspect.examples import make_model, make_tokens\n"
        "m = make_model(); x = make_tokens()",
        f"%%tdi_capture {tmp_path / 'cap'} --model m --filter lm_head\nm(x)",
        f"%%tdi_capture {tmp_path / 'cap'} --model m --filter lm_head\nm(x)",
        f"%%tdi_capture {tmp_path / 'ops'} --ops\ntorch.ones(2) * 3",
        "print(get_ipython().magics_manager.magics['line']['tdi_diff'].__doc__)",
        "%unload_ext tdinspect",
        "%tdi_open again /x",
        # the explorer under ipympl (interactive canvas widget) as well as the inline backend
        f"%matplotlib widget\nimport tdinspect\nex = tdinspect.explore(tdinspect.DumpSet.open("
        f"'{runs['ref']}').diff('{runs['bf16']}'), threshold=1e-5)\nfirst = ex.divergence.key\n"
        f"ex.threshold.value = 1e-7\nprint(type(ex.fig.canvas).__name__, first != ex.divergence.key)",
    ]
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(ROOT)}}).execute()

    def text(i):
        return "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                       + "".join(o.get("traceback", [])) for o in nb.cells[i].outputs)

    assert "Error" not in text(0)  # loading twice is harmless (IPython just says it is loaded)
    assert "DumpSet [0, 1, 2]" in text(1)
    assert "model.layers.2.mlp.down Diff" in text(2)
    assert text(3).startswith("tdinspect: DumpFormatError") and "Traceback" not in text(3)
    assert "pass00000.pt" in text(5) and "pass00001.pt" in text(6)
    assert "pass00000.pt" in text(7)
    assert "--threshold" in text(8) and "--metric" in text(8)  # help from magic_arguments
    assert "UsageError" in text(10) or "not found" in text(10)
    assert "Canvas True" in text(11) and "Error" not in text(11)
    assert DumpSet.open(tmp_path / "cap").passes == [0, 1]
    assert DumpSet.open(tmp_path / "ops").ops == ["model/aten.ones.default[out0]",
                                                  "model/aten.mul.Tensor[out0]"]
