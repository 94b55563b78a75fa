"""DumpSet and Diff on real captured dumps and on hand-written dumps in the documented layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tdinspect
from tdinspect import DumpFormatError, DumpSet
from tdinspect.compare.thresholds import threshold_fn
from tdinspect.numerics.metrics import compare_tensors

from .conftest import only_folder


def write_dump(root, passes, rank=0, pid=1):
    """Write ``passes`` (a list of {key: tensor}) with plain torch.save: no sidecars."""
    folder = root / f"rank{rank}_pid{pid}"
    folder.mkdir(parents=True, exist_ok=True)
    for i, tensors in enumerate(passes):
        torch.save(tensors, folder / f"pass{i:05d}.pt")
    return root


# -- DumpSet ------------------------------------------------------------------------------
def test_open_folder_rank_folder_and_pass_file(runs):
    full = DumpSet.open(runs["ref"])
    rank = DumpSet.open(only_folder(runs["ref"]))
    one = DumpSet.open(only_folder(runs["ref"]) / "pass00001.pt")
    assert full.passes == rank.passes == [0, 1, 2] and one.passes == [1]
    assert full.ops == rank.ops and full.ops[0] == "model.embed"
    assert "model.expert" in full.ops and "model.expert::call1" not in full.ops
    assert full.level == "module" and not full.stats_only
    assert "40 ops x up to 3 calls x 3 passes" in repr(full)
    assert "<table>" in full._repr_html_()


def test_cube_dims_stats_order_and_coords(runs):
    ds = DumpSet.open(runs["ref"])
    cube = ds.to_xarray()
    assert dict(cube.sizes) == {"op": 40, "call": 3, "pass": 3}
    for v in ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "numel", "order"):
        assert v in cube
    t = ds.tensor("model.layers.1.mlp.down", pass_=2)
    got = float(cube["absmax"].sel(op="model.layers.1.mlp.down", call=0).sel({"pass": 2}))
    assert got == pytest.approx(float(t.abs().max()), rel=1e-6)
    # calls that never happened are missing values, not errors
    assert math.isnan(float(cube["mean"].sel(op="model.lm_head", call=2).sel({"pass": 0})))
    assert not math.isnan(float(cube["mean"].sel(op="model.expert", call=2).sel({"pass": 0})))
    # order is the true execution order: expert calls interleave with nothing else here
    orders = cube["order"].sel(op="model.expert").sel({"pass": 0}).values.tolist()
    assert orders == [37.0, 38.0, 39.0]
    row = cube.sel(op="model.layers.3.attn.o_proj")
    assert (
        row["stack"].item(),
        row["layer"].item(),
        row["leaf"].item(),
        row["module_type"].item(),
        row["level"].item(),
        row["dtype"].item(),
    ) == ("model.layers", 3, "attn.o_proj", "Linear", "module", "float32")


def test_tensor_lazy_call_and_errors(runs):
    ds = DumpSet.open(runs["ref"])
    a = ds.tensor("model.expert", call=2, pass_=1)
    assert torch.equal(a, ds.tensor("model.expert::call2", pass_=1))
    with pytest.raises(KeyError, match="no entry"):
        ds.tensor("model.nothing")
    with pytest.raises(KeyError, match="no pass 7"):
        ds.tensor("model.embed", pass_=7)


def test_sel_and_filter(runs):
    ds = DumpSet.open(runs["ref"])
    small = ds.filter(r"layers\.0\.").sel(pass_=[0, 2])
    assert small.passes == [0, 2]
    assert all(o.startswith("model.layers.0.") for o in small.ops) and len(small.ops) == 9
    assert small.to_xarray().sizes["op"] == 9
    assert ds.sel(op="model.lm_head").ops == ["model.lm_head"]
    with pytest.raises(ValueError, match="invalid regex"):
        ds.filter("(")


def test_dumps_without_sidecars_compute_stats(tmp_path):
    x = torch.arange(12.0).reshape(3, 4)
    write_dump(tmp_path, [{"model.a": x, "model.b": -x, "model.a::call1": x * 2}])
    ds = DumpSet.open(tmp_path)
    assert ds.pass_indexes()[0].stats is None  # opening read no tensor data
    cube = ds.to_xarray(progress=False)
    assert float(cube["max"].sel(op="model.a", call=1).sel({"pass": 0})) == 22.0
    assert float(cube["min"].sel(op="model.b", call=0).sel({"pass": 0})) == -11.0
    assert float(cube["order"].sel(op="model.a", call=1).sel({"pass": 0})) == 2.0


def test_tensor_diff_of_dumps_without_sidecars_computes_no_statistics(tmp_path):
    """Statistics would be a second full read of every tensor; a tensor diff does not need them."""
    x = torch.arange(12.0).reshape(3, 4)
    write_dump(tmp_path / "a", [{"model.a": x, "model.b": -x}] * 2)
    write_dump(tmp_path / "b", [{"model.a": x, "model.b": -x + 1}] * 2)
    a, b = DumpSet.open(tmp_path / "a"), DumpSet.open(tmp_path / "b")
    div = a.diff(b).first_divergence()
    assert div.key == "model.b" and div.pass_ == 0
    assert a.diff(b).table(progress=False)["max_abs"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert all(pi.stats is None for ds in (a, b) for pi in ds.pass_indexes())


def test_open_errors_and_on_error_warn(tmp_path):
    write_dump(tmp_path, [{"model.a": torch.ones(2)}] * 3)
    folder = tmp_path / "rank0_pid1"
    (folder / "pass00001.pt").write_bytes(b"garbage")
    with pytest.raises(DumpFormatError, match="pass00001.pt"):
        DumpSet.open(tmp_path)
    with pytest.warns(RuntimeWarning, match="pass00001.pt"):
        ds = DumpSet.open(tmp_path, on_error="warn")
    assert ds.passes == [0, 2] and len(ds.skipped) == 1


# -- Diff ---------------------------------------------------------------------------------
def test_identical_runs_do_not_diverge(runs):
    diff = DumpSet.open(runs["ref"]).diff(runs["ref2"])
    assert diff.first_divergence() is None
    m = diff.to_xarray()
    assert float(m["rel_diff"].max()) == 0.0 and float(m["equal"].min()) == 1.0


def test_wrong_layer_found_first(runs):
    diff = DumpSet.open(runs["ref"]).diff(runs["wrong"])
    div = diff.first_divergence()
    assert (div.op, div.call, div.pass_, div.key, div.metric) == (
        "model.layers.2.mlp.down",
        0,
        0,
        "model.layers.2.mlp.down",
        "rel_diff",
    )
    assert div.value > 1e-3 and "rel_diff" in div.reason
    assert diff.passes_read == [(0, 0)]  # pass 0 diverges: nothing else was read
    assert [k for k, _ in div.before][-1] == "model.layers.2.mlp.act"
    grow = diff.growth().query("`pass` == 0").sort_values("growth", ascending=False)
    assert grow.iloc[0]["key"] == "model.layers.2.mlp.down"
    table = diff.divergences()
    assert table.iloc[0]["key"] == "model.layers.2.mlp.down"
    assert set(table["pass"]) == {0, 1, 2}
    # per-name thresholds: loosen the broken layer and the next offender becomes first
    div2 = diff.first_divergence(threshold={r"layers\.2\.mlp\.down": 1.0, r".": 1e-5})
    assert div2.key == "model.layers.3.ln1" and div2.threshold == 1e-5
    assert "First divergence" in div._repr_html_()


@pytest.mark.parametrize(
    "metric,threshold",
    [("cosine", 0.99999), ("sqnr_db", 40.0), ("equal", 1.0), ("max_abs", 1e-3), ("mismatch", 0.0)],
)
def test_other_metrics_point_at_the_same_layer(runs, metric, threshold):
    diff = DumpSet.open(runs["ref"]).diff(runs["wrong"])
    assert diff.first_divergence(threshold, metric).op == "model.layers.2.mlp.down"


def test_float32_vs_bfloat16_dtype_is_not_a_divergence(runs):
    diff = DumpSet.open(runs["ref"]).diff(runs["bf16"])
    rows = diff.table(progress=False)
    assert not rows["structural"].any()
    assert set(rows["dtype_b"]) == {"torch.bfloat16"}
    assert rows["rel_diff_cast"].notna().all()
    # error grows along the network; the bf16 rounding floor stays small
    assert rows["rel_diff"].max() < 1e-3
    assert diff.first_divergence(1e-6) is not None


def test_interleaved_call1_of_earlier_op_is_first(tmp_path):
    x = torch.ones(4)
    a = [{"model.a": x, "model.b": x, "model.a::call1": x, "model.b::call1": x}]
    b = [{"model.a": x, "model.b": x, "model.a::call1": x + 1, "model.b::call1": x + 1}]
    ds = DumpSet.open(write_dump(tmp_path / "a", a))
    div = ds.diff(write_dump(tmp_path / "b", b)).first_divergence()
    assert (div.op, div.call, div.key, div.order) == ("model.a", 1, "model.a::call1", 2.0)


def test_divergence_in_pass_3_of_5_reads_no_later_pass(tmp_path):
    passes = [{"model.a": torch.full((8,), float(i))} for i in range(5)]
    other = [dict(p) for p in passes]
    other[3] = {"model.a": torch.full((8,), 30.0)}
    a = DumpSet.open(write_dump(tmp_path / "a", passes))
    diff = a.diff(write_dump(tmp_path / "b", other))
    div = diff.first_divergence()
    assert div.pass_ == 3
    assert (0, 4) not in diff.passes_read and (0, 3) in diff.passes_read
    one = a.diff(tmp_path / "b", passes_in_flight=1)  # the memory knob: one pass pair at a time
    assert one.first_divergence().pass_ == 3 and one.passes_read == [(0, p) for p in range(4)]


def test_structural_divergences(tmp_path):
    x = torch.arange(6.0).reshape(2, 3)
    a = [{"model.a": x, "model.b": x, "model.c": x, "model.d": x}]
    b = [
        {
            "model.a": x,
            "model.b": x.reshape(3, 2),
            "model.c": x.masked_fill(x > 4, float("nan")),
            "model.e": x,
        }
    ]
    diff = DumpSet.open(write_dump(tmp_path / "a", a)).diff(write_dump(tmp_path / "b", b))
    rows = diff.table(progress=False).set_index("key")
    assert rows.loc["model.b", "reason"] == "shape [2, 3] vs [3, 2]"
    assert rows.loc["model.c", "reason"] == "NaN/Inf on one side (1 elements)"
    assert rows.loc["model.d", "reason"] == "only in A"
    assert rows.loc["model.e", "reason"] == "only in B"
    assert rows.loc["model.a", "reason"] == ""
    div = diff.first_divergence(threshold=1e9)  # structural ones fire whatever the threshold
    assert div.key == "model.b" and div.structural
    html = diff._repr_html_()
    assert "structural problems" in html and "only in B" in html and "shape [2, 3] vs [3, 2]" in html
    # B-only entries sit right after the reference entry that precedes them in B
    assert list(diff.divergences(threshold=1e9)["key"]) == ["model.b", "model.c", "model.e", "model.d"]


@pytest.mark.parametrize("metric", ["rel_diff", "max_abs", "cosine", "sqnr_db", "mismatch", "equal"])
def test_vectorised_verdicts_agree_with_the_row_by_row_rule(runs, tmp_path, metric):
    """first_divergence/by_rank_pass/divergences judge a pass at once; the rule, row by row:
    structural diverges, another reason never does, else the metric's own direction."""

    def rule(row, m, thr_fn):
        if row["structural"]:
            return True
        if row["reason"]:
            return False
        return m.diverges(row[m.name], thr_fn(row))

    x = torch.arange(6.0).reshape(2, 3)
    a = [{"model.a": x, "model.b": x, "model.c": x, "model.d": x}]
    b = [
        {
            "model.a": x + 1e-3,
            "model.b": x.reshape(3, 2),
            "model.c": x.masked_fill(x > 4, float("nan")),
            "model.e": x,
        }
    ]
    diffs = [
        DumpSet.open(runs["ref"]).diff(runs["wrong"]),
        DumpSet.open(runs["ref"]).diff(runs["bf16"]),
        DumpSet.open(write_dump(tmp_path / "a", a)).diff(write_dump(tmp_path / "b", b)),
    ]
    # 1.0: a threshold every metric takes (a cosine of 10 is refused: every entry would diverge)
    per_name = {r"mlp": 1e-9, r"attn": 1.0}
    half_auto = {r"mlp": "auto", r"attn": 1.0}
    seen = []
    for diff in diffs:
        m = diff._check_metric(metric)
        for threshold in (None, "auto", 1e-3, per_name, half_auto):
            thr_fn = threshold_fn(threshold, m.name)
            for _, rows in diff.iter_passes():
                vectorised = diff._hits(rows, m, thr_fn).tolist()
                one_by_one = [rule(r, m, thr_fn) for r in rows.to_dict("records")]
                assert vectorised == one_by_one
                seen += vectorised
    assert any(seen) and not all(seen)  # both answers were exercised


