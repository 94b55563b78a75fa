"""threshold="auto": each entry's threshold from its two dtypes (issue 13, precision-aware defaults).

Real runs of the bundled transformer and of a tiny Hugging Face Llama: the bugs a fixed 1e-3
misses in float32 (a 1% norm weight, another RoPE theta) are found by default and named at
their first entry, while identical runs, bfloat16 against float32 and a float64 (or float32)
reduction-order change find nothing.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from torch import nn

import tdinspect
from tdinspect import DumpSet
from tdinspect.cli import main
from tdinspect.compare.thresholds import Thresholds
from tdinspect.dumper.live import LiveCompare
from tdinspect.examples.models import make_model, make_tokens
from tdinspect.numerics.metrics import auto_threshold, unit_roundoff
from tdinspect.report import DiffSummary

from .test_checksum import SplitK  # another reduction order
from .test_dumpset_diff import write_dump

F32 = torch.finfo(torch.float32).eps / 2 / 4  # 1.49e-8: rel_diff's auto threshold for float32


def _run(path, model, steps=2, tokens=make_tokens):
    with torch.no_grad(), tdinspect.capture(model, path, environ={}) as dump:
        for step in range(steps):
            model(tokens(seed=step))
            dump.step()
    return path


def _split_k(model: nn.Module) -> nn.Module:
    for block in model.layers:
        block.mlp.down = SplitK(block.mlp.down)
        block.attn.o_proj = SplitK(block.attn.o_proj)
    return model


@pytest.fixture(scope="module")
def float32_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto32")
    norm = make_model(seed=0)
    with torch.no_grad():
        norm.layers[1].ln2.weight.mul_(1.01)  # one norm weight 1% off
    return {
        "ref": _run(root / "ref", make_model(seed=0)),
        "ref2": _run(root / "ref2", make_model(seed=0)),
        "norm": _run(root / "norm", norm),
        "bf16": _run(root / "bf16", make_model(seed=0, dtype=torch.bfloat16)),
        "split": _run(root / "split", _split_k(make_model(seed=0))),
    }


def test_the_rule_per_dtype_pair():
    u32, u16, ub16 = (torch.finfo(d).eps / 2 for d in (torch.float32, torch.float16, torch.bfloat16))
    assert unit_roundoff("torch.float64") == 2.0**-53 and unit_roundoff(torch.float32) == u32
    assert unit_roundoff("torch.complex64") == u32 and unit_roundoff("torch.int64") == 0.0
    assert unit_roundoff("torch.bool") == 0.0 and unit_roundoff("") is None
    assert unit_roundoff("torch.qint8") is None and unit_roundoff("os.system") is None
    assert auto_threshold("rel_diff", "torch.float32", "torch.float32") == (u32 / 4, "auto: float32")
    # the coarser side decides; a float facing an integer uses the float's
    assert auto_threshold("rel_diff", "torch.float32", "torch.bfloat16") == (ub16 / 4, "auto: bfloat16")
    assert auto_threshold("rel_diff_cast", "torch.float16", "torch.int32") == (u16 / 4, "auto: float16")
    assert auto_threshold("rel_diff", "torch.int64", "torch.int64") == (0.0, "auto: int64")
    assert auto_threshold("cosine", "torch.float16", "torch.float16") == (1 - u16 / 4, "auto: float16")
    assert auto_threshold("cosine", "torch.float64", "torch.float64")[0] == 1 - 2.0**-50
    assert auto_threshold("cosine", "torch.int8", "torch.int8")[0] == 1.0
    # sqnr_db = -10 log10(2 rel_diff), at rel_diff = u/4
    assert auto_threshold("sqnr_db", "torch.float32", "torch.float32")[0] == pytest.approx(
        -10 * math.log10(2 * u32 / 4), rel=1e-12
    )
    assert auto_threshold("sqnr_db", "torch.float32", "torch.float32")[0] == pytest.approx(75.26, abs=0.01)
    assert auto_threshold("sqnr_db", "torch.int64", "torch.int64")[0] == math.inf
    # no dtype-derived scale, or unknown dtypes: the fixed default
    for name, fixed in (
        ("max_abs", 1e-3),
        ("mean_abs", 1e-4),
        ("max_rel", 1e-2),
        ("mismatch", 0.0),
        ("equal", 1.0),
        ("max_abs_cast", 1e-3),
    ):
        assert auto_threshold(name, "torch.float32", "torch.float32") == (fixed, "default")
    assert auto_threshold("rel_diff", "torch.float32", "") == (1e-3, "default")


def test_thresholds_numbers_dicts_and_auto_entries():
    row = {"op": "model.layers.0.mlp", "dtype_a": "torch.float32", "dtype_b": "torch.float32"}
    attn = {**row, "op": "model.layers.0.attn"}
    assert Thresholds(None, "rel_diff")(row) == Thresholds("auto", "rel_diff")(row) == F32
    assert Thresholds(1e-3, "rel_diff")(row) == 1e-3 and Thresholds(1e-3, "rel_diff").source(row) == ""
    t = Thresholds({"mlp": 1e-2, "attn": "auto"}, "rel_diff")
    assert (t(row), t.source(row)) == (1e-2, "")
    assert (t(attn), t.source(attn)) == (F32, "auto: float32")
    other = {**row, "op": "model.embed"}
    assert Thresholds({"mlp": 1e-2}, "rel_diff")(other) == F32  # no regex matches: auto
    for bad in ("autox", float("nan"), {"mlp": float("nan")}, {"([": 1e-3}):
        with pytest.raises(ValueError):
            Thresholds(bad, "rel_diff")
    with pytest.raises(TypeError):
        Thresholds([1e-3], "rel_diff")


def test_a_one_percent_norm_weight_is_found_by_default(float32_runs):
    d = DumpSet.open(float32_runs["ref"]).diff(float32_runs["norm"])
    div = d.first_divergence()
    assert div.key == "model.layers.1.ln2" and div.pass_ == 0 and not div.structural
    assert 3e-5 < div.value < 1e-4  # ½·(1%)²
    assert div.threshold == F32 and div.reason.endswith("> 1.49e-08 (auto: float32)")
    assert d.first_divergence(threshold=1e-3) is None  # what the fixed default said
    # cosine is blind to a scaled output: it fires at the next entry whose direction moves
    assert d.first_divergence(metric="cosine").key == "model.layers.1.mlp.up"
    by_sqnr = d.first_divergence(metric="sqnr_db")
    assert by_sqnr.key == "model.layers.1.ln2" and "(auto: float32)" in by_sqnr.reason
    # every answer takes "auto" by default and names its threshold
    df = d.divergences()
    assert df["key"].iloc[0] == "model.layers.1.ln2" and (df["threshold"] == F32).all()
    assert d.by_rank_pass().loc[(0, 0), "first"] == "model.layers.1.ln2"
    s = d.summary()
    assert s["first_divergence"]["threshold"] == F32 and s["threshold"].startswith("auto (rel_diff u/4")
    assert "float32 1.49e-08" in s["threshold"]  # the number used, with the reason's digits
    pos = d.per_position("model.layers.1.ln2", dim=1)
    assert pos.attrs["threshold"] == F32 and pos.attrs["threshold_source"] == "auto: float32"
    assert pos.attrs["first_position"] == 0
    assert d.per_position("model.layers.1.ln2", dim=1, threshold=1e-3).attrs["first_position"] == -1


def test_identical_runs_bf16_against_f32_and_reduction_order_find_nothing(float32_runs):
    ref = DumpSet.open(float32_runs["ref"])
    assert ref.diff(float32_runs["ref2"]).first_divergence() is None
    bf16 = ref.diff(float32_runs["bf16"])
    assert bf16.first_divergence() is None  # bfloat16's u/4 = 9.8e-4 on every entry
    assert bf16.first_divergence(metric="cosine") is None
    assert bf16.first_divergence(metric="sqnr_db") is None
    assert bf16.table(progress=False)["rel_diff"].max() > 1e-5  # real bf16 error, below its bar
    split = ref.diff(float32_runs["split"])
    values = split.table(progress=False)["rel_diff"]
    assert values.max() > 0  # another reduction order changed bits ...
    assert values.max() < F32 / 100  # ... far below float32's bar
    assert split.first_divergence() is None
    assert split.first_divergence(metric="cosine") is None


def test_float64_reduction_order_finds_nothing(tmp_path):
    a = _run(tmp_path / "a", make_model(seed=0, dtype=torch.float64))
    b = _run(tmp_path / "b", _split_k(make_model(seed=0, dtype=torch.float64)))
    d = DumpSet.open(a).diff(b)
    assert d.table(progress=False)["rel_diff"].max() > 0  # the bits differ
    assert d.first_divergence() is None
    assert d.first_divergence(metric="cosine") is None and d.first_divergence(metric="sqnr_db") is None
    assert d.first_divergence(threshold=0.0).reason.startswith("rel_diff")  # 0 would flag it


def test_integers_diverge_on_any_difference(tmp_path):
    big = torch.full((4,), 2**60, dtype=torch.int64)
    x = torch.arange(8.0)
    a = write_dump(tmp_path / "a", [{"model.ids": big, "model.x": x}])
    b = write_dump(
        tmp_path / "b", [{"model.ids": big + torch.tensor([0, 0, 1, 0]), "model.x": x.to(torch.float64)}]
    )
    d = DumpSet.open(a).diff(b)
    div = d.first_divergence()
    assert div.key == "model.ids" and div.threshold == 0.0 and div.reason.endswith("(auto: int64)")
    assert d.first_divergence(metric="sqnr_db").key == "model.ids"
    assert d.first_divergence(threshold=1e-3) is None  # rel_diff 2**-122 under a fixed 1e-3
    assert d.divergences()["key"].tolist() == ["model.ids"]  # float32 vs float64: equal values


def _llama_run(path, dtype=torch.float32, **overrides):
    from tdinspect.examples.port import make_hf_llama, port_tokens

    return _run(
        path,
        make_hf_llama(seed=0, **overrides).to(dtype),
        steps=1,
        tokens=lambda seed: port_tokens(seed=seed),
    )


def test_a_rope_theta_change_in_a_tiny_llama_is_found_by_default(tmp_path):
    pytest.importorskip("transformers")
    ref = _llama_run(tmp_path / "ref")
    theta = _llama_run(tmp_path / "theta", rope_theta=12000.0)
    d = DumpSet.open(ref).diff(theta)
    div = d.first_divergence()
    assert div.key == "model.model.rotary_emb[0]" and "(auto: float32)" in div.reason
    assert 2e-5 < div.value < 3e-4
    assert d.first_divergence(threshold=1e-3) is None
    assert DumpSet.open(ref).diff(_llama_run(tmp_path / "ref2")).first_divergence() is None
    bf16 = DumpSet.open(ref).diff(_llama_run(tmp_path / "bf16", torch.bfloat16))
    assert set(bf16.table(progress=False)["dtype_b"]) == {"torch.bfloat16"}
    assert bf16.first_divergence() is None


def test_live_comparison_uses_auto(float32_runs, tmp_path):
    model = make_model(seed=0)
    with torch.no_grad():
        model.layers[1].ln2.weight.mul_(1.01)
    with pytest.raises(tdinspect.DivergenceError) as err:
        with torch.no_grad(), tdinspect.capture(model, compare_to=float32_runs["ref"], environ={}) as dump:
            model(make_tokens(seed=0))
            dump.step()
    offline = DumpSet.open(float32_runs["ref"]).diff(float32_runs["norm"]).first_divergence()
    live = err.value.divergence
    assert (live.key, live.reason, live.threshold) == (offline.key, offline.reason, offline.threshold)
    assert LiveCompare(float32_runs["ref"], threshold=1e-3).threshold.fixed == 1e-3
    with (
        torch.no_grad(),
        tdinspect.capture(model, compare_to=float32_runs["ref"], threshold=1e-3, environ={}) as dump,
    ):
        model(make_tokens(seed=0))  # the old fixed default lets it through
        dump.step()


def test_cli_auto_is_the_default_and_is_shown(float32_runs, capsys):
    ref, norm = str(float32_runs["ref"]), str(float32_runs["norm"])
    assert main(["first-divergence", ref, norm]) == 1
    out = capsys.readouterr().out
    assert "model.layers.1.ln2" in out and "(auto: float32)" in out
    assert "threshold: auto (rel_diff u/4" in out
    assert main(["first-divergence", ref, norm, "--threshold", "auto"]) == 1
    assert main(["first-divergence", ref, norm, "--threshold", "1e-3"]) == 0
    assert "threshold: 0.001" in capsys.readouterr().out
    assert main(["first-divergence", ref, norm, "--threshold", "ln2=1e-3", "--threshold", "mlp=auto"]) == 1
    assert "model.layers.1.mlp.up" in capsys.readouterr().out
    assert main(["diff", ref, str(float32_runs["bf16"])]) == 0
    out = capsys.readouterr().out
    assert "threshold: auto" in out and "bfloat16 0.000977" in out
    assert main(["first-divergence", ref, norm, "--threshold", "nan"]) == 2
    assert main(["first-divergence", ref, norm, "--threshold", "([=auto"]) == 2
    assert main(["first-divergence", ref, norm, "--threshold", "automatic"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 3


def test_reprs_show_auto(float32_runs):
    from tdinspect.report import DiffSummary

    d = DumpSet.open(float32_runs["ref"]).diff(float32_runs["norm"])
    assert "threshold: auto by default (rel_diff u/4" in repr(d)
    text = repr(DiffSummary(d))
    assert (
        "threshold: auto (rel_diff u/4, u = unit roundoff of the coarser dtype: float32 1.49e-08)" in text
        and "(auto: float32)" in text
    )
    html = d._repr_html_()
    assert "threshold: auto (rel_diff u/4" in html and "(auto: float32)" in html
    assert "threshold: 0.001" in repr(DiffSummary(d, threshold=1e-3))
    assert "(auto: float32)" in repr(d.first_divergence())


def test_plots_draw_each_entrys_auto_threshold(float32_runs):
    import matplotlib.pyplot as plt

    d = DumpSet.open(float32_runs["ref"]).diff(float32_runs["bf16"])
    fig = tdinspect.plot.divergence(d)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert "threshold auto, per entry\n(above diverges)" in labels and ax.get_title() == "no divergence"
    step = next(line for line in ax.lines if line.get_label().startswith("threshold auto"))
    assert set(step.get_ydata()) == {2.0**-8 / 4}  # bfloat16's u/4 on every entry
    fixed = tdinspect.plot.divergence(d, threshold=1e-5).axes[0]
    assert "threshold 1.0e-05\n(above diverges)" in fixed.get_legend_handles_labels()[1]
    assert fixed.get_title().startswith("first divergence:")
    norm = DumpSet.open(float32_runs["ref"]).diff(float32_runs["norm"])
    rp = tdinspect.plot.rank_pass(norm)
    assert rp.axes[0].get_title() == "first: rank 0, pass 0: model.layers.1.ln2"
    pp = tdinspect.plot.per_position(norm, dim=1, keys=["model.layers.1.ln1", "model.layers.1.ln2"])
    assert pp.axes[0].get_title() == "rel_diff per position (threshold auto): diverges from position 0 on"
    plt.close("all")


# -- op level: a float32 op on bfloat16-rounded values carries bfloat16 error -----------------
def _llama_ops(path, dtype=torch.float32, norm_scale=None, layer=1):
    """A tiny HF Llama (eager attention, no padding mask: HF builds no mask constant from
    ``finfo(dtype).min`` that would differ between the dtypes) captured op by op."""
    from tdinspect.examples.port import make_hf_llama, port_tokens

    model = make_hf_llama(seed=0)
    model.config._attn_implementation = "eager"
    if norm_scale is not None:
        with torch.no_grad():
            model.model.layers[layer].post_attention_layernorm.weight.mul_(norm_scale)
    model = model.to(dtype)
    with torch.no_grad(), tdinspect.capture_ops(path, model=model, environ={}) as dump:
        model(port_tokens(seed=0))
        dump.step()
    return path


@pytest.fixture(scope="module")
def llama_ops(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("auto_ops")
    return {
        "f32": _llama_ops(root / "f32"),
        "bf16": _llama_ops(root / "bf16", torch.bfloat16),
        "norm": _llama_ops(root / "norm", norm_scale=1.01),
        "bf16_norm": _llama_ops(root / "bf16_norm", torch.bfloat16, norm_scale=3.0, layer=0),
    }


def test_float32_ops_on_bfloat16_values_are_judged_at_bfloat16(llama_ops):
    """The bf16 model's RMSNorm upcasts to float32 (``aten.pow``, ``aten.mean``...) and its
    rotary ``inv_freq`` is rounded to bf16 before ``aten.sin``: both sides' entries are
    float32 there, yet they carry bf16 rounding. The bf16 run also has casts
    (``aten._to_copy``) the float32 run has not: those are structure, listed apart."""
    d = DumpSet.open(llama_ops["f32"]).diff(llama_ops["bf16"])
    assert d.first_divergence(structural="report") is None
    assert d.first_divergence(metric="cosine", structural="report") is None
    assert d.first_divergence(metric="sqnr_db", structural="report") is None
    df = d.divergences()
    assert len(df) and df["structural"].all() and (df["reason"] == "only in B").all()
    assert df["key"].str.contains("/aten._to_copy.default").all()
    t = d.table(progress=False).set_index("key")
    sin = t.loc["model.model.rotary_emb/aten.sin.default[out0]"]
    pow_ = t.loc["model.model.norm/aten.pow.Tensor_Scalar[out0]"]
    for row in (sin, pow_):
        assert (row["dtype_a"], row["dtype_b"], row["upstream"]) == (
            "torch.float32",
            "torch.float32",
            "bfloat16",
        )
        assert F32 < row["rel_diff"] < 9.8e-4  # over float32's bar, bf16 rounding only
    # a real bug in the bf16 run (a norm weight 3x) is still found; float32 ops after
    # it are judged at bfloat16 and say why
    bug = DumpSet.open(llama_ops["f32"]).diff(llama_ops["bf16_norm"])
    div = bug.first_divergence(structural="report")
    assert div is not None and div.key.startswith("model.model.layers.0.post_attention_layernorm/")
    why = bug.divergences()
    up = why[why["why"].str.endswith("(auto: bfloat16 upstream)")]
    assert len(up) and (up["dtype_a"] == "torch.float32").all() and (up["dtype_b"] == "torch.float32").all()
    assert (
        up["why"].iloc[0].startswith("rel_diff ")
        and " > 0.000977 (auto: bfloat16 upstream)" in up["why"].iloc[0]
    )


def test_float32_op_level_bug_is_found_at_its_first_op(llama_ops):
    d = DumpSet.open(llama_ops["f32"]).diff(llama_ops["norm"])
    div = d.first_divergence()
    assert div.key.startswith("model.model.layers.1.post_attention_layernorm/aten.mul.Tensor")
    assert div.reason.endswith("> 1.49e-08 (auto: float32)") and div.threshold == F32
    assert set(d.table(progress=False)["upstream"]) <= {"float32", ""}  # nothing coarser ran
    assert DumpSet.open(llama_ops["f32"]).diff(llama_ops["f32"]).first_divergence() is None


def test_live_keeps_a_running_upstream_dtype(llama_ops):
    offline = DumpSet.open(llama_ops["f32"]).diff(llama_ops["bf16"])
    table = offline.table(progress=False)
    live = LiveCompare(llama_ops["f32"], on_divergence="record")
    b = DumpSet.open(llama_ops["bf16"]).get_pass(0)
    for key in b.keys:  # B's execution order, as capture feeds them
        live.entry(key, b.tensor(key), pass_=0)
    live.end_pass(0)
    rows = pd.DataFrame(live.rows)
    both = rows[~rows["structural"]].merge(table, on="key", suffixes=("", "_off"))
    assert len(both) > 100 and (both["upstream"] == both["upstream_off"]).all()
    assert live.first.structural and live.first.reason == "only in B"
    thr = Thresholds("auto", "rel_diff")
    assert not any(thr(r) < r["rel_diff"] for r in both.to_dict("records"))


def test_cli_threshold_line_shows_the_numbers_used_for_the_metric_asked(float32_runs, capsys):
    ref, bf16, norm = (str(float32_runs[k]) for k in ("ref", "bf16", "norm"))
    assert main(["diff", ref, bf16, "--metric", "cosine"]) == 0
    out = capsys.readouterr().out
    assert "rel_diff" not in out and "auto by default (cosine 1 - u/4" in out
    assert "bfloat16 0.999023" in out  # 1 - 2**-10, not "0.999"
    assert main(["diff", ref, norm, "--metric", "sqnr_db"]) == 1
    out = capsys.readouterr().out
    assert "rel_diff" not in out and "float32 75.3" in out  # the reason's "< 75.3"
    frame = pd.DataFrame({"op": ["x"], "dtype_a": ["torch.float16"], "dtype_b": ["torch.float16"]})
    assert Thresholds("auto", "cosine").describe(frame).endswith("float16 0.999878)")
    assert Thresholds("auto", "rel_diff").describe(frame).endswith("float16 0.000122)")


def test_cli_header_names_auto_only_when_auto_is_used(float32_runs, capsys):
    """An explicit --threshold is not contradicted by an "auto by default" header."""
    ref, norm = str(float32_runs["ref"]), str(float32_runs["norm"])
    assert main(["diff", ref, norm, "--threshold", "1e-3"]) == 0  # 4.95e-5 < 1e-3
    out = capsys.readouterr().out
    assert "auto by default" not in out and "threshold: 0.001\n" in out
    assert main(["diff", ref, norm]) == 1
    assert "threshold: auto by default (rel_diff u/4" in capsys.readouterr().out


def test_a_given_threshold_near_one_is_written_with_its_digits(float32_runs):
    """A number given shows as written, never rounded to 1 (``cosine 0.9996 < 1`` named a
    threshold nobody gave): one rule for the digits of every reason."""
    d = DumpSet.open(float32_runs["ref"]).diff(float32_runs["norm"])
    div = d.first_divergence(threshold=0.99999999, metric="cosine")
    value = f"{div.value:.12g}"
    assert div.reason.endswith(" < 0.99999999") and div.reason.startswith("cosine 0.99")
    shown = div.reason.split()[1]
    assert shown != "1" and float(shown) < 0.99999999 and value.startswith(shown[:-1])
    assert d.first_divergence(threshold=1e-9).reason.endswith(" > 1e-09")


@pytest.fixture(scope="module")
def half_llama_runs(tmp_path_factory):
    """A tiny Hugging Face Llama in float16, eager attention against sdpa (rounding noise from
    the first attention on), the second run with layer 1's down_proj weight 1% off: a fault
    rel_diff sees at ~5e-5, under float16's auto threshold (1.2e-4)."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("half_llama")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, impl, scale in (("eager", "eager", 1.0), ("sdpa", "sdpa", 1.0), ("scaled", "sdpa", 1.01)):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(torch.float16).eval()
        model.config._attn_implementation = impl
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.mul_(scale)
        runs[name] = _run(root / name, model, steps=1, tokens=lambda seed: tokens)
    return runs


