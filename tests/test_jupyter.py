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
    marker_before = list(ex.artists.first.get_xdata())
    ex.threshold.value = 1e-5  # the callback runs as it would from the browser
    assert ex.divergence.key == late.key and late.key in ex.label.value
    assert list(ex.artists.first.get_xdata()) != marker_before
    assert list(ex.artists.thr.get_ydata()) == [1e-5, 1e-5]
    # the threshold is written as the slider writes it
    assert ex.artists.thr.get_label().startswith("threshold 1.0e-05")
    assert ex.entry.value == late.key and ex.shown == late.key  # the side-by-side view followed
    assert ex.artists.selected.get_xdata()[0] == ex.artists.first.get_xdata()[0]
    ex.threshold.value = 1.0  # the slider's top: rel_diff cannot pass it
    assert ex.divergence is None and "no divergence" in ex.label.value
    assert "threshold 1.0e+00" in ex.label.value
    near = diff.nearest(1.0)  # named; the view stays where the user left it
    assert f"nearest: {near['key']} (pass {near['pass']})" in ex.label.value
    assert ex.entry.value == late.key and ex.shown == late.key
    wrong = tdinspect.explore(DumpSet.open(runs["ref"]).diff(runs["wrong"]))
    wrong.metric.value = "cosine"
    wrong.threshold.value = 0.99999
    assert wrong.divergence.key == "model.layers.2.mlp.down"
    wrong.entry.value = "model.lm_head"  # picking an entry shows the side-by-side view
    assert wrong.shown == "model.lm_head"
    assert wrong.view_fig._suptitle.get_text() == "model.lm_head  (pass 0)"
    assert "1 entry" not in wrong.message.value and wrong.view.widget.value[:4] == b"\x89PNG"


def test_switching_metric_brings_its_own_threshold_direction_and_scale(runs):
    f32 = 2.0**-24 / 4  # float32's unit roundoff / 4: rel_diff's "auto" for these entries
    ex = tdinspect.explore(DumpSet.open(runs["ref"]).diff(runs["wrong"]), threshold=1e-6)
    assert ex.ax.get_yscale() == "log" and type(ex.threshold).__name__ == "FloatLogSlider"
    assert not ex.auto.value and ex.artists.thr.get_visible()  # a number: one line across
    ex.metric.value = "cosine"  # its own threshold ("auto"), direction and scale
    assert type(ex.threshold).__name__ == "FloatSlider" and ex.auto.value
    assert ex.threshold.value == 1 - f32 and ex.threshold_value == "auto"
    assert (ex.threshold.min, ex.threshold.max) == (0.0, 1.0) and ex.ax.get_yscale() == "linear"
    assert "below" in ex.direction.value and ex.threshold_box.children == (ex.threshold, ex.auto)
    assert ex.divergence.key == "model.layers.2.mlp.down" and "(auto: float32)" in ex.label.value
    # "auto": one threshold per entry, drawn as a step line along the entries
    assert ex.artists.thr_rows.get_visible() and not ex.artists.thr.get_visible()
    assert set(ex.artists.thr_rows.get_ydata()) == {1 - f32}
    ex.threshold.value = 0.99  # moving the slider sets one number for every entry
    assert not ex.auto.value and ex.threshold_value == 0.99
    assert ex.divergence is None and "no divergence</b> at cosine threshold 0.990000" in ex.label.value
    ex.auto.value = True  # and ticking auto goes back
    assert ex.divergence.key == "model.layers.2.mlp.down" and ex.threshold.value == 1 - f32
    ex.metric.value = "equal"
    assert ex.threshold.value == 1.0 and ex.threshold.disabled
    assert ex.divergence.key == "model.layers.2.mlp.down"  # the first entry not bitwise equal
    assert "equal 0 &lt; 1 (default)" in ex.label.value
    ex.metric.value = "sqnr_db"  # 10·log10(2/u) for float32
    assert ex.threshold.value == pytest.approx(75.257, abs=1e-3) and ex.ax.get_yscale() == "linear"
    ex.metric.value = "rel_diff"  # back: "auto", not the 1e-6 it was opened with
    assert ex.auto.value and ex.threshold.value == f32 and ex.ax.get_yscale() == "log"
    assert not ex.threshold.disabled


