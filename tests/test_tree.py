"""The model's shape: a diff's health table and module tree, their HTML (no kernel), the
``tdinspect report`` page, and the explorer's and dashboard's tree and table linked to the view.

Real runs: a tiny Hugging Face Llama (random weights, no download) against itself with one
planted bug, and plain ``torch.save`` dumps with one-sided and NaN entries."""

from __future__ import annotations

import re

import matplotlib
import pytest
import torch

import tdinspect
from tdinspect import DumpSet
from tdinspect.examples.port import make_hf_llama, port_tokens

matplotlib.use("Agg")

BUG = "model.model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny HF Llama, and the same model with ``layers.1.mlp.down_proj`` scaled by 1.01 (2 passes)."""
    root = tmp_path_factory.mktemp("llama")
    for name in ("ref", "bug"):
        model = make_hf_llama(0)
        if name == "bug":
            with torch.no_grad():
                model.get_parameter("model.layers.1.mlp.down_proj.weight").mul_(1.01)
        with torch.no_grad(), tdinspect.capture(model, root / name, warn_unfired=False) as cap:
            for step in range(2):
                model(port_tokens(step))
                cap.step()
    return DumpSet.open(root / "ref").diff(root / "bug")


@pytest.fixture
def sided(tmp_path):
    """Plain dumps: ``model.a.x`` equal, ``model.a.y`` NaN in B only, ``model.b`` in A only."""
    x = torch.arange(6.0)
    a = {"model.a.x": x, "model.a.y": x + 1, "model.b": x}
    b = {"model.a.x": x, "model.a.y": torch.full((6,), float("nan"))}
    for name, tensors in (("a", a), ("b", b)):
        (tmp_path / name / "rank0_pid1").mkdir(parents=True)
        torch.save(tensors, tmp_path / name / "rank0_pid1" / "pass00000.pt")
    return DumpSet.open(tmp_path / "a").diff(tmp_path / "b")


def test_health_rows_diverge_exactly_where_divergences_says(llama):
    h = llama.health()
    assert len(h) == len(llama.table(progress=False))
    assert list(h.columns[:6]) == ["rank", "pass", "order", "op", "call", "key"]
    got = set(zip(h.loc[h["diverges"], "key"], h.loc[h["diverges"], "pass"]))
    assert got == set(zip(llama.divergences()["key"], llama.divergences()["pass"]))
    first = h[h["diverges"]].iloc[0]
    assert first["key"] == BUG and first["pass"] == 0  # execution order: the first divergence
    assert first["key"] == llama.first_divergence().key
    assert first["share"] > 1 and (h.loc[~h["diverges"], "share"] <= 1).all()
    assert first["growth"] == float("inf")  # the first error of its pass: it made the error
    # cosine is turned into an error: the share is (1 - cosine) / (1 - threshold)
    c = llama.health(metric="cosine")
    row = c[c["key"] == BUG].iloc[0]
    assert row["share"] == pytest.approx((1 - row["value"]) / (1 - row["threshold"]))


def test_tree_follows_the_dotted_names_and_opens_the_path_to_the_first_divergence(llama):
    tree = llama.tree()
    h = llama.health()
    assert tree.first == (BUG, 0, 0)
    assert tree.root.entries == len(h) and tree.root.diverging == int(h["diverges"].sum())
    layers = tree.node("model.model.layers")
    assert list(layers.children) == ["0", "1"]
    layer0, layer1 = layers.children["0"], layers.children["1"]
    assert layer0.diverging == 0 and layer0.worst < 1 and not layer0.open
    assert layer1.open and tree.node("model.model.layers.1.mlp").open
    bug = tree.node(BUG)
    assert bug.worst > 1 and bug.target == (BUG, bug.target[1], 0) and bug.diverging == 2
    assert bug.worst == layer1.worst == tree.root.worst  # the worst error below a node
    assert [n.path for n in tree.path_of(BUG)][-2:] == ["model.model.layers.1.mlp", BUG]
    shown = [n.path for n, _ in tree.lines()]
    assert "model.model.layers.0.mlp" not in shown and BUG in shown  # collapsed but for the path
    assert "first divergence " + BUG in repr(tree)


def test_tree_counts_one_sided_and_nonfinite_entries(sided):
    h = sided.health()
    assert h.set_index("key")["one_sided"].to_dict() == {
        "model.a.x": False,
        "model.a.y": False,
        "model.b": True,
    }
    assert h.set_index("key")["nonfinite"].to_dict() == {
        "model.a.x": False,
        "model.a.y": True,
        "model.b": False,
    }
    tree = sided.tree()
    a, b = tree.node("model.a"), tree.node("model.b")
    assert (a.entries, a.diverging, a.nonfinite, a.one_sided) == (2, 1, 1, 0)
    assert (b.entries, b.diverging, b.one_sided) == (1, 1, 1)
    assert tree.node("model").diverging == 2 and tree.node("model.a.x").worst == 0
    # named by allow_uncompared: the one-sided entry no longer diverges
    excused = sided.tree(allow_uncompared="model\\.b").node("model.b")
    assert excused.diverging == 0 and excused.worst != excused.worst  # NaN: not compared, not red