def test_no_divergence_names_the_nearest_entry_and_how_much_it_adds(half_llama_runs, capsys):
    """A 1% fault under the threshold: the answer stays "no divergence" (the threshold is the
    rule), but the summary, the CLI and DiffSummary name the faulty module as the nearest,
    its error far above everything before it; runs that differ by rounding alone name their
    noisiest entry, with a far smaller growth, and identical runs name none."""
    ref = DumpSet.open(half_llama_runs["eager"])
    diff = ref.diff(half_llama_runs["scaled"])
    assert diff.first_divergence() is None
    near = diff.summary()["nearest"]
    assert near["key"] == "model.model.layers.1.mlp.down_proj" and near["pass"] == 0
    assert 0.05 < near["share"] < 1 and near["value"] < near["threshold"]
    assert near["growth"] > 20, near  # makes the error, not inherits it
    assert near["text"].startswith("model.model.layers.1.mlp.down_proj (pass 0): rel_diff ")
    noise = ref.diff(half_llama_runs["sdpa"]).nearest()
    assert noise["share"] < near["share"] / 10 and (noise["growth"] or 0) < near["growth"] / 5
    assert ref.diff(half_llama_runs["eager"]).nearest() is None  # identical: nothing to name

    assert main(["first-divergence", str(half_llama_runs["eager"]), str(half_llama_runs["scaled"])]) == 0
    out = capsys.readouterr().out
    assert "no divergence" in out and "nearest: model.model.layers.1.mlp.down_proj (pass 0)" in out
    assert main(["diff", str(half_llama_runs["eager"]), str(half_llama_runs["scaled"])]) == 0
    assert "nearest: model.model.layers.1.mlp.down_proj" in capsys.readouterr().out
    assert main(["first-divergence", str(half_llama_runs["eager"]), str(half_llama_runs["eager"])]) == 0
    assert "nearest" not in capsys.readouterr().out

    shown = DiffSummary(diff)
    assert "nearest: model.model.layers.1.mlp.down_proj" in repr(shown)
    assert "nearest: model.model.layers.1.mlp.down_proj" in shown._repr_html_()