def test_side_by_side_picks_pass_opens_on_the_divergence_and_draws_identical_honestly(runs):
    ref, wrong = DumpSet.open(runs["ref"]), DumpSet.open(runs["wrong"])
    # B: the reference's pass 0 with the broken run's pass 1 (real files): it parts in pass 1 only
    mixed = DumpSet(runs["wrong"], {(0, 0): ref.get_pass(0), (0, 1): wrong.get_pass(1)})
    ex = tdinspect.explore(ref.sel(pass_=[0, 1]).diff(mixed))
    assert (ex.divergence.key, ex.divergence.pass_) == ("model.layers.2.mlp.down", 1)
    assert ex.shown_at == ("model.layers.2.mlp.down", 1, 0) and ex.pass_.value == 1
    assert ex._sbs.same.get_text() == ""  # pass 1 differs: a histogram of |A - B|
    reads = []
    for side in (ex.diff.a, ex.diff.b):
        orig = side.tensor
        side.tensor = lambda *a, _orig=orig, **k: reads.append(a) or _orig(*a, **k)
    ex.pass_.value = 0  # the same entry in pass 0 is bitwise identical
    assert ex.shown_at == ("model.layers.2.mlp.down", 0, 0) and len(reads) == 2
    assert ex._sbs.same.get_text().startswith("A and B are identical")
    assert not ex._sbs.axes[1, 1].axison  # no histogram of differences that do not exist
    assert "identical: 0 everywhere" in ex._sbs.axes[0, 2].get_title()
    ex.threshold.value = 1e-2  # a threshold move that keeps the divergence re-reads nothing
    ex.threshold.value = 2e-3
    ex.pass_.value = 1  # an entry already drawn comes from the cache
    assert len(reads) == 2
    assert set(ex.timings) >= {"build", "threshold", "pick"}


def test_clicking_a_point_selects_its_entry(runs):
    from matplotlib.backend_bases import MouseEvent

    ex = tdinspect.explore(DumpSet.open(runs["ref"]).diff(runs["wrong"]))
    row = ex.table.index[(ex.table["key"] == "model.lm_head") & (ex.table["pass"] == 2)][0]
    ex.fig.canvas.draw()
    x, y = ex.ax.transData.transform((row, 1))[0], ex.ax.transAxes.transform((0, 0.5))[1]
    ex.fig.canvas.callbacks.process(
        "button_press_event", MouseEvent("button_press_event", ex.fig.canvas, x, y, button=1)
    )
    assert ex.shown_at == ("model.lm_head", 2, 0) and ex.pass_.value == 2
    assert ex.artists.selected.get_xdata()[0] == row


def test_divergence_plot_draws_zero_as_zero_and_labels_entries(runs):
    diff = DumpSet.open(runs["ref"]).diff(runs["wrong"])
    fig = tdinspect.plot.divergence(diff, threshold=1e-6)
    ax = fig.axes[0]
    art = ax.get_legend()
    labels = [t.get_text() for t in art.get_texts()]
    assert "exactly 0 (identical)" in labels and any(t.startswith("threshold 1.0e-06") for t in labels)
    assert art.get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1  # beside the data, not on it
    zeros = next(line for line in ax.lines if line.get_label() == "exactly 0 (identical)")
    n_zero = int((diff.table(progress=False)["rel_diff"] == 0).sum())
    assert len(zeros.get_xdata()) == n_zero > 0 and set(zeros.get_ydata()) == {0.03}
    main = ax.lines[0]
    assert all(v != v or v > 0 for v in main.get_ydata())  # no made-up floor value for a zero
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert {"embed", "L0", "L3", "lm_head"} <= set(ticks)
    assert {"pass 0", "pass 1", "pass 2"} <= {t.get_text() for t in ax.texts}
    assert "model.layers.2.mlp.down" in ax.get_title()
    cos = tdinspect.plot.divergence(diff, "cosine", 0.99999)
    assert cos.axes[0].get_yscale() == "linear"