def test_stats_only_dumps_diff_by_statistics(runs):
    diff = DumpSet.open(runs["stats"]).diff(runs["stats_wrong"])
    assert diff.mode == "stats" and diff.default_metric == "stats_rel"
    div = diff.first_divergence()
    assert div.op == "model.layers.2.mlp.down" and div.metric == "stats_rel"
    with pytest.raises(ValueError, match="statistics only"):
        diff.first_divergence(metric="rel_diff")
    assert DumpSet.open(runs["stats"]).diff(runs["stats"]).first_divergence() is None


def test_sequence_alignment_of_fused_vs_unfused(tmp_path):
    x = torch.randn(4, 4)
    a = [
        {
            "model/aten.mm.default[out0]": x,
            "model/aten.gelu.default[out0]": x.relu(),
            "model/aten.add.Tensor[out0]": x + 1,
        }
    ]
    b = [
        {
            "model/aten.mm.default[out0]": x,
            "model/aten.mul.Tensor[out0]": x * 0.5,
            "model/aten.tanh.default[out0]": x.tanh(),
            "model/aten.add.Tensor[out0]": x + 1,
        }
    ]
    diff = DumpSet.open(write_dump(tmp_path / "a", a)).diff(write_dump(tmp_path / "b", b), align="sequence")
    rows = diff.table(progress=False)
    matched = rows[rows["reason"] == ""]
    assert list(matched["key"]) == ["model/aten.mm.default[out0]", "model/aten.add.Tensor[out0]"]
    assert (matched["rel_diff"] == 0).all()
    assert sorted(rows.loc[rows["reason"] == "unmatched in A", "key"]) == ["model/aten.gelu.default[out0]"]
    assert sorted(rows.loc[rows["reason"] == "unmatched in B", "key"]) == [
        "model/aten.mul.Tensor[out0]",
        "model/aten.tanh.default[out0]",
    ]


