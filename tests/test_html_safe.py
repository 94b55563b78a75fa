"""Every HTML view of a dump whose names hold a lone surrogate (an undecodable byte), control
characters and HTML metacharacters is inert text that encodes as UTF-8 (what Jupyter sends).

Before, the views escaped HTML only: a name's lone surrogate reached the page, and Jupyter
failed to send it (``UnicodeEncodeError``); a dropdown's labels failed the same way."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ipywidgets as W
import matplotlib
import pytest
import torch

import tdinspect
from tdinspect import DumpSet
from tdinspect.report import DiffSummary, diff_html, report_page
from tdinspect.util.terminal import html_text

matplotlib.use("Agg")

SCRIPT = "<script>alert(1)</script>"
NAMES = {
    f"model.{SCRIPT}": torch.arange(4.0),
    "model.a&b": torch.ones(3),
    "model.esc\x1b[2J\x07": torch.ones(2),
    "model.\udcff\ud800": torch.ones(2),  # undecodable bytes (pickle keys read "surrogatepass")
    "model.shape": torch.ones(2),  # differs in shape in B: a structural row
}


def _runs(root: Path) -> tuple[str, str]:
    """Two plain ``torch.save`` dumps, the second in a folder whose name is not UTF-8."""
    paths = []
    for run, scale in ((b"a", 1.0), (b"b\xff<script>", 2.0)):
        folder = os.path.join(os.fsencode(root), run, b"rank0_pid1")
        os.makedirs(folder)
        tensors = {k: t * scale for k, t in NAMES.items()}
        if scale != 1.0:
            tensors["model.shape"] = torch.ones(3)
        torch.save(tensors, os.fsdecode(os.path.join(folder, b"pass00000.pt")))
        paths.append(os.fsdecode(os.path.join(os.fsencode(root), run)))
    return paths[0], paths[1]


def _sendable(text: str, what) -> None:
    text.encode("utf-8")  # UnicodeEncodeError where a lone surrogate got through
    assert "<script" not in text and "\x1b" not in text and "\x07" not in text, what


def _widget_states(widget):
    """Every widget's state under ``widget``, as the kernel serialises it for the browser."""
    todo = [widget]
    while todo:
        w = todo.pop()
        state = w.get_state()
        yield w, json.dumps(state, default=lambda o: None, ensure_ascii=False)
        todo.extend(c for c in getattr(w, "children", ()) if isinstance(c, W.Widget))


def test_html_text_escapes_markup_controls_and_undecodable_bytes():
    assert html_text("a<b>&\"'") == "a&lt;b&gt;&amp;&quot;&#x27;"
    assert html_text("x\x1b[2J\udcff\n") == "x\\x1b[2J\\udcff\\n"
    assert html_text(3) == "3"


def test_html_reprs_of_hostile_names_encode_and_show_them_as_text(tmp_path):
    a_path, b_path = _runs(tmp_path)
    a = DumpSet.open(a_path)
    diff = a.diff(b_path)
    div = diff.first_divergence(1e-6)
    assert div is not None and div.key in NAMES
    views = {
        "dumpset": a._repr_html_(),
        "diff": diff._repr_html_(),
        "divergence": div._repr_html_(),
        "summary": DiffSummary(diff, threshold=1e-6, metric="max_abs")._repr_html_(),
        "diff_html": diff_html(diff, 0.5, "cosine"),
        "suggestion": tdinspect.suggest_mapping(a, DumpSet.open(b_path))._repr_html_(),
        "tree": diff.tree(1e-6)._repr_html_(),
        "report": report_page(diff._repr_html_(), diff.tree(), diff.health(), str(b_path)),
    }
    for what, page in views.items():
        _sendable(page, what)
    # the names are there, as escaped text (a table cell, a heading)
    assert "model.&lt;script&gt;alert(1)&lt;/script&gt;" in views["dumpset"]
    assert "model.a&amp;b" in views["dumpset"] and "model.\\udcff\\ud800" in views["dumpset"]
    assert "model.esc\\x1b[2J\\x07" in views["dumpset"]
    assert "b\\udcff&lt;script&gt;" in views["diff"]  # the non-UTF-8 folder name
    assert "shape" in views["summary"] and "structural" in views["summary"]
    assert html_text(div.key) in views["divergence"]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in views["tree"]  # a node's name, as text
    assert "model.a&amp;b" in views["report"] and "model.\\udcff\\ud800" in views["report"]