def test_heatmap_and_rank_pass_tell_zero_from_missing(runs):
    import numpy as np

    diff = DumpSet.open(runs["ref"]).diff(runs["wrong"])
    hm = tdinspect.plot.heatmap(diff)
    ax = hm.axes[0]
    assert "layer 3" in [t.get_text() for t in ax.get_yticklabels()]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["exactly 0", "missing"]
    img = ax.images[0]
    data, (lo, _) = img.get_array(), img.get_clim()
    zero_cells = np.asarray(data[0]).tolist()  # layer 0 is untouched: every metric is exactly 0
    assert all(v < lo for v in zero_cells)  # below the colour range: the "exactly 0" colour
    assert ax.get_xlabel() == "module inside the layer"
    rp = tdinspect.plot.rank_pass(diff, threshold=1e-3)
    lo, hi = rp.axes[0].images[0].get_clim()
    assert hi - lo >= 1.0  # at least a decade: a tiny spread is not the whole colour range


def test_dumpset_explorer_search_and_sliders(runs):
    ex = tdinspect.explore(DumpSet.open(runs["ref"]))
    ex.search.value = r"nothing matches this"
    assert ex.op.value is None and "no op matches" in ex.stats.value
    ex.search.value = r"expert"  # not stuck after the empty result
    assert [v for _, v in ex.op.options] == ["model.expert"] and ex.op.value == "model.expert"
    assert "model.expert" in ex.stats.value
    ex.call.value = 2
    ex.pass_.value = 1
    assert "model.expert::call2" in ex.stats.value
    assert "<table" in ex.stats.value and "<style" in ex.stats.value
    heat, hist = ex.fig.axes[0], ex.fig.axes[1]
    assert heat.get_xlabel().startswith("last dim") and heat.get_ylabel() == "other dims, flattened"
    assert (hist.get_xlabel(), hist.get_ylabel()) == ("value", "elements")
    with pytest.raises(TypeError, match="DumpSet or a Diff"):
        tdinspect.explore(42)


def test_plots_return_figures(runs):
    diff = DumpSet.open(runs["ref"]).diff(runs["wrong"])
    fig = tdinspect.plot.divergence(diff, threshold=1e-3)
    assert "model.layers.2.mlp.down" in fig.axes[0].get_title()
    a = diff.a.tensor("model.layers.2.mlp.down")
    b = diff.b.tensor("model.layers.2.mlp.down")
    sbs = tdinspect.plot.side_by_side(a, b, title="down")
    assert len(sbs.axes) >= 6
    assert all(ax.get_xlabel() for ax in sbs.axes[:2])


def _run(cells, allow_errors=True):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(ROOT)}},
    ).execute()
    return nb


def _text(cell) -> str:
    return "".join(
        o.get("text", "")
        + str(o.get("data", {}).get("text/plain", ""))
        + str(o.get("data", {}).get("text/html", ""))
        + (f"{o['ename']}: {o['evalue']}" if "ename" in o else "")
        for o in cell.outputs
    )


