"""An error budget from a baseline run (issue 27 case 8).

A float32 port of a tiny Hugging Face Llama whose one RMSNorm uses eps 1e-5 for 1e-6 parts from
a float64 reference by ``rel_diff`` 5e-10: under float32's ``"auto"`` threshold (1.5e-8), far
above the port's rounding noise (1e-14). The float32 reference is the baseline: B diverges where
its error against A exceeds k times the baseline's, which names the faulty norm, and a correct
port against the same baseline matches.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import tdinspect  # noqa: E402
from tdinspect import DumpSet, suggest_mapping  # noqa: E402
from tdinspect.cli import main  # noqa: E402
from tdinspect.examples.port import LlamaPort, make_hf_llama, port_tokens  # noqa: E402
from tdinspect.numerics.metrics import auto_threshold, roundoff_floor  # noqa: E402

FAULT = "model.model.layers.1.post_attention_layernorm"
ONE_SIDED = r"rotary_emb|act_fn"  # the reference's entries the port computes inline


def _capture(model, path, **options):
    with torch.no_grad(), tdinspect.capture(model, path, **options) as dump:
        model(port_tokens(0))
        dump.step()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference in float64 and float32, a correct float32 port and one with eps 1e-5 in
    layer 1's post-attention norm (weights of std 0.1: activations of order 1, where the eps
    changes the norm's output by ~2e-5 relative, rel_diff ~5e-10)."""
    root = tmp_path_factory.mktemp("baseline")
    hf = make_hf_llama(0, initializer_range=0.1)
    bad = LlamaPort.from_hf(hf)
    bad.blocks[1].mlp_norm.eps = 1e-5
    out = {
        "ref64": _capture(copy.deepcopy(hf).double(), root / "ref64"),
        "ref32": _capture(hf, root / "ref32"),
        "good": _capture(LlamaPort.from_hf(hf), root / "good"),
        "bad": _capture(bad, root / "bad"),
        "ref32_layer0": _capture(hf, root / "ref32_layer0", filter=r"layers\.0\."),
    }
    out["rules"] = suggest_mapping(DumpSet.open(out["ref64"]), DumpSet.open(out["good"])).save(
        root / "map.yaml"
    )
    return out


def _diff(runs, port, **options):
    return DumpSet.open(runs["ref64"]).diff(runs[port], mapping=str(runs["rules"]), **options)


def test_the_baseline_names_a_fault_the_auto_threshold_misses(runs):
    plain = _diff(runs, "bad")
    v = plain.verdict(structural="report", allow_uncompared=ONE_SIDED)
    assert v.outcome == "matches"  # what float32's "auto" rule says: the fault is missed
    value = plain.table().set_index("key").at[FAULT, "rel_diff"]
    assert 1e-12 < value < auto_threshold("rel_diff", "torch.float64", "torch.float32")[0]

    d = _diff(runs, "bad", baseline=runs["ref32"])
    v = d.verdict(structural="report", allow_uncompared=ONE_SIDED)
    assert v.outcome == "diverges"
    div = v.divergence
    assert (div.key, div.pass_) == (FAULT, 0)
    base = d.baseline.table().set_index("key").at[FAULT, "rel_diff"]
    ratio = value / base
    assert ratio > 1000
    assert div.reason.startswith(f"rel_diff {value:.3g}, {ratio:,.0f}x the baseline's {base:.3g} (budget 10x")
    assert "the baseline's" in v.text


def test_a_correct_port_against_the_same_baseline_matches(runs):
    d = _diff(runs, "good", baseline=runs["ref32"])
    v = d.verdict(structural="report", allow_uncompared=ONE_SIDED)
    assert v.outcome == "matches" and v.compared == 21


def test_the_factor_is_settable(runs):
    d = _diff(runs, "bad", baseline=runs["ref32"], baseline_factor=1e6)
    v = d.verdict(structural="report", allow_uncompared=ONE_SIDED)
    assert v.outcome == "matches"  # the fault is ~25,000x the baseline's noise: within 1e6x
    with pytest.raises(ValueError, match="baseline_factor"):
        _diff(runs, "bad", baseline=runs["ref32"], baseline_factor=0.5)


def test_a_baseline_equal_to_the_reference_keeps_a_floor_of_roundoff(runs):
    """A baseline bitwise equal to A gives a budget of 0: the floor (8 units of float32 roundoff)
    keeps the float32 reference's own noise (rel_diff up to ~3e-14) from diverging."""
    ref = DumpSet.open(runs["ref64"])
    assert ref.diff(runs["ref32"], baseline=runs["ref64"]).verdict().outcome == "matches"
    div = _diff(runs, "bad", baseline=runs["ref64"]).verdict(structural="report", allow_uncompared=ONE_SIDED)
    assert div.divergence.key == FAULT
    assert div.divergence.reason.endswith("8 units of float32 roundoff (the baseline's error is 0)")


