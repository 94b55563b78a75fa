"""One comparison spec, one verdict on every surface (issue 27).

The port case (a tiny Hugging Face Llama against its hand-written port: other names, fused
``qkv`` and ``gate_up``, rotary embeddings inline) goes through Python, the CLI, the
``%tdi_diff`` and ``%%tdi_capture`` magics, the explorer, the dashboard (as an object and as
the page ``tdinspect dashboard`` serves) and live capture, all made from ONE
:class:`~tdinspect.compare.spec.CompareSpec`: each must give the same outcome, the same
entry, pass and rank, and the same entries set aside. Before the spec, the explorer, the
plots and the dashboard rebuilt the comparison without ``structural``/``allow_uncompared``
and named ``rotary_emb[0]`` "only in A" where the diff named the attention output.
"""

from __future__ import annotations

import html
import json
import warnings

import matplotlib
import pytest
import torch

pytest.importorskip("transformers")

import tdinspect  # noqa: E402
from tdinspect import DumpSet, suggest_mapping  # noqa: E402
from tdinspect.cli import build_parser, main  # noqa: E402
from tdinspect.compare.spec import CompareSpec  # noqa: E402
from tdinspect.examples.port import LlamaPort, capture_port_pair, make_hf_llama, port_tokens  # noqa: E402

matplotlib.use("Agg")

STEPS = 1  # a %%tdi_capture cell runs one pass
ONLY_A = {
    "model.model.rotary_emb[0]",
    "model.model.rotary_emb[1]",
    "model.model.layers.0.mlp.act_fn",
    "model.model.layers.1.mlp.act_fn",
}
ONE_SIDED = r"rotary_emb|act_fn"


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_verdict")
    ref, good = capture_port_pair(root / "good", steps=STEPS)
    _, bad = capture_port_pair(root / "bad", rope="interleaved", steps=STEPS)
    rules = suggest_mapping(DumpSet.open(ref), DumpSet.open(good)).save(root / "rules.yaml")
    two, _ = capture_port_pair(root / "two", steps=2)  # a reference of two passes
    return {"ref": ref, "good": good, "bad": bad, "rules": rules, "two": two}


# (which port, the flags of the spec) -> (outcome, key, pass, rank)
CASES = {
    "planted bug": ("bad", [], ("diverges", "model.model.layers.0.self_attn.o_proj", 0, 0)),
    "correct port": ("good", [], ("incomplete", None, None, None)),
    "correct port, one-sided allowed": (
        "good",
        ["--allow-uncompared", ONE_SIDED],
        ("matches", None, None, None),
    ),
}


def _flags(port, extra):
    return ["--mapping", str(port["rules"]), "--structural", "report", "--threshold", "1e-6", *extra]


def _answer(v):
    d = v.divergence
    return (v.outcome, None, None, None) if d is None else (v.outcome, d.key, d.pass_, d.rank)


def _live(port, which, spec):
    """The port captured live against the reference with ``spec``: its LiveCompare."""
    model = LlamaPort.from_hf(make_hf_llama(0), rope="interleaved" if which == "bad" else "half")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report is the verdict below
        with (
            torch.no_grad(),
            tdinspect.capture(model, compare_to=port["ref"], spec=spec, on_divergence="warn") as cap,
        ):
            for step in range(STEPS):
                model(port_tokens(step))
                cap.step()
    return cap.live


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()  # one per process, whichever test made it first
    shell.run_line_magic("load_ext", "tdinspect")
    return shell