def test_magics_in_a_real_kernel(runs, tmp_path):
    cells = [
        "%load_ext tdinspect\n%load_ext tdinspect",
        f"%tdi_open ref {runs['ref']}\nprint(type(ref).__name__, ref.passes)",
        f"%tdi_diff ref {runs['wrong']} --as d\nprint(type(d).__name__)",
        "%tdi_open broken /no/such/dump",
        "import torch\nfrom tdinspect.examples.models import make_model, make_tokens\n"
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
        f"ex.threshold.value = 1e-7\nprint(type(ex.fig.canvas).__name__, first != ex.divergence.key)\n"
        "print(ex.plot.widget is ex.fig.canvas, ex.view.widget is ex.view_fig.canvas)\n"
        # a click on the canvas selects the entry under it (what ipympl forwards from the browser)
        "from matplotlib.backend_bases import MouseEvent\n"
        "row = int(ex.table.index[ex.table['key'] == 'model.lm_head'][0]); ex.fig.canvas.draw()\n"
        "px, py = ex.ax.transData.transform((row, 1))[0], ex.ax.transAxes.transform((0, 0.5))[1]\n"
        "ex.fig.canvas.callbacks.process('button_press_event', MouseEvent('button_press_event', "
        "ex.fig.canvas, px, py, button=1))\nprint('clicked', ex.shown_at)",
    ]
    nb = _run(cells)

    def text(i):
        return _text(nb.cells[i])

    assert "Error" not in text(0)  # loading twice is harmless (IPython just says it is loaded)
    assert "DumpSet [0, 1, 2]" in text(1)
    assert "model.layers.2.mlp.down" in text(2) and "Diff" in text(2)
    assert "UsageError" in text(3) and "no such file or folder" in text(3)
    assert "pass00000.pt" in text(5) and "_run2/pass00000.pt" in text(6)  # a re-run: a new run
    assert "pass00000.pt" in text(7)
    assert "--threshold" in text(8) and "--metric" in text(8)  # help from magic_arguments
    assert "UsageError" in text(10) or "not found" in text(10)
    assert "Canvas True" in text(11) and "Error" not in text(11)
    assert "True True" in text(11) and "clicked ('model.lm_head', 0, 0)" in text(11)
    assert DumpSet.open(tmp_path / "cap", run=-1).passes == [0]
    assert DumpSet.open(tmp_path / "ops").ops == [
        "model/aten.ones.default[out0]",
        "model/aten.mul.Tensor[out0]",
    ]


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
    errors = [
        "".join(o.get("text", "") for o in c.outputs if o.get("name") == "stderr")
        + "".join(f"{o['ename']}: {o['evalue']}" for o in c.outputs if o.get("output_type") == "error")
        for c in nb.cells
    ]
    assert errors[0] == "" and errors[3] == ""
    assert errors[1].startswith("UsageError: no variable `nosuch` in the notebook")
    assert not (tmp_path / "cap").exists()  # nothing was captured for a failed lookup
    assert errors[2].startswith("UsageError: `nosuchvar` is neither a variable in the notebook nor a folder")
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
        NotebookClient(
            nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
        ).execute()
    assert nb.cells[1].outputs == [] and nb.cells[1].get("execution_count") is None


def test_tdi_diff_shows_one_summary_that_honours_its_flags(runs):
    cells = [
        "%load_ext tdinspect",
        f"%tdi_diff {runs['ref']} {runs['wrong']}",
        f"%tdi_diff {runs['ref']} {runs['wrong']} --metric cosine --threshold 0.5",
        f"%tdi_diff {runs['ref']} {runs['bf16']} --threshold 1e-7 --as bf",
        "bf.first_divergence(1e-7).key",
        f"%tdi_diff {runs['ref']} {runs['bf16']} --threshold auto",
    ]
    nb = _run(cells, allow_errors=False)
    default, loose, bf, auto = (nb.cells[i].outputs for i in (1, 2, 3, 5))
    assert len(default) == 1 and default[0]["output_type"] == "display_data"  # once, not twice
    html = default[0]["data"]["text/html"]
    assert html.count("model.layers.2.mlp.down") == 2  # named in the heading and in its table row
    assert "metric: rel_diff" in html and "first divergence" in html
    assert "threshold: auto (rel_diff u/4" in html and "(auto: float32)" in html  # the default
    html = auto[0]["data"]["text/html"]  # bf16 against float32: bfloat16's u/4 for every entry
    assert "no divergence" in html and "bfloat16 0.000977" in html
    html = loose[0]["data"]["text/html"]
    assert len(loose) == 1 and "no divergence" in html and "metric: cosine" in html and "0.5" in html
    key = nb.cells[4].outputs[0]["data"]["text/plain"].strip("'")
    assert len(bf) == 1 and key in bf[0]["data"]["text/html"] and "1e-07" in bf[0]["data"]["text/html"]


def test_entry_names_complete_inside_tensor_call(runs):
    cells = [
        f"%load_ext tdinspect\n%tdi_open ds {runs['ref']}",
        "from IPython.core.completer import provisionalcompleter\n"
        'code = "ds.tensor(\'model.layers.2.ml"\n'
        "with provisionalcompleter():\n"
        "    found = list(get_ipython().Completer.completions(code, len(code)))\n"
        "print(sorted({code[:c.start] + c.text for c in found}))",
    ]
    nb = _run(cells, allow_errors=False)
    out = _text(nb.cells[1])
    assert "ds.tensor('model.layers.2.mlp.down\"" in out and "ds.tensor('model.layers.2.mlp.up\"" in out
    assert "model.layers.1" not in out


