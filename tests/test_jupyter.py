"""Views: widget callbacks (no browser), plots, and the magics in a real IPython kernel."""

from __future__ import annotations

import matplotlib
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

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


def _run(cells, allow_errors=True):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=allow_errors,
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    return nb


def _text(cell) -> str:
    return "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                   + str(o.get("data", {}).get("text/html", ""))
                   + (f"{o['ename']}: {o['evalue']}" if "ename" in o else "") for o in cell.outputs)


def test_magics_in_a_real_kernel(runs, tmp_path):
    cells = [
        "%load_ext tdinspect\n%load_ext tdinspect",
        f"%tdi_open ref {runs['ref']}\nprint(type(ref).__name__, ref.passes)",
        f"%tdi_diff ref {runs['wrong']} --as d\nprint(type(d).__name__)",
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
    nb = _run(cells)

    def text(i):
        return _text(nb.cells[i])

    assert "Error" not in text(0)  # loading twice is harmless (IPython just says it is loaded)
    assert "DumpSet [0, 1, 2]" in text(1)
    assert "model.layers.2.mlp.down" in text(2) and "Diff" in text(2)
    assert "UsageError" in text(3) and "no such file or folder" in text(3)
    assert "pass00000.pt" in text(5) and "pass00001.pt" in text(6)
    assert "pass00000.pt" in text(7)
    assert "--threshold" in text(8) and "--metric" in text(8)  # help from magic_arguments
    assert "UsageError" in text(10) or "not found" in text(10)
    assert "Canvas True" in text(11) and "Error" not in text(11)
    assert DumpSet.open(tmp_path / "cap").passes == [0, 1]
    assert DumpSet.open(tmp_path / "ops").ops == ["model/aten.ones.default[out0]",
                                                  "model/aten.mul.Tensor[out0]"]


def test_magic_errors_stop_run_all_and_say_what_was_looked_up(runs, tmp_path):
    ref, wrong = runs["ref"], runs["wrong"]
    cells = [
        "%load_ext tdinspect",
        f"%%tdi_capture {tmp_path / 'cap'} --model nosuch\n1 + 1",
        f"%tdi_diff {ref} nosuchvar",
        "number = 3",
        f"%tdi_diff {ref} number",
        f"%tdi_diff {ref} {wrong} --metric nosuchmetric",
        f"%tdi_diff {ref} {wrong} --threshold lots",
        f"%tdi_open ds {ref}\nds.tensor('model.layers.2.mlp.dwn')",
    ]
    nb = _run(cells)
    # IPython prints a UsageError as one stderr line (no traceback); other errors as error outputs
    errors = ["".join(o.get("text", "") for o in c.outputs if o.get("name") == "stderr")
              + "".join(f"{o['ename']}: {o['evalue']}" for o in c.outputs
                        if o.get("output_type") == "error") for c in nb.cells]
    assert errors[0] == "" and errors[3] == ""
    assert errors[1].startswith("UsageError: no variable `nosuch` in the notebook")
    assert not (tmp_path / "cap").exists()  # nothing was captured for a failed lookup
    assert errors[2].startswith("UsageError: `nosuchvar` is neither a variable in the notebook "
                                "nor a folder")
    assert errors[4].startswith("UsageError: `number` is a int, not a DumpSet")
    assert errors[5].startswith("UsageError") and "nosuchmetric" in errors[5]
    assert "rel_diff" in errors[5]  # the known metrics are listed
    assert errors[6].startswith("UsageError") and "lots" in errors[6]
    assert errors[7].startswith("KeyError") and "did you mean 'model.layers.2.mlp.down'" in errors[7]
    # Run All (errors not allowed) stops at the failing magic: later cells never run
    stop = [f"%load_ext tdinspect\n%tdi_open ds {tmp_path / 'missing'}", "after = 1"]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in stop]
    with pytest.raises(CellExecutionError, match="no such file or folder"):
        NotebookClient(nb, timeout=120, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT)}}).execute()
    assert nb.cells[1].outputs == [] and nb.cells[1].get("execution_count") is None


def test_tdi_diff_shows_one_summary_that_honours_its_flags(runs):
    cells = [
        "%load_ext tdinspect",
        f"%tdi_diff {runs['ref']} {runs['wrong']}",
        f"%tdi_diff {runs['ref']} {runs['wrong']} --metric cosine --threshold 0.5",
        f"%tdi_diff {runs['ref']} {runs['bf16']} --threshold 1e-7 --as bf",
        "bf.first_divergence(1e-7).key",
    ]
    nb = _run(cells, allow_errors=False)
    default, loose, bf = (nb.cells[i].outputs for i in (1, 2, 3))
    assert len(default) == 1 and default[0]["output_type"] == "display_data"  # once, not twice
    html = default[0]["data"]["text/html"]
    assert html.count("model.layers.2.mlp.down") == 2  # named in the heading and in its table row
    assert "metric: rel_diff" in html and "first divergence" in html
    html = loose[0]["data"]["text/html"]
    assert len(loose) == 1 and "no divergence" in html and "metric: cosine" in html and "0.5" in html
    key = nb.cells[4].outputs[0]["data"]["text/plain"].strip("'")
    assert len(bf) == 1 and key in bf[0]["data"]["text/html"] and "1e-07" in bf[0]["data"]["text/html"]


def test_entry_names_complete_inside_tensor_call(runs):
    cells = [
        f"%load_ext tdinspect\n%tdi_open ds {runs['ref']}",
        "from IPython.core.completer import provisionalcompleter\n"
        "code = \"ds.tensor('model.layers.2.ml\"\n"
        "with provisionalcompleter():\n"
        "    found = list(get_ipython().Completer.completions(code, len(code)))\n"
        "print(sorted({code[:c.start] + c.text for c in found}))",
    ]
    nb = _run(cells, allow_errors=False)
    out = _text(nb.cells[1])
    assert "ds.tensor('model.layers.2.mlp.down\"" in out and "ds.tensor('model.layers.2.mlp.up\"" in out
    assert "model.layers.1" not in out
