"""One verdict: diverges, matches or incomplete, never a "no divergence" that is not true.

A comparison that set entries aside or never compared them says so in every surface
(``Diff.verdict()``, the summary, the CLI's exit status 3, live capture), and a
structural mode never hides a divergence that was measured (an op run with other
arguments).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import tdinspect  # noqa: E402
from tdinspect import DumpSet  # noqa: E402
from tdinspect.examples.port import make_hf_llama, port_tokens  # noqa: E402

EPS_KEY = "model.model.layers.0.input_layernorm/aten.add.Tensor[out0]"


@pytest.fixture(scope="module")
def eps_runs(tmp_path_factory):
    """Op-level dumps (inputs recorded) of the HF Llama's first norm, RMSNorm eps 1e-6 and 1e-5."""
    root = tmp_path_factory.mktemp("eps")
    for name, eps in (("a", 1e-6), ("b", 1e-5)):
        model = make_hf_llama(seed=0, rms_norm_eps=eps, num_hidden_layers=1)
        with (
            torch.no_grad(),
            tdinspect.capture_ops(
                root / name, model=model, inputs=True, filter=r"layers\.0\.input_layernorm"
            ) as dump,
        ):
            model(port_tokens(length=6, batch=1))
            dump.step()
    return root


@pytest.mark.parametrize("structural", ["diverge", "report"])
def test_an_argument_difference_diverges_in_both_structural_modes(eps_runs, structural):
    """structural="report" set an op run with another eps aside, as if it were one-sided: the
    answer was None, with no warning (the whole comparison "matched"). It is a divergence in
    both modes, named by its argument."""
    d = DumpSet.open(eps_runs / "a").diff(eps_runs / "b")
    div = d.first_divergence(structural=structural)
    assert div is not None and div.key == EPS_KEY
    assert div.reason == "argument 'other' of aten.add.Tensor: 1e-06 vs 1e-05"
    assert EPS_KEY not in set(d.structural_entries(progress=False)["key"])


def test_live_comparison_with_report_names_an_argument_difference(eps_runs, tmp_path):
    """Live comparison set it aside too (cap.live.set_aside) and went on in silence."""
    model = make_hf_llama(seed=0, rms_norm_eps=1e-5, num_hidden_layers=1)
    with (
        pytest.raises(tdinspect.DivergenceError) as info,
        torch.no_grad(),
        tdinspect.capture_ops(
            model=model,
            inputs=True,
            filter=r"layers\.0\.input_layernorm",
            compare_to=eps_runs / "a",
            structural="report",
        ) as cap,
    ):
        model(port_tokens(length=6, batch=1))
        cap.step()
    assert info.value.divergence.key == EPS_KEY


# -- growth and nearest: a row without an error takes no part ------------------------------
@pytest.fixture(scope="module")
def up_proj_bug(tmp_path_factory):
    """A float32 reference and a bfloat16 run of the same tiny HF Llama with layer 1's up_proj
    weight x1.05; the run records no ``act_fn`` (as a port that fuses it): each act_fn is
    one-sided, right before its layer's up_proj."""
    root = tmp_path_factory.mktemp("growth")
    for name, dtype, scale, only in (
        ("a", torch.float32, 1.0, None),
        ("b", torch.bfloat16, 1.05, r"^(?!.*act_fn)"),
    ):
        model = make_hf_llama(seed=0).to(dtype)
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight.mul_(scale)
            with tdinspect.capture(model, root / name, filter=only) as cap:
                model(port_tokens())
                cap.step()
    return DumpSet.open(root / "a").diff(root / "b")


def test_growth_carries_the_running_maximum_over_one_sided_rows(up_proj_bug):
    """The one-sided act_fn's missing error became 0 in the running maximum: the up_proj after
    it had growth inf in both layers (layer 0's only inherits noise), tying with the real
    fault, and nearest said of layer 1's up_proj "the first error of its pass"."""
    g = up_proj_bug.growth(all_entries=True, progress=False).set_index("key")
    up0, up1 = "model.model.layers.0.mlp.up_proj", "model.model.layers.1.mlp.up_proj"
    gate0 = "model.model.layers.0.mlp.gate_proj"
    assert g.loc[up0, "prev_max"] >= g.loc[gate0, "error"] > 0  # the maximum before act_fn
    assert g.loc[up0, "growth"] < 2 and g.loc[up1, "growth"] > 20
    for layer in (0, 1):  # no error: no growth, never listed
        row = g.loc[f"model.model.layers.{layer}.mlp.act_fn"]
        assert row["growth"] != row["growth"] and row["added"] != row["added"]  # NaN
    adds = up_proj_bug.growth(progress=False)
    assert not adds["key"].str.endswith("act_fn").any()
    later = adds[adds["prev_max"] > 0].sort_values("growth", ascending=False)
    assert later["key"].iloc[0] == up1  # the entry that makes the error, alone at the top
    assert not (later["growth"] == float("inf")).any()
    near = up_proj_bug.nearest(progress=False)
    assert near["key"] == up1 and near["growth"] == pytest.approx(g.loc[up1, "growth"])
    assert "x the largest error before it" in near["text"]