def test_tree_html_renders_without_a_kernel_open_on_the_path(llama):
    page = llama.tree()._repr_html_()
    assert "<script" not in page and "<style" not in page  # inline styles only: GitHub, nbviewer
    opened = re.findall(r"<details open[^>]*><summary title='([^']*)'", page)
    assert opened == [
        "model",
        "model.model",
        "model.model.layers",
        "model.model.layers.1",
        "model.model.layers.1.mlp",
    ]
    assert page.count("<details") > len(opened)  # the rest collapsed
    assert "hsl(0," in page and "hsl(120," in page  # red past the threshold, green far under it


def test_report_command_writes_a_page_of_verdict_tree_and_table(llama, tmp_path, capsys):
    from tdinspect.cli import main

    out = tmp_path / "report.html"
    status = main(["report", str(llama.a.path), str(llama.b.path), "-o", str(out)])
    assert status == 1  # diverges, as first-divergence says
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert "module tree" in page and "<details open" in page and BUG in page
    assert "entries by share of their threshold" in page
    assert "wrote" in capsys.readouterr().out
    from tdinspect.report import health_html

    assert f"the first 5 of {len(llama.health())} rows" in health_html(llama.health(), limit=5)
    # the comparison flags of first-divergence: a loose threshold matches
    assert main(["report", str(llama.a.path), str(llama.b.path), "--threshold", "1", "-o", str(out)]) == 0
    assert "no divergence" in out.read_text(encoding="utf-8")


def test_explorer_table_filters_sorts_and_is_linked_both_ways_to_the_view(llama):
    ex = tdinspect.explore(llama)
    table, tree = ex.overview.table, ex.overview.tree
    assert ex.overview.widget in ex.widget.children
    assert table.rows.value == (BUG, 0, 0) == ex.shown_at  # opens where the view opens
    assert len(table.rows.options) == len(ex.table)
    table.filter.value = r"mlp\.down"
    assert {v[0] for _, v in table.rows.options} == {f"model.model.layers.{i}.mlp.down_proj" for i in (0, 1)}
    table.filter.value = "[oops"  # not a regex: every row, and a message
    assert len(table.rows.options) == len(ex.table) and "invalid regex" in table.count.value
    table.filter.value = ""
    table.sort.value = "share"
    shares = [
        ex.overview.health.set_index(["key", "pass"]).loc[(k, p), "share"]
        for _, (k, p, _) in table.rows.options
    ]
    assert shares[0] > 1 and shares == sorted(shares, reverse=True)
    # a row picked: the view shows it; the view moved: the row follows
    pick = next(v for _, v in table.rows.options if v[0] == "model.model.norm" and v[1] == 1)
    table.rows.value = pick
    assert ex.shown_at == pick and ex.entry.value == "model.model.norm" and ex.pass_.value == 1
    ex.pass_.value = 0
    assert table.rows.value == ("model.model.norm", 0, 0)
    assert tree.tree.node("model.model.norm").path == tree._marked


def test_tree_panel_click_opens_a_node_and_shows_its_worst_entry(llama):
    ex = tdinspect.explore(llama)
    panel = ex.overview.tree
    texts = [row.children[1].description for row in panel.rows.children]
    assert any(t.startswith("▾ 1 ") for t in texts) and any(t.startswith("▸ 0 ") for t in texts)
    panel.click("model.model.layers.0")
    assert panel.tree.node("model.model.layers.0").open
    shown = {row.children[1].tooltip for row in panel.rows.children}
    assert "model.model.layers.0.mlp" in shown
    assert ex.shown_at[0].startswith("model.model.layers.0")  # its worst entry, side by side
    assert panel._marked == panel.tree.path_of(ex.shown_at[0])[-1].path
    ex.threshold.value = 1e-2  # a new tree at a new threshold keeps what was opened
    assert panel.tree.node("model.model.layers.0").open
    assert panel.tree.first is None and ex.divergence is None


def test_dashboard_table_follows_the_pass_on_show(runs):
    board = tdinspect.dashboard(runs["ref"], runs["wrong"])
    ex = board.explorer
    assert board.entries.value == ("model.layers.2.mlp.down", 0, 0)
    ex.pass_.value = 2  # the view shows pass 2: so does the table (it kept pass 0's row)
    assert ex.shown_at == ("model.layers.2.mlp.down", 2, 0)
    assert board.entries.value == ("model.layers.2.mlp.down", 2, 0)
    board.health.filter.value = "lm_head"
    assert {v[0] for _, v in board.entries.options} == {"model.lm_head"}
    assert board.entries.value is None  # the entry on show is filtered out: nothing highlighted
    board.entries.value = ("model.lm_head", 1, 0)
    assert ex.shown_at == ("model.lm_head", 1, 0)
    board.health.filter.value = ""
    board.health.sort.value = "growth"
    assert board.entries.options[0][1][0] in {"model.layers.2.mlp.down"}  # the entry that made the error
    assert board.entries.value == ("model.lm_head", 1, 0)


def test_op_level_entries_meet_under_their_op():
    """``model.ln/aten.add.Tensor[in0]`` and ``[out0]`` are two leaves of one op node."""
    from .conftest import ROOT

    ref = DumpSet.open(ROOT / "sample_dumps" / "ops_layernorm_f32")
    tree = ref.diff(ROOT / "sample_dumps" / "ops_layernorm").tree()
    op = tree.node("model/aten._to_copy.default")
    assert list(op.children) == ["[in0]", "[out0]"]
    assert op.entries == op.children["[in0]"].entries + op.children["[out0]"].entries
    assert tree.node("model/aten._to_copy.default[in0]").path == "model/aten._to_copy.default[in0]"
    assert tree.first[0] == "model/aten._to_copy.default[in0]" and op.open