def test_html_reprs_are_themed_collapsible_and_say_what_differs(runs, tmp_path):
    import re

    ref = DumpSet.open(runs["ref"])
    ds_html = ref._repr_html_()
    assert ds_html.count("<details") >= 2 and "<summary>" in ds_html and "var(--jp-" in ds_html
    diff = ref.diff(DumpSet.open(runs["wrong"]).sel(pass_=[0, 1]))
    html = diff._repr_html_()
    for page in (ds_html, html):  # colours come from the theme only
        assert not re.search(r"#[0-9a-fA-F]{3}(?:[0-9a-fA-F]{3})?\b|rgb\(", page)
    differ = html.index("the two sides differ")
    assert "passes only in A: [2]" in html and differ < html.index("first divergence")
    from tdinspect.report import DiffSummary

    small = DiffSummary(ref.diff(runs["bf16"]), threshold=1e-5)._repr_html_()
    assert re.search(r">\d\.\d\de-0\d<", small) and ">0.000" not in small  # scientific notation
    ops = DumpSet.open(ROOT / "sample_dumps" / "ops_layernorm_f32").diff(
        ROOT / "sample_dumps" / "ops_layernorm"
    )
    html = ops._repr_html_()
    assert "entry names only in B" in html
    found = re.search(
        r"structural problems in the (\d+) of (\d+) \(rank, pass\) pairs compared so far"
        r" <span class='n'>\((\d+)\)</span>",
        html,
    )
    n_structural = int(ops.table(progress=False)["structural"].sum())
    assert found and int(found.group(3)) == n_structural > 0
    assert "0.000001" not in html


def test_growth_and_the_demo_list_only_entries_that_add_error(runs, tmp_path, capsys):
    from tdinspect.examples.demo import run_demo

    diff = DumpSet.open(runs["ref"]).diff(runs["bf16"])
    grow = diff.growth(progress=False)
    every = diff.growth(progress=False, all_entries=True)
    assert len(grow) < len(every) and (grow["added"] > 0).all() and (grow["growth"] > 1).all()
    assert run_demo(str(tmp_path)) == 0
    out = capsys.readouterr().out
    # the demo names the wrong layer and why, at the default threshold ("auto": float32's u/4)
    assert (
        "first divergence: model.layers.2.mlp.down (pass 0, call 0)\n  rel_diff 0.0158 > "
        "1.49e-08 (auto: float32)" in out
    )
    assert "threshold: auto (rel_diff u/4" in out
    listed = out.split("entries that add the most error")[1].splitlines()[1:]
    listed = [line for line in listed if line.startswith("  ")]
    assert listed and all(
        "first error" in line or float(line.rsplit("(x", 1)[1].rstrip(")")) > 1 for line in listed
    )


def test_committed_notebooks_carry_widget_state_and_no_frozen_progress():
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    magics = ROOT / "notebooks" / "05_magics.ipynb"
    assert magics in notebooks
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
        models = state.get("state", {})
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                text = out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
                assert "it/s]" not in text and "%|" not in text, (path.name, text)  # no tqdm bar
                view = out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
                if view:  # a widget shown in the saved notebook has its state saved with it
                    assert view["model_id"] in models, (path.name, cell.source[:60])
    nb = nbformat.read(magics, as_version=4)
    sources = "\n".join(c.source for c in nb.cells)
    assert "%%tdi_capture" in sources and "%tdi_open" in sources and "--metric cosine" in sources
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "UsageError: `nosuch` is neither a variable" in text and "did you mean" in text
    assert "cosine 0.9996 &lt; 0.9999" in text and "threshold: 0.9999" in text  # not "cosine 1 < 1"


def test_progress_is_off_in_jupyter_unless_asked(runs, capsys):
    from tdinspect.util.progress import wanted

    assert wanted(True) and not wanted(False)
    diff = DumpSet.open(runs["ref"]).diff(runs["wrong"])
    diff.table()  # pytest's stderr is not a terminal, like a kernel's: no bar
    assert "diff" not in capsys.readouterr().err
    DumpSet.open(runs["ref"]).diff(runs["wrong"]).table(progress=True)
    assert "diff" in capsys.readouterr().err