# -- three outcomes: a port with one-sided entries -----------------------------------------
ONE_SIDED = r"rotary_emb|act_fn"  # the reference's entries the port computes inline


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    """The tiny HF Llama and its port (same weights), the RoPE-bug port, rules learnt from the
    good port and from the buggy one (which pair only the 7 entries before the bug), and
    statistics-only captures of the reference and the port."""
    from tdinspect import suggest_mapping
    from tdinspect.examples.port import LlamaPort, capture_port_pair

    root = tmp_path_factory.mktemp("verdict_port")
    ref, good = capture_port_pair(root / "good")
    _, bad = capture_port_pair(root / "bad", rope="interleaved")
    out = {"ref": ref, "good": good, "bad": bad}
    out["rules"] = suggest_mapping(ref, good).save(root / "good.yaml")
    out["bad_rules"] = suggest_mapping(ref, bad).save(root / "bad.yaml")
    hf = make_hf_llama(0)
    for name, model in (("ref_stats", hf), ("port_stats", LlamaPort.from_hf(hf))):
        with torch.no_grad(), tdinspect.capture(model, root / name, stats_only=True) as cap:
            model(port_tokens(0))
            cap.step()
        out[name] = root / name
    return out


def test_verdict_has_three_outcomes(port, recwarn):
    """Diff.verdict() gave (divergence, gap): a port whose one-sided entries were set aside
    was "no divergence", as if every entry had been compared. Now diverges / matches /
    incomplete, with counts, and what was not compared."""
    from dataclasses import FrozenInstanceError

    from tdinspect.compare.thresholds import Verdict
    from tdinspect.errors import UncomparedWarning

    ref = DumpSet.open(port["ref"])
    d = ref.diff(port["good"], mapping=str(port["rules"]))
    v = d.verdict(threshold=1e-10, structural="report")
    assert isinstance(v, Verdict) and v.outcome == "incomplete" and v.divergence is None
    assert (v.compared, v.uncompared, v.allowed) == (21, 4, 0)
    assert v.gap.startswith(
        "4 entries were set aside or never compared (model.model.rotary_emb[0] (pass 0): only in A"
    )
    assert v.text.startswith("incomplete: no divergence among the 21 entries compared, but 4 entries")
    with pytest.raises(FrozenInstanceError):
        v.outcome = "matches"
    with pytest.warns(UncomparedWarning, match="4 entries were set aside"):
        assert d.first_divergence(threshold=1e-10, structural="report") is None
    assert d.summary(1e-10, structural="report")["outcome"] == "incomplete"
    from tdinspect.report import DiffSummary

    text = repr(DiffSummary(d, 1e-10, structural="report"))
    assert "  incomplete: no divergence among the 21 entries compared" in text
    assert "  no divergence (" not in text

    # the entries one-sided by design named: every other entry was compared
    for allow in (ONE_SIDED, [r"rotary_emb", r"act_fn$"]):
        v = d.verdict(threshold=1e-10, structural="report", allow_uncompared=allow)
        assert (v.outcome, v.compared, v.uncompared, v.allowed) == ("matches", 21, 0, 4), allow
        assert (
            v.text
            == "matches: all 21 entries compared, none past its threshold (4 left out by allow_uncompared)"
        )
    allowed = ref.diff(port["good"], mapping=str(port["rules"]), allow_uncompared=ONE_SIDED)
    recwarn.clear()
    assert allowed.first_divergence(threshold=1e-10, structural="report") is None
    assert not [w for w in recwarn if issubclass(w.category, UncomparedWarning)]
    # the default structural mode: one-sided entries diverge, unless allowed
    assert d.verdict(threshold=1e-10).divergence.reason == "only in A"
    assert allowed.verdict(threshold=1e-10).outcome == "matches"
    assert allowed.divergences(threshold=1e-10, progress=False).empty

    # a real divergence is one whatever is allowed
    v = ref.diff(port["bad"], mapping=str(port["rules"])).verdict(
        threshold=1e-6, structural="report", allow_uncompared=ONE_SIDED
    )
    assert v.outcome == "diverges" and v.divergence.key == "model.model.layers.0.self_attn.o_proj"
    assert v.gap == "" and v.text.startswith(
        "diverges: model.model.layers.0.self_attn.o_proj (pass 0): rel_diff"
    )

    # rules learnt from the buggy port pair the 7 entries before the bug: where it stops
    v = ref.diff(port["bad"], mapping=str(port["bad_rules"])).verdict(
        structural="report", allow_uncompared=ONE_SIDED
    )
    assert v.outcome == "incomplete" and v.stopped["position"] == 7
    assert v.gap.startswith(
        "the comparison stops at model.model.layers.0.self_attn.v_proj (A's entry 7 of 25"
    )
    assert "model.model.layers.0.self_attn.o_proj" in v.stopped["after"]
    assert not any("rotary_emb" in k for k in v.stopped["after"])  # allowed: not listed