def test_ranks_and_rank_mismatch(tmp_path):
    x = torch.ones(3)
    for r in (0, 1):
        write_dump(tmp_path / "a", [{"model.a": x}, {"model.a": x}], rank=r, pid=10 + r)
        write_dump(tmp_path / "b", [{"model.a": x}, {"model.a": x + (r == 1)}], rank=r, pid=20 + r)
    write_dump(tmp_path / "c", [{"model.a": x}, {"model.a": x}], rank=0, pid=30)
    a = DumpSet.open(tmp_path / "a")
    assert a.ranks == [0, 1] and dict(a.to_xarray(progress=False).sizes)["rank"] == 2
    div = a.diff(tmp_path / "b").first_divergence()
    assert (div.rank, div.pass_) == (1, 1)
    div = a.diff(tmp_path / "c").first_divergence()
    assert div.reason == "rank 1 only in A" and div.rank == 1 and div.pass_ == 0


# -- metrics edge cases -------------------------------------------------------------------
def test_metric_edge_cases():
    z = torch.zeros(5)
    m = compare_tensors(z, z.clone())
    assert m["rel_diff"] == 0 and m["cosine"] == 1 and m["sqnr_db"] == math.inf and m["equal"] == 1
    nan = torch.tensor([1.0, float("nan"), 3.0])
    m = compare_tensors(nan.clone(), nan)
    assert m["nonfinite_mismatch"] == 0 and m["rel_diff"] == 0
    m = compare_tensors(torch.tensor([1.0, 2.0, 3.0]), nan)
    assert m["nonfinite_mismatch"] == 1
    inf = torch.tensor([float("inf"), 1.0])
    assert compare_tensors(torch.tensor([-float("inf"), 1.0]), inf)["nonfinite_mismatch"] == 1
    tiny = torch.tensor([1e-40, 0.0])
    m = compare_tensors(tiny * 2, tiny)
    assert np.isfinite(m["rel_diff"]) and m["max_abs"] < 1e-38
    one = compare_tensors(torch.tensor([2.0]), torch.tensor([1.0]))
    assert one["max_abs"] == 1.0 and one["rel_diff"] == pytest.approx(1 / 5)
    assert one["cosine"] == pytest.approx(1.0) and one["max_rel"] == 1.0
    ints = compare_tensors(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]))
    assert ints["max_abs"] == 1.0 and ints["equal"] == 0.0
    e = compare_tensors(torch.empty(0), torch.empty(0))
    assert e["equal"] == 1.0