def test_public_names_annotations_and_documented_keywords():
    import inspect

    import jedi

    assert "annotations" not in dir(tdinspect) and "importlib" not in dir(tdinspect)
    assert set(dir(tdinspect)) == set(tdinspect.__all__) | {"__version__"}
    assert all(hasattr(tdinspect, name) for name in dir(tdinspect))
    assert inspect.signature(DumpSet.diff).return_annotation == "Diff"
    ds = DumpSet.open(ROOT / "sample_dumps" / "float32")
    chained = [c.name for c in jedi.Interpreter('ds.diff("x").first_', [{"ds": ds}]).complete()]
    assert "first_divergence" in chained  # what IPython's completer (jedi) offers after diff(...)
    doc = tdinspect.explore.__doc__
    assert "metric : str, optional" in doc and 'threshold : "auto" or float, optional' in doc
    for name in list(inspect.signature(tdinspect.explore).parameters)[1:]:
        assert f"{name} : " in doc  # every keyword argument is documented
    with pytest.raises(TypeError, match="takes no metric"):
        tdinspect.explore(ds, metric="cosine")


def test_dashboard_lays_out_plot_table_and_side_by_side(runs, monkeypatch):
    import json

    from tdinspect.jupyter import dashboard as dash

    board = tdinspect.dashboard(runs["ref"], runs["wrong"])
    ex = board.explorer
    assert ex.divergence.key == "model.layers.2.mlp.down"
    flagged = [label for label, _ in board.entries.options if label.startswith("⚠")]
    assert flagged and "model.layers.2.mlp.down" in flagged[0]
    assert len(board.entries.options) == len(ex.table)
    assert board.entries.value == ("model.layers.2.mlp.down", 0, 0)  # the table opens on it too
    row = next(v for label, v in board.entries.options if v[0] == "model.lm_head" and v[1] == 1)
    board.entries.value = row  # picking a row of the table shows it side by side
    assert ex.shown_at == row and ex.pass_.value == 1
    ex.metric.value = "cosine"  # the table's marks follow the metric and its threshold ("auto")
    flagged = [label for label, _ in board.entries.options if label.startswith("⚠")]
    assert flagged and "model.layers.2.mlp.down" in flagged[0]
    assert board.entries.value == ("model.layers.2.mlp.down", 0, 0)  # it follows the divergence
    ex.threshold.value = 0.99  # a fixed threshold: no cosine that low, no marks
    assert not any(label.startswith("⚠") for label, _ in board.entries.options)
    board.entries.value = row
    assert board.entries.value == row and ex.shown_at == row
    parts = [board.entries, ex.plot.widget, ex.view.widget, ex.label]
    tree, todo = set(), [board.widget]
    while todo:
        w = todo.pop()
        tree.add(id(w))
        todo.extend(getattr(w, "children", ()))
    assert all(id(p) in tree for p in parts)
    # what `tdinspect dashboard A B` serves: paths and options from the environment, never as code
    monkeypatch.setenv(dash.ENV_A, str(runs["ref"]))
    monkeypatch.setenv(dash.ENV_B, str(runs["wrong"]))
    monkeypatch.setenv(dash.ENV_OPTIONS, json.dumps({"metric": "cosine", "threshold": 0.99999}))
    served = tdinspect.dashboard()
    assert served.explorer.metric.value == "cosine" and served.explorer.threshold.value == 0.99999
    assert served.explorer.divergence.key == "model.layers.2.mlp.down"


def test_dashboard_command_checks_its_dumps_before_serving(runs, capsys):
    from tdinspect.cli import main

    assert main(["dashboard", str(runs["ref"]), "/no/such/dump", "--no-browser"]) == 2
    err = capsys.readouterr().err
    assert "/no/such/dump" in err and "no such file or folder" in err


def _bf16_then_float32_runs(tmp_path):
    """Two identical runs of a model whose first layer is bfloat16 and the rest float32 (so
    the float32 entries carry bfloat16's rounding: Diff judges them by bfloat16 upstream)."""
    import torch

    def model():
        torch.manual_seed(0)
        first = torch.nn.Linear(8, 8).to(torch.bfloat16)
        rest = [torch.nn.Linear(8, 8) for _ in range(3)]
        return torch.nn.Sequential(first, _Float(), *rest)

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for name in ("a", "b"):
        m = model()
        with torch.no_grad(), tdinspect.capture(m, tmp_path / name, warn_unfired=False) as cap:
            m(x)
            cap.step()
    return DumpSet.open(tmp_path / "a").diff(tmp_path / "b")