def test_never_compared_entries_make_the_verdict_incomplete(port):
    """Statistics-only dumps cannot apply a mapping's transform (q_proj = qkv.chunk...): those
    pairs were never compared and the diff still said "no divergence"."""
    d = DumpSet.open(port["ref_stats"]).diff(port["port_stats"], mapping=str(port["rules"]))
    v = d.verdict(allow_uncompared=ONE_SIDED)
    assert v.outcome == "incomplete" and v.divergence is None
    assert v.uncompared == 10 and v.compared == 11  # q, k, v, gate, up of 2 layers
    assert "needs tensors (statistics-only dump)" in v.gap
    v = d.verdict(allow_uncompared=[ONE_SIDED, r"_proj$"])
    assert v.outcome == "matches" and v.allowed == 14


def test_cli_exit_codes_say_the_outcome(port, capsys):
    """first-divergence --structural report printed "no divergence ... but the comparison
    stops at ... entry 7 of 25" and exited 0: a CI gate passed a port whose comparison
    stopped right before its bug. Now 0 matches, 1 diverges, 2 error, 3 incomplete."""
    from tdinspect.cli import main

    ref, good, bad = str(port["ref"]), str(port["good"]), str(port["bad"])
    rules, bad_rules = str(port["rules"]), str(port["bad_rules"])
    report = ["--structural", "report"]
    allow = ["--allow-uncompared", "rotary_emb", "--allow-uncompared", "act_fn"]
    fd = ["first-divergence"]

    assert main([*fd, ref, bad, "--mapping", bad_rules, *report]) == 3
    out = capsys.readouterr().out
    assert out.startswith("incomplete (rel_diff, tensor mode)")
    assert "the comparison stops at model.model.layers.0.self_attn.v_proj (A's entry 7 of 25" in out
    assert main([*fd, ref, bad, "--mapping", bad_rules, *report, *allow]) == 3
    capsys.readouterr()
    assert main([*fd, ref, good, "--mapping", rules, "--threshold", "1e-10", *report]) == 3
    assert "incomplete: no divergence among the 21 entries compared" in capsys.readouterr().out
    assert main([*fd, ref, good, "--mapping", rules, "--threshold", "1e-10", *report, *allow]) == 0
    assert capsys.readouterr().out.startswith("no divergence")
    assert main([*fd, ref, good, "--mapping", rules, "--threshold", "1e-10", *allow]) == 0
    assert main([*fd, ref, good, "--mapping", rules, "--threshold", "1e-10"]) == 1  # only in A
    assert main([*fd, ref, bad, "--mapping", rules, "--threshold", "1e-6", *report, *allow]) == 1
    capsys.readouterr()
    assert main([*fd, ref, bad, "--mapping", bad_rules, *report, "--json"]) == 3
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["outcome"] == "incomplete" and doc["uncompared_after"]["position"] == 7
    assert doc["first_divergence"] is None and doc["gap"].startswith("the comparison stops at")
    assert main([*fd, ref, good, "--mapping", rules, "--allow-uncompared", "("]) == 2
    assert "--allow-uncompared '('" in capsys.readouterr().err
    assert main([*fd, ref, str(port["ref"] / "nosuch")]) == 2

    # diff: statistics-only pairs a transform cannot reach were never compared
    stats = [str(port["ref_stats"]), str(port["port_stats"]), "--mapping", rules]
    assert main(["diff", *stats]) == 1  # the one-sided entries diverge
    capsys.readouterr()
    assert main(["diff", *stats, *allow]) == 3
    out = capsys.readouterr().out
    assert "incomplete: no divergence among the 11 entries compared, but 10 entries" in out
    assert main(["diff", *stats, *allow, "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["outcome"] == "incomplete"
    assert main(["diff", *stats, *allow, "--allow-uncompared", r"_proj$"]) == 0
    assert main(["diff", ref, good, "--mapping", rules, "--threshold", "1e-10", *allow]) == 0
    assert main(["diff", ref, bad, "--mapping", rules, "--threshold", "1e-6", *allow]) == 1


@pytest.mark.parametrize("command", ["first-divergence", "diff"])
def test_cli_help_names_the_exit_statuses(command, capsys):
    from tdinspect.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "--allow-uncompared REGEX" in out
    assert "3  incomplete" in out and "0  matches" in out and "1  diverges" in out and "2  error" in out


# -- live comparison: what it set aside is reported ------------------------------------------
def _live(port, rope="half", rules="rules", steps=1, **options):
    from tdinspect.examples.port import LlamaPort

    model = LlamaPort.from_hf(make_hf_llama(0), rope=rope)
    with (
        torch.no_grad(),
        tdinspect.capture(
            model, compare_to=port["ref"], mapping=str(port[rules]), structural="report", **options
        ) as cap,
    ):
        for _ in range(steps):
            model(port_tokens(0))
            cap.step()
    return cap.live


def _counts(v):
    return (v.outcome, v.compared, v.uncompared, v.allowed)


def test_live_capture_reports_what_it_set_aside(port, recwarn):
    """capture(port, compare_to=REF, structural="report") set the reference's one-sided
    entries aside (cap.live.set_aside) and finished with no exception and no warning, while
    the offline diff of the same pair warned. Now one warning per pass naming the first few
    (or UncomparedError), and cap.live.verdict() is the offline verdict."""
    from tdinspect.errors import UncomparedError, UncomparedWarning

    ref = DumpSet.open(port["ref"])
    offline = ref.diff(port["good"], mapping=str(port["rules"])).verdict(structural="report")
    recwarn.clear()
    live = _live(port)
    said = [str(w.message) for w in recwarn if issubclass(w.category, UncomparedWarning)]
    assert len(said) == 1 and said[0].startswith(
        "tdinspect: live comparison, pass 0: 4 entries were set aside or never compared "
        "(model.model.rotary_emb[0]: only in A; model.model.rotary_emb[1]: only in A; "
        "model.model.layers.0.mlp.act_fn: only in A; ...)"
    )
    assert live.first is None and len(live.set_aside) == 4
    assert _counts(live.verdict()) == _counts(offline) == ("incomplete", 21, 4, 0)
    assert live.verdict().gap.startswith("4 entries were set aside or never compared")

    with pytest.raises(UncomparedError, match="pass 0: 4 entries were set aside") as err:
        _live(port, on_uncompared="raise")
    assert [r["key"] for r in err.value.rows][:2] == [
        "model.model.rotary_emb[0]",
        "model.model.rotary_emb[1]",
    ]
    with pytest.raises(ValueError, match="on_uncompared='ignore'"):
        _live(port, on_uncompared="ignore")

    # the entries one-sided by design named: nothing to report, the verdict matches
    recwarn.clear()
    live = _live(port, allow_uncompared=ONE_SIDED, on_uncompared="raise")
    allowed = ref.diff(port["good"], mapping=str(port["rules"]), allow_uncompared=ONE_SIDED)
    assert _counts(live.verdict()) == _counts(allowed.verdict(structural="report")) == ("matches", 21, 0, 4)
    assert not [w for w in recwarn if issubclass(w.category, UncomparedWarning)]

    # rules that stop pairing (learnt from the buggy port): 7 entries compared, the rest aside
    with pytest.warns(
        UncomparedWarning, match=r"pass 0: 28 entries were set aside .*model\.blocks\.0\.attn\.o: only in B"
    ):
        live = _live(port, rope="interleaved", rules="bad_rules", allow_uncompared=ONE_SIDED)
    offline = ref.diff(port["bad"], mapping=str(port["bad_rules"])).verdict(
        structural="report", allow_uncompared=ONE_SIDED
    )
    assert _counts(live.verdict()) == _counts(offline) and offline.outcome == "incomplete"


def test_live_capture_reports_at_close(port):
    """A pass written by close() (no step() called) is reported there too."""
    from tdinspect.errors import UncomparedWarning

    with pytest.warns(UncomparedWarning, match="pass 0: 4 entries were set aside"):
        from tdinspect.examples.port import LlamaPort

        model = LlamaPort.from_hf(make_hf_llama(0))
        with (
            torch.no_grad(),
            tdinspect.capture(
                model, compare_to=port["ref"], mapping=str(port["rules"]), structural="report"
            ) as cap,
        ):
            model(port_tokens(0))
    assert cap.live.verdict().outcome == "incomplete"