def test_stats_rel_auto_sits_above_the_rounding_of_narrow_dtypes(tmp_path):
    """Statistics only, a bfloat16 model against itself with each Linear's reduction split in
    two halves summed in bfloat16 (another legitimate kernel): its statistics move by a few bfloat16
    roundings, which the fixed 1e-3 called a divergence (a compiled bf16 model against eager
    read 0.0063). "auto" is max(1e-3, 4u): 0.0156 for bfloat16, 1e-3 for float32; a 5% scale
    planted in one Linear is still found."""
    import torch.nn.functional as F

    import tdinspect
    from tdinspect.examples.models import make_model, make_tokens

    assert auto_threshold("stats_rel", "torch.bfloat16", "torch.bfloat16") == (4 * 2.0**-8, "auto: bfloat16")
    assert auto_threshold("stats_rel", "torch.float32", "torch.float32") == (1e-3, "auto: float32")
    assert auto_threshold("stats_rel", "torch.float16", "torch.float16")[0] == 4 * 2.0**-11

    def run(folder, scale=None):
        model = make_model(seed=0).to(torch.bfloat16)
        handles = []
        if scale is not None:

            def split_k(mod, args, out):  # two bfloat16 halves of the reduction, then their sum
                x, w, h = args[0], mod.weight, mod.weight.shape[1] // 2
                return F.linear(x[..., :h], w[:, :h]) + F.linear(x[..., h:], w[:, h:], mod.bias)

            for mod in model.modules():
                if isinstance(mod, torch.nn.Linear):
                    handles.append(mod.register_forward_hook(split_k))
            if scale != 1:
                handles.append(model.layers[1].mlp.down.register_forward_hook(lambda m, a, o: o * scale))
        with torch.no_grad(), tdinspect.capture(model, folder, stats_only=True) as dump:
            model(make_tokens(seed=0))
            dump.step()
        return tdinspect.DumpSet.open(folder)

    ref, other, bug = run(tmp_path / "ref"), run(tmp_path / "f32", 1), run(tmp_path / "bug", 1.05)
    d = ref.diff(other)
    worst = d.table(progress=False)["stats_rel"].max()
    assert 1e-3 < worst < 4 * 2.0**-8, worst  # past the old fixed threshold, inside the auto one
    assert d.first_divergence() is None
    found = ref.diff(bug).first_divergence()
    assert found is not None and found.key == "model.layers.1.mlp.down"
