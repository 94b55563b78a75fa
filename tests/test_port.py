"""A hand-written port of a tiny Hugging Face Llama against the real thing (issue 11).

The reference is ``transformers``' ``LlamaForCausalLM`` (random weights from a
tiny config); the port (``tdinspect.examples.port``) has other names, fused
``qkv`` and ``gate_up`` projections and its own RMSNorm class, loaded with the
same weights. ``suggest_mapping`` must pair every entry the two have in common,
and with its rules a fault in the port must be named at its first entry.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from tdinspect import DumpSet, suggest_mapping  # noqa: E402
from tdinspect.cli import main  # noqa: E402
from tdinspect.examples.port import capture_port_pair  # noqa: E402

LAYERS = 2
# what the port holds of each reference entry (the ground truth, written by hand)
COMMON = {
    "model.model.embed_tokens": ("model.embed", slice(None)),
    "model.model.norm": ("model.final_norm", slice(None)),
    "model.lm_head": ("model.head", slice(None)),
}
for _i in range(LAYERS):
    _a, _b = f"model.model.layers.{_i}.", f"model.blocks.{_i}."
    COMMON.update(
        {
            _a + "input_layernorm": (_b + "attn_norm", slice(None)),
            _a + "self_attn.q_proj": (_b + "attn.qkv", slice(0, 32)),
            _a + "self_attn.k_proj": (_b + "attn.qkv", slice(32, 48)),
            _a + "self_attn.v_proj": (_b + "attn.qkv", slice(48, 64)),
            _a + "self_attn.o_proj": (_b + "attn.o", slice(None)),
            _a + "post_attention_layernorm": (_b + "mlp_norm", slice(None)),
            _a + "mlp.gate_proj": (_b + "ffn.gate_up", slice(0, 64)),
            _a + "mlp.up_proj": (_b + "ffn.gate_up", slice(64, 128)),
            _a + "mlp.down_proj": (_b + "ffn.down", slice(None)),
        }
    )
ONLY_A = [
    "model.model.rotary_emb[0]",
    "model.model.rotary_emb[1]",
    "model.model.layers.0.mlp.act_fn",
    "model.model.layers.1.mlp.act_fn",
]


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    root = tmp_path_factory.mktemp("port")
    ref, good = capture_port_pair(root / "good", steps=2)
    _, bad = capture_port_pair(root / "bad", rope="interleaved", steps=2)
    _, other = capture_port_pair(root / "other", seed=1)  # other weights: values agree on nothing
    return {"ref": ref, "good": good, "bad": bad, "other": other}


@pytest.fixture(scope="module")
def suggestion(port):
    return suggest_mapping(DumpSet.open(port["ref"]), DumpSet.open(port["good"]))


def test_suggestion_pairs_every_common_entry(port, suggestion):
    used = suggestion.pairs[suggestion.pairs["used"]]
    assert dict(zip(used["a"], used["b"])) == {a: b for a, (b, _) in COMMON.items()}
    assert sorted(suggestion.unmatched_a) == sorted(ONLY_A)
    assert suggestion.unmatched_b == []
    assert (used["confidence"] >= 0.9).all()
    # each transform takes the slice the port's weights put there
    good = DumpSet.open(port["good"])
    from tdinspect.align import parse_transform

    for row in used.itertuples():
        b, cut = COMMON[row.a]
        full = good.tensor(b)
        got = parse_transform(row.transform)(full) if row.transform else full
        assert torch.equal(got, full[..., cut]), row.a
    # per-layer pairs fold into one rule each
    rules = suggestion.rules
    assert rules[r"model\.model\.layers\.(\d+)\.self_attn\.q_proj"] == [
        r"model.blocks.\1.attn.qkv",
        "chunk(2, -1)[0]",
    ]
    assert rules[r"model\.model\.layers\.(\d+)\.mlp\.up_proj"] == [
        r"model.blocks.\1.ffn.gate_up",
        "chunk(2, -1)[1]",
    ]
    assert rules[r"model\.model\.embed_tokens"] == "model.embed"
    assert len(rules) == 12


def test_identical_weights_do_not_diverge_with_the_suggested_rules(port, suggestion):
    d = DumpSet.open(port["ref"]).diff(port["good"], mapping=suggestion.rules)
    plan = d.plan()
    assert set(plan[plan["status"] != "ok"]["a_key"]) == set(ONLY_A)
    assert d.first_divergence(threshold=1e-10, structural="report") is None
    table = d.table(progress=False)
    matched = table[~table["structural"]]
    assert len(matched) == 2 * len(COMMON)  # both passes, every common entry compared
    assert matched["rel_diff"].max() <= 1e-10
    assert sorted(d.structural_entries(progress=False)["key"].unique()) == sorted(ONLY_A)


def test_interleaved_rope_is_named_at_its_first_entry(port, suggestion):
    d = DumpSet.open(port["ref"]).diff(port["bad"], mapping=suggestion.rules)
    div = d.first_divergence(threshold=1e-6, structural="report")
    # q, k and v come out of the projections before RoPE: the attention output is the first
    assert div.key == "model.model.layers.0.self_attn.o_proj" and not div.structural
    assert div.row["key_b"] == "model.blocks.0.attn.o"
    assert div.value > 1e-5 and div.pass_ == 0  # identical weights: <= 1e-10 (above)
    assert sorted(div.structural_entries["key"]) == sorted(ONLY_A)  # those of pass 0, the pass read
    # without report, a one-sided entry comes first: the reason the option exists
    assert d.first_divergence(threshold=1e-6).reason == "only in A"


def test_guesses_without_support_are_listed_not_used(port):
    s = suggest_mapping(port["ref"], port["other"])
    assert s.rules == {} and not s.pairs["used"].any()
    assert len(s.pairs) > 0 and (s.pairs["confidence"] < 0.6).all()
    assert any("values differ" in e for e in s.pairs["evidence"])
    assert "listed, not used" in s.to_yaml()


def test_save_yaml_json_and_html(tmp_path, port, suggestion):
    ref = DumpSet.open(port["ref"])
    for name in ("map.yaml", "map.json"):
        path = suggestion.save(tmp_path / name)
        d = ref.diff(port["good"], mapping=str(path))
        assert d.first_divergence(threshold=1e-10, structural="report") is None
    assert json.loads((tmp_path / "map.json").read_text()) == suggestion.rules
    html = suggestion._repr_html_()
    assert "Suggested mapping" in html and "self_attn" in html and "rotary_emb" in html
    assert "12 rules from 21 pairs" in repr(suggestion)


def test_cli_suggest_then_diff(tmp_path, port, capsys):
    assert main(["suggest-mapping", str(port["ref"]), str(port["good"])]) == 0
    f = tmp_path / "map.yaml"
    f.write_text(capsys.readouterr().out)
    assert "# only in A: model.model.rotary_emb[0]" in f.read_text()
    base = ["--mapping", str(f), "--threshold", "1e-6", "--structural", "report"]
    assert main(["first-divergence", str(port["ref"]), str(port["good"]), *base]) == 3  # one-sided set aside
    allow = ["--allow-uncompared", r"rotary_emb|act_fn"]
    assert main(["first-divergence", str(port["ref"]), str(port["good"]), *base, *allow]) == 0
    assert main(["first-divergence", str(port["ref"]), str(port["bad"]), *base]) == 1
    out = capsys.readouterr().out
    assert "first divergence: model.model.layers.0.self_attn.o_proj" in out
    assert main(["suggest-mapping", str(port["ref"]), str(port["good"]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["pairs"]) == 21 and sorted(doc["unmatched_a"]) == sorted(ONLY_A)


def test_rules_suggested_from_the_buggy_port_do_not_read_as_all_clear(tmp_path, port, suggestion, capsys):
    """The documented flow run on the port that has the bug (no good port to learn from): its
    values agree up to layer 0's v_proj, so the rules pair those 7 entries and the other 18
    were set aside; first_divergence(structural="report") said None and the CLI "no
    divergence" in silence. Now both say where the comparison stopped: right before the bug."""
    from tdinspect import UncomparedWarning

    s = suggest_mapping(port["ref"], port["bad"])
    d = DumpSet.open(port["ref"]).diff(port["bad"], mapping=s.rules)
    with pytest.warns(
        UncomparedWarning,
        match=r"stops at model\.model\.layers\.0\.self_attn\.v_proj "
        r"\(A's entry 7 of 25, pass 0\)",
    ):
        assert d.first_divergence(structural="report") is None
    gap = d.uncompared_after()
    assert gap["last_compared"] == "model.model.layers.0.self_attn.v_proj" and gap["pass"] == 0
    assert gap["after"][0] == "model.model.layers.0.self_attn.o_proj"  # the RoPE bug's first entry
    assert len(gap["after"]) == 18 and gap["after"][-1] == "model.lm_head"
    f = s.save(tmp_path / "map.yaml")
    args = [
        "first-divergence",
        str(port["ref"]),
        str(port["bad"]),
        "--mapping",
        str(f),
        "--structural",
        "report",
    ]
    assert main(args) == 3  # incomplete
    out = capsys.readouterr().out
    assert (
        "no divergence" in out and "but the comparison stops at model.model.layers.0.self_attn.v_proj" in out
    )
    assert main([*args, "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["uncompared_after"]["position"] == 7
    # the good port's rules: compared up to A's last entry; one-sided entries between are no gap
    good = DumpSet.open(port["ref"]).diff(port["good"], mapping=suggestion.rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncomparedWarning)
        assert (
            good.first_divergence(threshold=1e-10, structural="report", allow_uncompared=r"rotary_emb|act_fn")
            is None
        )
    assert good.uncompared_after() is None


def test_tdi_diff_takes_a_mapping_and_sets_structural_entries_aside(tmp_path, port, suggestion):
    """%tdi_diff had no --mapping: a port could not be compared from a magic at all (every
    entry "only in A"). Now --mapping, --structural report and the stopping point, as the CLI."""
    from .test_runs import _notebook

    good_map = suggestion.save(tmp_path / "good.yaml")
    bad_map = suggest_mapping(port["ref"], port["bad"]).save(tmp_path / "bad.yaml")
    out = _notebook(
        [
            "%load_ext tdinspect",
            f"%tdi_diff {port['ref']} {port['bad']} --mapping {good_map} --structural report",
            f"%tdi_diff {port['ref']} {port['bad']} --mapping {bad_map} --structural report",
            f"%tdi_diff {port['ref']} {port['bad']} --mapping {tmp_path / 'nosuch.yaml'}",
        ]
    )
    assert "first divergence: Divergence(model.model.layers.0.self_attn.o_proj" in out[1], out[1]
    assert (
        "no divergence" in out[2]
        and "but the comparison stops at model.model.layers.0.self_attn.v_proj" in out[2]
    ), out[2]
    assert "UsageError" in out[3] and "nosuch.yaml" in out[3], out[3]


# -- op level: a non-tensor argument that differs ----------------------------------------
@pytest.fixture(scope="module")
def eps_runs(tmp_path_factory):
    """Op-level dumps (inputs recorded) of the HF Llama with RMSNorm eps 1e-6 and 1e-4."""
    import tdinspect
    from tdinspect.examples.port import make_hf_llama, port_tokens

    root = tmp_path_factory.mktemp("eps")
    out = {}
    for name, eps in (("a", 1e-6), ("b", 1e-4), ("a2", 1e-6)):
        model = make_hf_llama(seed=0, rms_norm_eps=eps, num_hidden_layers=1)
        with (
            torch.no_grad(),
            tdinspect.capture_ops(
                root / name, model=model, inputs=True, filter=r"layers\.0\.input_layernorm"
            ) as dump,
        ):
            model(port_tokens(length=6, batch=1))
            dump.step()
        out[name] = root / name
    return out


def test_eps_difference_is_named_with_its_argument(eps_runs):
    from tdinspect import replay

    a = DumpSet.open(eps_runs["a"])
    assert a.diff(eps_runs["a2"]).first_divergence(threshold=0) is None  # same eps: nothing
    div = a.diff(eps_runs["b"]).first_divergence()
    assert div.structural
    assert div.key == "model.model.layers.0.input_layernorm/aten.add.Tensor[out0]"
    assert div.reason == "argument 'other' of aten.add.Tensor: 1e-06 vs 0.0001"
    assert div.row["rel_diff"] > 0  # the numbers stay in the row
    # replay shows the recorded arguments of both runs
    r = replay(a, div.key, other=eps_runs["b"])
    assert ("other", "1e-06") in r.args and ("other", "0.0001") in r.other_args
    assert r.args[0][0] == "self" and r.args[0][1].startswith("tensor model.model.layers.0")
    assert "other=1e-06" in repr(r) and "other run's args" in repr(r) and "0.0001" in repr(r)
    assert "recorded arguments" in r._repr_html_() and "0.0001" in r._repr_html_()


def test_shape_arguments_differ_by_name():
    from torch.utils._pytree import tree_flatten, treespec_dumps

    from tdinspect.align.args import arg_difference, describe_args

    spec = treespec_dumps(tree_flatten(((torch.ones(1), [2, 6]), {}))[1])  # view(x, [2, 6])
    a = {"aten": "aten.view.default", "spec": spec, "leaves": [{"t": "x"}, 2, 6]}
    b = {"aten": "aten.view.default", "spec": spec, "leaves": [{"t": "y"}, 3, 4]}
    assert describe_args(a) == [("self", "tensor x"), ("size", "[2, 6]")]
    assert arg_difference(a, b) == "argument 'size' of aten.view.default: [2, 6] vs [3, 4]"
    assert arg_difference(a, {**a, "leaves": [{"t": "other_name"}, 2, 6]}) == ""  # tensor keys
    assert arg_difference(a, None) == ""


def test_per_position_shows_the_rope_bug_from_the_second_token(port, suggestion):
    d = DumpSet.open(port["ref"]).diff(port["bad"], mapping=suggestion.rules)
    da = d.per_position("model.model.layers.0.self_attn.o_proj", dim=1, threshold=1e-6)
    assert da.attrs["first_position"] == 1  # position 0 is rotated by angle 0 either way
    assert float(da.sel(position=0).max()) <= 1e-10 and float(da.sel(position=slice(1, None)).min()) > 1e-6
    q = d.per_position("model.model.layers.0.self_attn.q_proj", dim=1)  # a slice of the fused qkv
    assert float(q.max()) <= 1e-10 and q.sizes["position"] == 12


def test_live_comparison_of_the_port_sets_one_sided_entries_aside(port, suggestion):
    """``capture(port, compare_to=ref, mapping=..., structural="report")``: the reference's
    entries the port lacks (rotary_emb, act_fn) are set aside, as offline; before, a correct
    port always stopped with ``only in A`` at the end of its first pass."""
    import tdinspect
    from tdinspect.errors import DivergenceError
    from tdinspect.examples.port import LlamaPort, make_hf_llama, port_tokens

    def live(rope, **options):
        model = LlamaPort.from_hf(make_hf_llama(0), rope=rope)
        with (
            torch.no_grad(),
            tdinspect.capture(model, compare_to=port["ref"], mapping=suggestion.rules, **options) as cap,
        ):
            for step in range(2):
                model(port_tokens(step))
                cap.step()
        return cap.live

    with pytest.raises(DivergenceError, match="only in A"):
        live("half")  # structural="diverge", the default: as offline without report
    got = live("half", structural="report")
    assert got.first is None
    assert sorted(r["key"] for r in got.set_aside) == sorted(ONLY_A * 2)  # both passes
    with pytest.raises(DivergenceError) as err:
        live("interleaved", structural="report", threshold=1e-6)
    offline = (
        DumpSet.open(port["ref"])
        .diff(port["bad"], mapping=suggestion.rules)
        .first_divergence(threshold=1e-6, structural="report")
    )
    div = err.value.divergence
    assert (div.key, div.pass_, div.value) == (offline.key, offline.pass_, offline.value)
    assert div.key == "model.model.layers.0.self_attn.o_proj"
    with pytest.raises(ValueError, match="structural='aside'"):
        live("half", structural="aside")