def test_entries_the_baseline_lacks_are_said(runs):
    """A baseline captured with a filter holds layer 0 only: the other entries are judged by the
    auto rule, and the verdict is incomplete, naming them."""
    d = _diff(runs, "good", baseline=runs["ref32_layer0"])
    v = d.verdict(structural="report", allow_uncompared=ONE_SIDED)
    assert v.outcome == "incomplete"
    assert "model.model.embed_tokens (pass 0): no baseline entry" in v.gap
    assert (v.compared, v.uncompared) == (9, 12)  # layer 0: 2 norms, q, k, v, o, gate, up, down
    # a fault where the baseline has nothing is judged by the auto rule, which misses it: never "matches"
    assert (
        _diff(runs, "bad", baseline=runs["ref32_layer0"])
        .verdict(structural="report", allow_uncompared=ONE_SIDED)
        .outcome
        == "incomplete"
    )


def test_plan_and_repr_show_the_baseline(runs):
    d = _diff(runs, "good", baseline=runs["ref32_layer0"])
    plan = d.plan().set_index("a_key")
    assert plan.at["model.model.layers.0.mlp.down_proj", "baseline"] == "model.model.layers.0.mlp.down_proj"
    assert plan.at["model.lm_head", "baseline"] == ""
    assert "baseline=" in repr(d) and "10x" in repr(d)
    assert "baseline" not in _diff(runs, "good").plan().columns


def test_cli_baseline(runs, capsys):
    fd = ["first-divergence", str(runs["ref64"])]
    options = ["--mapping", str(runs["rules"]), "--structural", "report", "--allow-uncompared", ONE_SIDED]
    assert main([*fd, str(runs["bad"]), *options]) == 0  # the auto rule alone: no divergence
    capsys.readouterr()
    assert main([*fd, str(runs["bad"]), *options, "--baseline", str(runs["ref32"])]) == 1
    out = capsys.readouterr().out
    assert f"first divergence: {FAULT} (pass 0, call 0)" in out
    assert "x the baseline's" in out and "threshold: 10x the baseline's rel_diff against A" in out
    assert main([*fd, str(runs["good"]), *options, "--baseline", str(runs["ref32"])]) == 0
    capsys.readouterr()
    diff = ["diff", str(runs["ref64"]), str(runs["bad"]), "--mapping", str(runs["rules"])]
    assert main([*diff, "--allow-uncompared", ONE_SIDED, "--baseline", str(runs["ref32"])]) == 1
    out = capsys.readouterr().out
    assert "baseline=" in out.splitlines()[0]
    # the value's third digit depends on the CPU's float32 kernels: compare it as a number
    found = re.search(rf"first divergence: {re.escape(FAULT)} \(pass 0\): rel_diff ([0-9.e+-]+), ", out)
    assert found is not None, out
    assert float(found[1]) == pytest.approx(5.5e-10, rel=0.05)
    capsys.readouterr()
    assert main([*fd, str(runs["good"]), *options, "--baseline-factor", "5"]) == 2
    assert "--baseline DIR" in capsys.readouterr().err


# --- bfloat16 (issue 35 case 10): the floor must not swamp the budget ---------------------------

BF16_FAULT = "model.model.layers.1.mlp.up_proj"


def _split_matmul(linear):
    """``linear``'s forward as two half-K products summed in float32: another order of the same
    sums (a correct variant)."""

    def forward(x):
        h = linear.weight.shape[1] // 2
        lo = torch.nn.functional.linear(x[..., :h], linear.weight[:, :h]).float()
        hi = torch.nn.functional.linear(x[..., h:], linear.weight[:, h:]).float()
        return (lo + hi).to(x.dtype)

    return forward


@pytest.fixture(scope="module")
def bf16(runs, tmp_path_factory):
    """The trusted model in bfloat16 (the baseline C), correct bfloat16 variants (eager attention
    for SDPA, split matmuls, the port), and one whose ``layers.1.mlp.up_proj`` adds noise of
    about 11x C's own error there (B's error there ~12x C's: the fault is planted relative to the
    noise measured on this CPU)."""
    root = tmp_path_factory.mktemp("bf16")
    hf = make_hf_llama(0, initializer_range=0.1)
    trusted = copy.deepcopy(hf).to(torch.bfloat16)
    out = {"c": _capture(trusted, root / "c")}
    base = DumpSet.open(runs["ref64"]).diff(out["c"]).table().set_index("key").at[BF16_FAULT, "rel_diff"]
    out["base"] = base

    eager = copy.deepcopy(trusted)
    eager.config._attn_implementation = "eager"
    out["eager"] = _capture(eager, root / "eager")
    split = copy.deepcopy(trusted)
    for layer in split.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.o_proj, *layer.mlp.children()):
            if isinstance(lin, torch.nn.Linear):
                lin.forward = _split_matmul(lin)
    out["split"] = _capture(split, root / "split")
    out["port"] = _capture(LlamaPort.from_hf(hf).to(torch.bfloat16), root / "port")

    bad = copy.deepcopy(trusted)
    g = torch.Generator().manual_seed(1)
    delta = (2 * 11 * base) ** 0.5  # rel_diff of a relative noise delta: ½·delta²

    def fault(module, args, output):
        noise = torch.randn(output.shape, generator=g).to(output.dtype)
        return output + delta * output.float().pow(2).mean().sqrt().to(output.dtype) * noise

    bad.model.layers[1].mlp.up_proj.register_forward_hook(fault)
    out["bad"] = _capture(bad, root / "bad")
    return out