def test_widgets_of_hostile_names_send_only_utf8(tmp_path):
    a_path, b_path = _runs(tmp_path)
    diff = DumpSet.open(a_path).diff(b_path)
    ex = tdinspect.explore(diff, threshold=1e-6)
    board = tdinspect.dashboard(diff, threshold=1e-6)
    ds_ex = tdinspect.explore(DumpSet.open(a_path))
    for key in NAMES:
        ex.select(key, 0, 0)
        assert ex.entry.value == key  # picked by its real name, shown escaped
        for _, state in _widget_states(ex.widget):
            state.encode("utf-8")
        _sendable(ex.label.value + ex.message.value, key)
    for view in (board, ds_ex):
        for w, state in _widget_states(view.widget):
            state.encode("utf-8")
            if isinstance(w, W.HTML):
                _sendable(w.value, w)
    labels = [label for label, _ in board.entries.options]
    assert any("model.\\udcff\\ud800" in label for label in labels)
    buttons = [row.children[1] for row in board.tree.rows.children]
    assert any("\\udcff\\ud800" in b.description for b in buttons)  # the tree's nodes too
    assert {v for _, v in ds_ex.op.options} == set(NAMES)
    ds_ex.search.value = "script"
    assert ds_ex.op.value == f"model.{SCRIPT}"
    _sendable(ds_ex.stats.value, "stats")
    assert "&lt;script&gt;" in ds_ex.stats.value
    ds_ex.search.value = "<no[such"  # an invalid regex: its message is escaped too
    _sendable(ds_ex.stats.value, "regex error")


def test_magics_show_hostile_names_as_utf8_text(tmp_path):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    a_path, b_path = _runs(tmp_path)
    shell = InteractiveShell.instance()  # one per process, whichever test made it first
    shell.run_line_magic("load_ext", "tdinspect")
    formatter = shell.display_formatter
    active, html_on = formatter.active_types, formatter.formatters["text/html"].enabled
    formatter.active_types = ["text/plain", "text/html"]  # as a notebook kernel shows them
    formatter.formatters["text/html"].enabled = True
    try:
        shell.user_ns["b_path"] = b_path
        with capture_output() as shown:
            shell.run_line_magic("tdi_open", f"ds {a_path}")
            shell.run_line_magic("tdi_diff", "ds $b_path --threshold 1e-6 --as d")
        assert isinstance(shell.user_ns["d"], tdinspect.Diff)
        assert len(shown.outputs) == 2
        for out in shown.outputs:
            for mime, text in out.data.items():
                if mime == "text/html":
                    _sendable(text, mime)
                text.encode("utf-8")
                assert "\x1b" not in text, mime
        html = shown.outputs[1].data["text/html"]
        assert "first divergence" in html and "&lt;script&gt;" in html
        assert not shown.stdout.strip() and not shown.stderr.strip()
    finally:
        formatter.active_types, formatter.formatters["text/html"].enabled = active, html_on
        shell.run_line_magic("unload_ext", "tdinspect")


@pytest.mark.parametrize("name", ["model.\udcff", "model.<b>&", "model.\x1b]0;x\x07"])
def test_html_text_is_what_every_view_writes(name):
    import pandas as pd

    from tdinspect.report import styled

    page = styled(pd.DataFrame({name: [name, 1.5e-9]}))
    _sendable(page, name)
    assert page.count(html_text(name)) == 2  # the column name and the cell


def test_replay_repr_shows_names_from_the_dump_as_escapes():
    from tdinspect.rerun import ReplayResult

    r = ReplayResult(
        op="aten.add.Tensor",
        key="model.esc\x1b[2J\udcff/aten.add.Tensor",
        dtype=torch.float64,
        args=[("alpha", "\x1b]0;x\x07")],
    )
    text = repr(r)
    _sendable(text, text)
    assert "model.esc\\x1b[2J\\udcff" in text and "\\x1b]0;x\\x07" in text