def test_compare_never_modifies_its_inputs():
    y = torch.tensor([-1.0, 2.0]).expand(3, 2)  # a broadcast view: in-place ops would fail or corrupt
    x = torch.tensor([[-1.5, 2.0]] * 3)
    before = (x.clone(), y.clone())
    compare_tensors(x, y)
    assert torch.equal(x, before[0]) and torch.equal(y, before[1])


def _gpt2_stats_run(path, attn="sdpa", ln_scale=None):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.set_attn_implementation(attn)
    if ln_scale is not None:
        with torch.no_grad():
            model.transformer.h[1].ln_1.weight.mul_(ln_scale)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    with (
        torch.no_grad(),
        tdinspect.capture(model, path, environ={}, stats_only=True, warn_unfired=False) as dump,
    ):  # attn_dropout: eager only
        model(ids)
        dump.step()
    return path


def test_stats_rel_is_scaled_by_the_tensor_not_by_a_mean_near_zero(tmp_path):
    """A LayerNorm's output has a mean of ~1e-9: eager against sdpa attention read as
    stats_rel 33 (the mean's own rounding over itself), a false divergence in
    statistics-only diffs; min, max and mean now compare against the reference's absmax."""
    ref = DumpSet.open(_gpt2_stats_run(tmp_path / "sdpa"))
    eager = ref.diff(_gpt2_stats_run(tmp_path / "eager", attn="eager"))
    assert eager.mode == "stats" and eager.first_divergence() is None
    table = eager.table(progress=False)
    assert table["stats_rel"].max() < 1e-5  # float32 noise, 4 orders under the 1e-3 threshold
    ln = table.set_index("key").loc["model.transformer.h.0.ln_2"]
    stats = ref.entries(progress=False).set_index("key").loc["model.transformer.h.0.ln_2"]
    assert abs(stats["mean"]) < 1e-6 * stats["absmax"]  # the mean the old ratio divided by
    assert ln["stats_rel"] < 1e-5
    # a real bug is still named at its entry: one LayerNorm weight 1% off
    bug = ref.diff(_gpt2_stats_run(tmp_path / "bug", ln_scale=1.01)).first_divergence()
    assert bug.key == "model.transformer.h.1.ln_1" and bug.value == pytest.approx(0.01, rel=0.05)