@pytest.mark.parametrize("case", list(CASES))
def test_one_spec_gives_one_verdict_on_every_surface(port, case, capsys, monkeypatch):
    from IPython.utils.capture import capture_output

    from tdinspect.jupyter import dashboard as dash

    which, extra, expected = CASES[case]
    a, b = str(port["ref"]), str(port[which])
    flags = _flags(port, extra)
    spec = CompareSpec.from_args(build_parser().parse_args(["first-divergence", a, b, *flags]))
    assert spec.structural == "report" and spec.threshold == 1e-6 and len(spec.mapping) == 12

    # Python: the diff holds its spec, shows it, and answers by it
    diff = DumpSet.open(a).diff(b, spec=spec)
    assert diff.spec == spec and "structural report" in repr(diff) and "mapping 12 rules" in repr(diff)
    assert diff.plan().attrs["spec"] == spec
    v = diff.verdict()
    answer = _answer(v)
    assert answer == expected
    aside = set(diff.structural_entries(progress=False)["key"])
    assert aside == ONLY_A  # set aside (report), whether or not allowed
    counts = (v.compared, v.uncompared, v.allowed)

    # the CLI, from the same flags: exit code and JSON say the same
    status = main(["first-divergence", a, b, *flags, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == {"matches": 0, "diverges": 1, "incomplete": 3}[expected[0]]
    fd = doc["first_divergence"]
    cli = (doc["outcome"], *((fd["key"], fd["pass"], fd["rank"]) if fd else (None,) * 3))
    assert cli == expected and (doc["compared"], doc["uncompared"], doc["allowed"]) == counts
    assert {r["key"] for r in doc["structural_entries"]} == (aside if fd is None else ONLY_A)
    assert CompareSpec.from_json(json.dumps(doc["spec"])) == spec
    # the dashboard command takes every flag first-divergence does: the same spec
    served = build_parser().parse_args(["dashboard", a, b, *flags])
    assert CompareSpec.from_args(served) == spec

    # the explorer and the plots of the diff: its own spec, not the defaults
    ex = tdinspect.explore(diff)
    assert _answer(ex.verdict) == expected and ex.verdict.text == v.text
    if expected[1]:
        assert ex.divergence.key == expected[1] and expected[1] in ex.label.value
    else:
        assert f"<b>{'no divergence' if expected[0] == 'matches' else 'incomplete'}</b>" in ex.label.value
        assert html.escape(v.text) in ex.label.value and "first divergence" not in ex.label.value
    fig = tdinspect.plot.divergence(diff)
    title = fig.axes[0].get_title()
    assert (
        (expected[1] in title)
        if expected[1]
        else title.startswith("no divergence" if expected[0] == "matches" else "incomplete")
    )
    assert "rotary_emb" not in title

    # the dashboard object, and the page `tdinspect dashboard` serves (spec as JSON, data only)
    board = tdinspect.dashboard(diff)
    assert _answer(board.explorer.verdict) == expected
    marked = {value[0] for label, value in board.entries.options if label.startswith("⚠")}
    assert not marked & ONLY_A  # set aside: never marked as diverging
    assert bool(marked) == (expected[0] == "diverges")
    for name, value in dash.page_environment(a, b, spec).items():
        monkeypatch.setenv(name, value)
    page = tdinspect.dashboard()
    assert "compared with: <code>mapping 12 rules, structural report" in page.header.value
    assert page.diff.spec == spec and _answer(page.explorer.verdict) == expected

    # %tdi_diff with the same flags, and %%tdi_capture --compare-to with them (live)
    shell = _shell()
    try:
        with capture_output() as shown:
            shell.run_line_magic("tdi_diff", f"{a} {b} {' '.join(flags)} --as d")
        d = shell.user_ns["d"]
        assert d.spec == spec and _answer(d.verdict()) == expected
        shown_text = shown.outputs[0].data["text/plain"]
        words = {
            "diverges": expected[1],
            "incomplete": "incomplete: no divergence",
            "matches": "no divergence",
        }
        assert words[expected[0]] in shown_text and "compared with: mapping 12 rules" in shown_text
        shell.user_ns["model"] = LlamaPort.from_hf(
            make_hf_llama(0), rope="interleaved" if which == "bad" else "half"
        )
        shell.user_ns["ids"] = port_tokens(0)
        live_flags = " ".join(flags)
        with warnings.catch_warnings(), capture_output() as printed:
            warnings.simplefilter("ignore")
            shell.run_cell_magic(
                "tdi_capture",
                f"--model model --compare-to {a} --on-divergence warn {live_flags}",
                "import torch\nwith torch.no_grad():\n    model(ids)",
            )
        said = printed.stdout.strip()
    finally:
        shell.run_line_magic("unload_ext", "tdinspect")
    assert said == f"tdinspect: against {a}: {v.text}"  # the words the CLI prints

    # live capture with the spec: the verdict of the offline diff, same counts
    live = _live(port, which, spec)
    assert live.spec == spec and _answer(live.verdict()) == expected
    assert {r["key"] for r in live.set_aside} == (set() if expected[0] == "matches" else ONLY_A)
    if expected[0] != "diverges":  # a divergence stops the offline diff's count at its pass
        assert (live.verdict().compared, live.verdict().uncompared, live.verdict().allowed) == counts
        assert live.verdict().text == v.text


def test_the_cli_prints_the_verdict_the_magic_prints(port, capsys):
    """%%tdi_capture --compare-to printed "no divergence" for a comparison that set entries
    aside; the CLI said "incomplete". Both print Verdict.text now."""
    a, b = str(port["ref"]), str(port["good"])
    assert main(["first-divergence", a, b, *_flags(port, [])]) == 3
    out = capsys.readouterr().out
    text = (
        DumpSet.open(a)
        .diff(b, mapping=str(port["rules"]), structural="report", threshold=1e-6)
        .verdict()
        .text
    )
    assert (
        f"  {text}\n" in out and "compared with: mapping 12 rules, structural report, threshold 1e-06" in out
    )
    assert main(["first-divergence", a, b, *_flags(port, ["--allow-uncompared", ONE_SIDED])]) == 0
    assert (
        "  matches: all 21 entries compared, none past its threshold (4 left out" in capsys.readouterr().out
    )


def test_live_reports_reference_passes_never_reached(port):
    """The reference has 2 passes, the live run stops after 1: close() said nothing and the
    verdict matched. Now the unreached pass's entries are never compared (on_uncompared),
    and the verdict is incomplete, as the offline diff of the same pair is."""
    from tdinspect.errors import UncomparedError, UncomparedWarning

    spec = CompareSpec(mapping=str(port["rules"]), structural="report", allow_uncompared=ONE_SIDED)

    def run(**options):
        model = LlamaPort.from_hf(make_hf_llama(0))
        with torch.no_grad(), tdinspect.capture(model, compare_to=port["two"], spec=spec, **options) as cap:
            model(port_tokens(0))
            cap.step()
        return cap.live

    with pytest.warns(UncomparedWarning, match=r"stopped before the reference's pass 1: their 21 entries"):
        live = run()
    v = live.verdict()
    assert v.outcome == "incomplete" and v.uncompared == 21 and "pass 1 only in A" in v.gap
    with pytest.raises(UncomparedError, match="stopped before the reference's pass 1"):
        run(on_uncompared="raise")
    with pytest.raises(TypeError, match="give threshold in spec= or as keywords, not both"):
        run(threshold=1e-3)


def test_spec_is_one_value_made_once(port):
    """The spec is frozen, checked where it is made, and a Diff's keywords build it."""
    import dataclasses

    spec = CompareSpec(structural="report", allow_uncompared=ONE_SIDED, threshold={"attn": 1e-3})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.structural = "diverge"
    with pytest.raises(ValueError, match="structural='sometimes'"):
        CompareSpec(structural="sometimes")
    with pytest.raises(ValueError, match="allow_uncompared '\\('"):
        CompareSpec(allow_uncompared="(")
    with pytest.raises(ValueError, match="callable"):
        CompareSpec(mapping={"a": ["b", lambda t: t]}).to_json()
    d = DumpSet.open(port["ref"]).diff(port["good"], mapping=str(port["rules"]), structural="report")
    assert d.spec.structural == "report" and len(d.spec.mapping) == 12
    again = DumpSet.open(port["ref"]).diff(port["good"], spec=d.spec, allow_uncompared=ONE_SIDED)
    assert again.spec == d.spec.replace(allow_uncompared=ONE_SIDED)
    assert again.verdict().outcome == "matches" and d.verdict().outcome == "incomplete"