def _bf16_diff(runs, bf16, name, **options):
    if name == "port":
        options["mapping"] = str(runs["rules"])
    return DumpSet.open(runs["ref64"]).diff(bf16[name], baseline=bf16["c"], **options)


def test_bf16_a_fault_12x_the_baseline_is_named_where_it_is_introduced(runs, bf16):
    """Before: the floor (8 units of bfloat16 roundoff, rel_diff 4.9e-4) was over 10x the
    baseline almost everywhere, and the fault read "matches" (or was named downstream)."""
    d = _bf16_diff(runs, bf16, "bad")
    value = d.table().set_index("key").at[BF16_FAULT, "rel_diff"]
    assert 11 < value / bf16["base"] < 15  # the scenario: a fault about 12x the baseline's noise
    v = d.verdict(structural="report", allow_uncompared=ONE_SIDED)
    assert v.outcome == "diverges"
    assert (v.divergence.key, v.divergence.pass_) == (BF16_FAULT, 0)
    reason = v.divergence.reason
    assert re.match(r"rel_diff \S+, 1\d(\.\d+)?x the baseline's \S+ \(budget 10x\)$", reason), reason
    # the same fault without a baseline: bfloat16's auto threshold (9.8e-4) misses it
    plain = DumpSet.open(runs["ref64"]).diff(bf16["bad"])
    assert plain.verdict(allow_uncompared=ONE_SIDED).outcome == "matches"


@pytest.mark.parametrize("variant", ["eager", "split", "port"])
def test_bf16_correct_variants_match_the_baseline_budget(runs, bf16, variant):
    d = _bf16_diff(runs, bf16, variant)
    v = d.verdict(structural="report", allow_uncompared=ONE_SIDED)
    assert v.outcome == "matches", v.text
    assert v.compared >= 21
    ratio = d.table().set_index("key")["rel_diff"] / d.baseline.table().set_index("key")["rel_diff"]
    assert 1.05 < ratio.max() < 10  # another rounding than the baseline's, within the budget


def test_the_floor_never_swamps_a_baseline_that_has_an_error(runs, bf16):
    """Where the baseline's error is above 0, the budget is k times it (or one unit of roundoff,
    a relative L2 error of u, where k times it is less: bfloat16's rotary cosine, 4.4e-7): the
    floor (k times the baseline's least error at that precision) never swamps it."""
    for diff in (_bf16_diff(runs, bf16, "split"), _diff(runs, "good", baseline=runs["ref32"])):
        budget = diff.thresholds()
        rows = diff.table()
        base = np.array([budget.baseline_of(r) for _, r in rows.iterrows()])
        one = np.array(
            [roundoff_floor("rel_diff", a, b, 1) for a, b in zip(rows["dtype_a"], rows["dtype_b"])]
        )
        thresholds = budget.of_rows(rows)
        has = base > 0
        assert has.sum() >= 18
        np.testing.assert_allclose(thresholds[has], np.maximum(budget.factor * base, one)[has])
        assert (budget.factor * base[has] > one[has]).mean() > 0.9  # the baseline's, nearly everywhere


def test_where_the_baseline_is_exact_the_floor_is_k_times_its_least_error(runs, tmp_path):
    """Layer 0's input norm is exact in the float32 baseline (computed in float32 on both sides):
    a fault there is judged against 10x the baseline's least float32 error elsewhere in the pass,
    and the reason says so."""
    port = LlamaPort.from_hf(make_hf_llama(0, initializer_range=0.1))
    port.blocks[0].attn_norm.eps = 1e-5
    key = "model.model.layers.0.input_layernorm"
    d = _diff({**runs, "bad0": _capture(port, tmp_path / "bad0")}, "bad0", baseline=runs["ref32"])
    assert d.baseline.table().set_index("key").at[key, "rel_diff"] == 0
    v = d.verdict(structural="report", allow_uncompared=ONE_SIDED)
    assert v.divergence.key == key
    found = re.search(
        r"> (\S+), 10x the baseline's least float32 error (\S+) \(model\.\S+\) \(the baseline's error is 0\)$",
        v.divergence.reason,
    )
    assert found is not None, v.divergence.reason
    assert float(found[1]) == pytest.approx(10 * float(found[2]), rel=0.01)
    assert float(found[1]) < roundoff_floor("rel_diff", "torch.float64", "torch.float32", 8)