class _Float(__import__("torch").nn.Module):
    def forward(self, x):
        return x.float()


def test_auto_slider_readout_is_the_threshold_diff_uses_upstream_included(tmp_path):
    """The slider under "auto" shows the threshold Diff applies to most entries, upstream dtype
    included (it showed float32's 1.49e-08 for float32 entries Diff judges at bfloat16's)."""
    from tdinspect.compare.thresholds import threshold_fn
    from tdinspect.numerics.metrics import auto_threshold

    diff = _bf16_then_float32_runs(tmp_path)
    table = diff.table(progress=False)
    assert (table["dtype_a"] == "torch.float32").sum() > len(table) / 2  # mostly float32 pairs
    per_row = threshold_fn("auto", "rel_diff").of_rows(table)
    bf16 = auto_threshold("rel_diff", "torch.bfloat16", "torch.bfloat16")[0]
    assert set(per_row) == {bf16}  # every entry is judged at bfloat16's threshold
    ex = tdinspect.explore(diff)
    assert ex.auto.value and ex.threshold.value == bf16
    ex.metric.value = "cosine"
    assert ex.threshold.value == auto_threshold("cosine", "torch.bfloat16", "torch.bfloat16")[0]


def test_dashboard_marks_its_table_once_per_change(runs, monkeypatch):
    """One user change, one verdict computation for the entry table (a metric switch or a
    ticked auto box fired it two or three times: the metric, the slider and the box each)."""
    from tdinspect.compare import entries

    calls = []
    for name in ("health", "rethreshold"):  # in full, or only its threshold columns
        real = getattr(entries, name)
        monkeypatch.setattr(
            entries, name, lambda *args, real=real, **kw: calls.append(1) or real(*args, **kw)
        )
    board = tdinspect.dashboard(runs["ref"], runs["wrong"])
    ex = board.explorer

    def marked():
        return [v for label, v in board.entries.options if label.startswith("⚠")]

    at_auto = marked()
    for name, value, marks in (
        ("metric", "cosine", True),
        ("threshold", 0.99, False),
        ("threshold", 0.98, False),
        ("auto", True, True),
        ("metric", "rel_diff", True),
    ):
        calls.clear()
        getattr(ex, name).value = value  # the slider of the metric on show
        assert calls == [1], (name, value)
        assert bool(marked()) == marks and ("model.layers.2.mlp.down", 0, 0) in (
            marked() if marks else [("model.layers.2.mlp.down", 0, 0)]
        )
    assert marked() == at_auto  # back where it started: the same marks


def test_many_passes_on_one_side_are_named_as_a_range(tmp_path):
    """A loop interrupted after 326 passes against one pass: the summary listed all 326 numbers."""
    from tdinspect.report import DiffSummary

    torch = pytest.importorskip("torch")
    m, x = torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.ones(2, 4)
    for name, steps in (("one", 1), ("loop", 40)):
        with torch.no_grad(), tdinspect.capture(m, tmp_path / name) as dump:
            for _ in range(steps):
                m(x)
                dump.step()
    text = str(DiffSummary(DumpSet.open(tmp_path / "one").diff(tmp_path / "loop")))
    assert "passes only in B: [1..39] (39)" in text, text
    assert ", 2," not in text


def test_a_capture_cell_whose_code_raises_fails_the_cell_and_stops_run_all(tmp_path):
    """%%tdi_capture ran its body as a cell of its own: an error there did not fail the
    magic's cell, so Run All went on (later cells diffed a partial dump) and the traceback was
    labelled with another cell's number. Now the cell fails, after the pass is written marked
    failed, and the cells after it never run."""
    cells = [
        "%load_ext tdinspect\nimport torch\nm = torch.nn.Sequential(torch.nn.Linear(2, 2))",
        f"%%tdi_capture {tmp_path / 'cap'} --model m\nm(torch.ones(1, 2))\nraise ValueError('boom in the cell')",
        "after = 1",
    ]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    with pytest.raises(CellExecutionError, match="boom in the cell"):
        NotebookClient(
            nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
        ).execute()
    assert nb.cells[2].get("execution_count") is None  # Run All stopped at the failing cell
    assert "marked failed in its sidecar" in _text(nb.cells[1])
    ds = DumpSet.open(tmp_path / "cap")
    assert ds.passes == [0] and ds.ops == ["model.0"]


def test_dumpset_explorer_clears_stale_views_and_the_call_slider_follows_the_op(runs):
    ex = tdinspect.explore(DumpSet.open(runs["ref"]))
    ex.search.value = r"expert"
    assert ex.call.max == 2  # model.expert is called three times
    ex.call.value = 2
    assert ex.fig.axes[0].images  # its heatmap
    ex.search.value = r"embed"
    assert ex.op.value == "model.embed"
    assert (ex.call.max, ex.call.value) == (0, 0)  # one call: the slider clamped, not "no call 2"
    assert ex.fig.axes[0].images and ex.fig._suptitle.get_text() == "model.embed"
    ex.search.value = r"nothing matches this"
    assert "no op matches" in ex.stats.value
    assert len(ex.fig.axes) == 1 and not ex.fig.axes[0].images  # no heatmap left over
    assert "no op matches" in ex.fig.axes[0].get_title()
    ex.search.value = r"expert"
    assert (ex.call.max, ex.call.value) == (2, 0)
    e = ex.entries  # model.expert without its call 2 in pass 1 (called twice in that pass)
    ex.entries = e[~((e["op"] == "model.expert") & (e["call"] == 2) & (e["pass"] == 1))]
    ex.pass_.value = 1
    ex.call.value = 2
    assert "has no call 2 in pass 1" in ex.stats.value
    assert not any(ax.images for ax in ex.fig.axes)  # not model.expert::call1's heatmap
    assert "has no call 2" in ex.fig.axes[0].get_title()


def test_cosine_near_1_is_written_with_the_digits_that_tell_it_from_1(runs):
    import numpy as np
    import torch

    from tdinspect.jupyter import plots
    from tdinspect.jupyter.dashboard import Dashboard

    diff = DumpSet.open(runs["ref"]).diff(runs["wrong"])
    board = Dashboard(diff, metric="cosine", threshold=0.99999999)
    ex = board.explorer
    slider = ex.threshold
    shown = format(slider.value, slider.readout_format)  # what the slider's readout shows
    assert shown not in ("1", "1.000000") and float(shown) == 0.99999999
    ex.threshold.value = 0.9999999
    assert format(slider.value, slider.readout_format) != shown
    texts = {v: plots.value_text("cosine", v) for v in (0.99999999, 0.9999999)}
    assert texts[0.99999999] == "0.99999999" and texts[0.9999999] == "0.9999999"
    # the dashboard's rows: a diverging cosine is not "cosine: 1"
    t = ex.table
    t.loc[t.index[0], "cosine"] = 0.99999999
    t.loc[t.index[1], "cosine"] = 0.9999999
    ex.threshold.value = 0.999999  # the health table is recomputed from the table
    ex.threshold.value = 0.9999999
    labels = [label for label, _ in board.entries.options]
    assert " 0.99999999 " in labels[0] and " 0.9999999 " in labels[1]
    # the side-by-side panel's metrics
    a = torch.ones(1000, dtype=torch.float64)
    b = a.clone()
    b[0] += 2e-4  # cosine 1 - 2e-11: written apart from 1
    from matplotlib.figure import Figure

    sbs = plots.SideBySide(Figure())
    sbs.update(a, b, "x")
    cos = next(line for line in sbs.metrics.get_text().splitlines() if line.startswith("cosine"))
    assert cos != "cosine: 1" and not cos.endswith(" 1")
    # the divergence plot's y axis: values near 1 on their own, no offset printed over the labels
    t["cosine"] = np.linspace(0.9999999, 0.99999999, len(t))
    ex._redraw_plot()
    ex.plot.png()  # drawn: the tick labels and offset are computed
    ax = ex.ax
    assert ax.yaxis.get_offset_text().get_text() == ""
    ticks = [lbl.get_text() for lbl in ax.get_yticklabels() if lbl.get_text()]
    assert len(set(ticks)) == len(ticks) > 1 and all(float(x.replace("\u2212", "-")) < 1 for x in ticks[:-1])
