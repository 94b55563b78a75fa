"""Issue 30: capture inside torch.compile'd graphs (CPU inductor), against the eager run.

Inductor compiles take seconds to tens of seconds on CPU: each capture in graph mode
compiles its model once, and the compiled runs are shared by module-scoped fixtures.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import tdinspect
from tdinspect import DumpSet
from tdinspect.dumper import compiled as graphs
from tdinspect.dumper.checks import HealthCheck
from tdinspect.dumper.recorder import Recorder
from tdinspect.errors import DivergenceError, NonFiniteError
from tdinspect.examples.models import make_compile_sensitive, make_model, make_tokens
from tdinspect.examples.port import make_hf_llama, port_tokens
from tdinspect.numerics.stats import STAT_NAMES, capture_stats, complete_graph_row, graph_stats

SMALL = dict(n_layers=2, d_model=16, n_heads=2)  # fewer ops: a faster inductor compile


def _sidecars(ds: DumpSet) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(ds.path.glob("**/pass*.json"))]


def _capture(model, folder, run, passes=1, **options):
    """``run(model)`` under a capture, once per pass; the outputs, capture and warnings."""
    outs = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad(), tdinspect.capture(model, folder, environ={}, **options) as dump:
            for _ in range(passes):
                outs.append(run(model))
                dump.step()
    return outs, dump, [str(w.message) for w in seen]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny HF Llama: captured eagerly, then compiled (inductor, fullgraph=True) and run
    without capture, captured for two passes, and run again after the capture closed."""
    root = tmp_path_factory.mktemp("llama")
    model, tokens = make_hf_llama(0), port_tokens()

    def run(m):
        return m(tokens, use_cache=False).logits

    _capture(model, root / "eager", run)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        plain = run(compiled)
    outs, dump, said = _capture(compiled, root / "compiled", run, passes=2)
    with torch.no_grad():
        after = run(compiled)
    torch._dynamo.reset()
    return dict(
        eager=DumpSet.open(root / "eager"),
        compiled=DumpSet.open(root / "compiled"),
        plain=plain,
        outs=outs,
        after=after,
        counts=dump.compile_counts,
        said=said,
    )


def test_compiled_llama_lines_up_with_eager_entry_for_entry(llama):
    eager, compiled = llama["eager"], llama["compiled"]
    assert compiled.ops == eager.ops and len(eager.ops) > 20
    assert not [op for op in compiled.ops if "_orig_mod" in op]
    assert compiled.passes == [0, 1]
    # compiled against eager: fused kernels round differently, within float32 noise
    diff = eager.diff(compiled.sel(pass_=0))
    assert diff.first_divergence(metric="max_abs", threshold=1e-4) is None


def test_compiled_outputs_are_bitwise_the_same_with_and_without_capture(llama):
    plain, (first, second), after = llama["plain"], llama["outs"], llama["after"]
    assert torch.equal(first, plain) and torch.equal(second, plain) and torch.equal(after, plain)


def test_the_recorded_values_are_what_the_compiled_graph_computed(llama):
    """The last recorded entry is lm_head's output: the compiled model's logits, bitwise."""
    compiled = llama["compiled"]
    assert compiled.ops[-1] == "model.lm_head"
    assert torch.equal(compiled.tensor("model.lm_head", pass_=1), llama["outs"][1])


def _assert_float32_sums(row: torch.Tensor, expected: torch.Tensor, msg: str, exact_rtol: float = 0) -> None:
    """``row`` is ``expected`` (float64 sums) up to float32 cascade sums: min, max, absmax and
    the counts exactly (``exact_rtol``: a sidecar's rounding); mean, std and l2 within 1e-5 of
    the values' scale (absmax)."""
    exact = [STAT_NAMES.index(s) for s in ("min", "max", "absmax", "nan", "inf", "numel")]
    torch.testing.assert_close(row[exact], expected[exact], rtol=exact_rtol, atol=0, msg=msg)
    scale = float(expected[STAT_NAMES.index("absmax")])
    torch.testing.assert_close(row, expected, rtol=1e-5, atol=1e-5 * scale, msg=msg)


def test_statistics_computed_in_the_graph_are_eager_capture_statistics(llama):
    """Full capture: the graph computes each entry's statistics (inductor fuses them), the
    record op copies the tensor; the sidecar's statistics are capture_stats of that very
    tensor, up to float32 sums on the CPU (see graph_stats)."""
    compiled = llama["compiled"]
    for doc in _sidecars(compiled):
        entries = doc["entries"]
        assert len(entries["key"]) == len(compiled.ops)
        for key, row in zip(entries["key"], entries["stats"]):
            stored = compiled.tensor(key, pass_=doc["pass"])
            row = torch.tensor(row, dtype=torch.float64)
            _assert_float32_sums(row, capture_stats(stored), key, exact_rtol=1e-7)


def test_graph_stats_is_the_capture_definition_for_every_kind_of_value():
    """One inductor compile over tensors of each kind: NaN and Inf (statistics over the
    finite elements, counted apart), all non-finite, float32 squares that overflow,
    bfloat16, float16, integers, bool, float64 whose squares would overflow or underflow
    (scaled), a transposed view, one element, a mean far from zero.

    On the CPU floating tensors of up to 32 bits take float32 sums and assume finite values:
    a row that is not finite is completed from the tensor (complete_graph_row), and only
    those; the rest are capture_stats as they come from the graph."""
    torch.manual_seed(0)
    x = torch.randn(37, 53)
    holes = x.clone()
    holes[3, :7] = float("nan")
    holes[5, 2] = float("inf")
    holes[9, 9] = -float("inf")
    finite = [
        x,
        torch.randn(64, 33).bfloat16(),
        torch.randn(64, 33).half(),
        torch.randint(-1000, 1000, (17, 19)),
        torch.rand(301) > 0.5,
        torch.randn(50, dtype=torch.float64) * 1e300,
        torch.randn(50, dtype=torch.float64) * 1e-300,
        x.t(),
        torch.randn(1000) + 3,
    ]
    # NaN and Inf, float32 squares that overflow, a mean far past the spread (float32's
    # cancellation; one element: no spread at all): completed from the tensor
    not_finite = [
        holes,
        torch.full((4, 4), float("nan")),
        torch.randn(100) * 1e20,
        torch.randn(1000) + 1e4,
        torch.tensor([2.5]),
    ]
    tensors = finite + not_finite

    def rows(*ts):
        return [graph_stats(t * 1 if t.dtype != torch.bool else t) for t in ts]

    got = torch.compile(rows, fullgraph=True)(*tensors)
    torch._dynamo.reset()
    for t, row in zip(finite, got):
        assert complete_graph_row(row, t) is row
        _assert_float32_sums(row, capture_stats(t), f"{t.dtype} {tuple(t.shape)}")
    for t, row in zip(not_finite, got[len(finite) :]):
        assert not torch.isfinite(row[:6]).all()
        torch.testing.assert_close(
            complete_graph_row(row, t), capture_stats(t), equal_nan=True, rtol=0, atol=0
        )
    nan, inf = STAT_NAMES.index("nan"), STAT_NAMES.index("inf")
    assert complete_graph_row(got[len(finite)], holes)[[nan, inf]].tolist() == [7.0, 2.0]


def test_graph_stats_of_a_tensor_whose_first_element_is_an_outlier():
    """A large first element (an attention sink, a massive activation at token 0) must not
    cost the float32 sums their bits: std and l2 were 5% off for 1000 among a million
    N(0, 1) values, and 0 for 1e5 (sums shifted by the first element cancelled)."""
    torch.manual_seed(0)
    tensors = []
    for first, dtype in ((1e3, torch.float32), (1e5, torch.float32), (500.0, torch.bfloat16)):
        t = torch.randn(1_000_000).to(dtype)
        t[0] = first
        tensors.append(t)

    def rows(*ts):
        return [graph_stats(t * 1) for t in ts]

    got = torch.compile(rows, fullgraph=True)(*tensors)
    torch._dynamo.reset()
    std = STAT_NAMES.index("std")
    for t, row in zip(tensors, got):
        want = capture_stats(t)
        assert complete_graph_row(row, t) is row
        _assert_float32_sums(row, want, f"{t.dtype} first {float(t[0])}")
        assert abs(float(row[std] / want[std]) - 1) < 1e-5


def test_graph_stats_of_a_16_bit_output_are_of_its_stored_values():
    """Inductor's CPU kernel computes a float16/bfloat16 output in float32 and rounds it to
    store; widened back to float32 in the same kernel, it is the unrounded value (a CSE of
    the round trip). The row must be the stored tensor's: an fp16 exp that overflows to Inf
    (the counts were 0 and max 73359), a bfloat16 GELU's max (15.33, stored 15.3125)."""
    x = torch.linspace(-4, 11.2, 1001)

    def outputs(x16, xb):
        y, z = torch.exp(x16), torch.nn.functional.gelu(xb) * 1.37
        return y, z, graph_stats(y), graph_stats(z)

    y, z, ry, rz = torch.compile(outputs, fullgraph=True)(x.half(), x.bfloat16())
    torch._dynamo.reset()
    assert int(torch.isinf(y).sum()) == 8
    for t, row in ((y, ry), (z, rz)):
        torch.testing.assert_close(complete_graph_row(row, t), capture_stats(t), rtol=1e-6, atol=0)
        exact = [STAT_NAMES.index(s) for s in ("min", "max", "absmax", "nan", "inf", "numel")]
        assert complete_graph_row(row, t)[exact].tolist() == capture_stats(t)[exact].tolist()


def test_graph_stats_of_float32_values_whose_squares_fall_below_its_range():
    """float32 values of 1e-30: their squares underflow in the graph's float32 sums (std was
    0, l2 2.9% of its value); the row says it cannot tell, and is completed from the tensor.
    All zeros need no completion."""
    torch.manual_seed(0)
    tensors = [torch.randn(1000) * s for s in (1e-9, 1e-15, 1e-30)] + [torch.zeros(50)]
    got = torch.compile(lambda *ts: [graph_stats(t * 1) for t in ts], fullgraph=True)(*tensors)
    torch._dynamo.reset()
    for t, row in zip(tensors, got):
        _assert_float32_sums(
            complete_graph_row(row, t), capture_stats(t), f"scale {float(t.abs().max()):.1e}"
        )
    assert (
        complete_graph_row(got[0], tensors[0]) is got[0] and complete_graph_row(got[3], tensors[3]) is got[3]
    )


def test_a_non_finite_row_is_reported_from_its_counts():
    """on_nonfinite inside a compiled graph reads the statistics row it was handed."""
    check = HealthCheck("raise")
    check.check_row("model.fine", capture_stats(torch.ones(3)), pass_=0, order=0)
    bad = capture_stats(torch.tensor([1.0, float("nan"), float("inf"), float("inf")]))
    with pytest.raises(NonFiniteError, match=r"model\.bad") as err:
        check.check_row("model.bad", bad, pass_=0, order=1)
    found = err.value.nonfinite
    assert (found.nan, found.inf, found.numel) == (1, 2, 4)


def test_capture_in_a_fullgraph_model_adds_no_graph_break_nor_recompile(llama):
    assert llama["counts"] == {"graphs": 1, "graph_breaks": 0, "recompiles": 0}
    assert not [s for s in llama["said"] if "graph break" in s or "eagerly" in s], llama["said"]
    heads = [doc["compile"] for doc in _sidecars(llama["compiled"])]
    assert heads == [
        {"mode": "graph", "graphs": 1, "graph_breaks": 0, "recompiles": 0},
        {"mode": "graph", "graphs": 0, "graph_breaks": 0, "recompiles": 0},
    ]
    assert all("compile" not in doc for doc in _sidecars(llama["eager"]))


@pytest.fixture(scope="module")
def sensitive(tmp_path_factory):
    """make_compile_sensitive (a GELU that is tanh-approximated only under compile) with
    inputs and parameters recorded, eagerly and compiled (inductor)."""
    root = tmp_path_factory.mktemp("sensitive")
    tokens = make_tokens()
    record = ("inputs", "outputs", "params")
    _capture(make_compile_sensitive(**SMALL), root / "eager", lambda m: m(tokens), record=record)
    torch._dynamo.reset()
    compiled = torch.compile(make_compile_sensitive(**SMALL))
    _, dump, said = _capture(compiled, root / "compiled", lambda m: m(tokens), record=record)
    torch._dynamo.reset()
    return DumpSet.open(root / "eager"), DumpSet.open(root / "compiled"), dump, said


def test_a_module_that_computes_otherwise_when_compiled_is_the_first_divergence(sensitive):
    eager, compiled, dump, _ = sensitive
    found = eager.diff(compiled).first_divergence()
    assert found is not None and found.op == "model.layers.1.mlp.act"
    assert dump.compile_counts["graph_breaks"] == 0 and dump.compile_counts["recompiles"] == 0


def test_inputs_params_and_repeated_calls_are_recorded_inside_the_graph(sensitive):
    eager, compiled, _, _ = sensitive
    assert compiled.ops == eager.ops
    keys = compiled.get_pass(0).keys
    assert keys == eager.get_pass(0).keys
    for key in ("model.expert::call2", "model.layers.0.mlp.up[in][0]", "model.layers.0.mlp.up.weight"):
        assert key in keys
    weight = compiled.tensor("model.layers.0.mlp.up.weight")
    assert torch.equal(weight, eager.tensor("model.layers.0.mlp.up.weight"))
    assert [doc["compile"]["mode"] for doc in _sidecars(compiled)] == ["graph"]


def test_live_comparison_stops_a_compiled_forward_at_the_module_that_moved(sensitive, tmp_path):
    eager = sensitive[0]
    tokens = make_tokens()
    torch._dynamo.reset()
    model = torch.compile(make_compile_sensitive(**SMALL))
    with pytest.raises(DivergenceError) as err, torch.no_grad():
        with tdinspect.capture(model, compare_to=eager, record=("inputs", "outputs", "params")):
            model(tokens)
    torch._dynamo.reset()
    assert err.value.divergence.op == "model.layers.1.mlp.act"


def test_on_nonfinite_and_stats_only_inside_the_graph(tmp_path, monkeypatch):
    """Statistics only: the graph computes each entry's statistics and the record op is
    handed those rows, never the tensors; NaN/Inf counts, and on_nonfinite, come from them."""
    model = make_model(n_layers=3, d_model=16, n_heads=2)
    with torch.no_grad():
        model.layers[2].mlp.up.bias[3] = float("inf")
    tokens = make_tokens()
    _capture(model, tmp_path / "eager", lambda m: m(tokens), stats_only=True)
    handed = []
    for method in ("record", "record_measured"):
        original = getattr(Recorder, method)

        def spy(self, key, tensor, *args, _original=original, _method=method, **kwargs):
            handed.append((_method, tensor))
            return _original(self, key, tensor, *args, **kwargs)

        monkeypatch.setattr(Recorder, method, spy)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    _, dump, said = _capture(
        compiled, tmp_path / "d", lambda m: m(tokens), stats_only=True, on_nonfinite="warn"
    )
    torch._dynamo.reset()
    monkeypatch.undo()
    assert handed and all(method == "record_measured" and t is None for method, t in handed)
    assert any("model.layers.2.mlp.up" in s for s in said), said
    ds, eager = DumpSet.open(tmp_path / "d"), DumpSet.open(tmp_path / "eager")
    assert ds.stats_only and "model.expert::call1" in ds.get_pass(0).keys
    assert _sidecars(ds)[0]["compile"]["mode"] == "graph"
    (got,), (want,) = _sidecars(ds), _sidecars(eager)
    assert got["entries"]["key"] == want["entries"]["key"]
    assert got["entries"]["shape"] == want["entries"]["shape"]
    assert got["entries"]["dtype"] == want["entries"]["dtype"]
    # compiled kernels round otherwise than eager ones: float32 noise, the counts exact, up to
    # the entry the Inf enters at; after it eager and fused kernels make NaN or Inf apart
    got_rows, want_rows = (
        torch.tensor(
            [[math.nan if v is None else v for v in row] for row in doc["entries"]["stats"]],
            dtype=torch.float64,
        )
        for doc in (got, want)
    )
    up = got["entries"]["key"].index("model.layers.2.mlp.up")
    torch.testing.assert_close(got_rows[: up + 1], want_rows[: up + 1], rtol=1e-4, atol=1e-5, equal_nan=True)
    assert got_rows[up, STAT_NAMES.index("inf")] == 2 * 16  # one column of [2, 16, 64]
    nonfinite = slice(STAT_NAMES.index("nan"), STAT_NAMES.index("inf") + 1)
    assert torch.equal(got_rows[:, nonfinite].sum(1) > 0, want_rows[:, nonfinite].sum(1) > 0)
    with pytest.raises(NonFiniteError, match=r"model\.layers\.2\.mlp\.up"), torch.no_grad():
        with tdinspect.capture(torch.compile(model), on_nonfinite="raise"):
            torch.compile(model)(tokens)
    torch._dynamo.reset()


def _rows(doc: dict) -> torch.Tensor:
    return torch.tensor(
        [[math.nan if v is None else v for v in row] for row in doc["entries"]["stats"]], dtype=torch.float64
    )


def test_statistics_recorded_after_the_graph_keep_order_and_count_non_finite_values(tmp_path, monkeypatch):
    """Statistics only, nothing to check at once: the record op leaves the entries for after
    the graph's kernels (graphs.flush, at the next eager hook or step). A model compiled in
    its middle layer only keeps the eager run's order of entries across eager, compiled and
    eager modules; an Inf planted in the compiled layer is counted from the tensor (its
    float32-sum row is not finite); the pass still open at close is written whole."""
    model = make_model(n_layers=3, d_model=16, n_heads=2)
    with torch.no_grad():
        model.layers[1].mlp.up.bias[3] = float("inf")
    tokens = make_tokens()
    _capture(model, tmp_path / "eager", lambda m: m(tokens), stats_only=True)
    torch._dynamo.reset()
    model.layers[1].compile()
    left: list[int] = []  # what each flush found left for later
    flush = graphs.flush
    monkeypatch.setattr(graphs, "flush", lambda: (left.append(len(graphs._pending)), flush()))
    _capture(model, tmp_path / "mixed", lambda m: m(tokens), stats_only=True, compile="graph")
    with torch.no_grad(), tdinspect.capture(model, tmp_path / "unstepped", stats_only=True, compile="graph"):
        model(tokens)  # no step(): close writes the pass
    torch._dynamo.reset()
    assert max(left) >= 9 and not graphs._pending  # the compiled layer's entries, at once
    (want,) = _sidecars(DumpSet.open(tmp_path / "eager"))
    for folder in ("mixed", "unstepped"):
        (got,) = _sidecars(DumpSet.open(tmp_path / folder))
        assert got["compile"]["mode"] == "mixed"
        assert got["entries"]["key"] == want["entries"]["key"]
        up = got["entries"]["key"].index("model.layers.1.mlp.up")
        got_rows, want_rows = _rows(got), _rows(want)
        assert got_rows[up, STAT_NAMES.index("inf")] == 2 * 16  # one column of [2, 16, 64]
        torch.testing.assert_close(
            got_rows[: up + 1], want_rows[: up + 1], rtol=1e-4, atol=1e-5, equal_nan=True
        )


def test_a_compiled_model_run_in_another_thread_records_at_once(tmp_path):
    """The capture's own thread may leave entries for later; another thread's are recorded
    when its graph hands them over (no flush in that thread would come)."""
    import threading

    model, tokens = make_model(**SMALL), make_tokens()
    compiled = torch.compile(model)
    seen: list[int] = []

    def work():
        with torch.no_grad():
            compiled(tokens)
        seen.append(len(graphs._pending))

    with tdinspect.capture(compiled, tmp_path / "d", stats_only=True) as dump:
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        dump.step()
    torch._dynamo.reset()
    assert seen == [0]
    keys = DumpSet.open(tmp_path / "d").get_pass(0).keys
    assert keys[0] == "model.embed" and "model.lm_head" in keys


def test_capture_ops_on_a_compiled_model_records_the_eager_ops_and_says_so(tmp_path):
    model, tokens = make_model(), make_tokens()
    compiled = torch.compile(model)
    with pytest.warns(RuntimeWarning, match="eager aten ops"), torch.no_grad():
        with tdinspect.capture_ops(tmp_path / "ops", model=compiled) as dump:
            out = compiled(tokens)
            dump.step()
    with torch.no_grad():
        assert torch.equal(out, model(tokens))
    ops = DumpSet.open(tmp_path / "ops").ops
    assert any(op.startswith("model.layers.0.mlp.up/aten.") for op in ops), ops[:5]
    assert not [op for op in ops if "_orig_mod" in op]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_are_recorded(tmp_path):
    """mode="reduce-overhead" (CUDA graphs): the replays' values are recorded, as eager's."""
    model, tokens = make_model().cuda(), make_tokens().cuda()
    _capture(model, tmp_path / "eager", lambda m: m(tokens))
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead")
    outs, _, said = _capture(compiled, tmp_path / "graph", lambda m: m(tokens).clone(), passes=3)
    torch._dynamo.reset()
    eager, graph = DumpSet.open(tmp_path / "eager"), DumpSet.open(tmp_path / "graph")
    assert graph.passes == [0, 1, 2] and graph.ops == eager.ops, said
    for p in graph.passes:
        assert torch.equal(graph.tensor("model.lm_head", pass_=p), outs[p].cpu())


def test_a_captured_model_never_shares_a_graph_with_an_uncaptured_twin(tmp_path):
    """Dynamo does not guard on module hooks by default: a second instance of the same class
    reused the first one's graph, compiled without the record op, and captured nothing.
    Dynamo-level behaviour, so a fast backend is enough here."""
    tokens = make_tokens()
    plain, captured = make_model(**SMALL), make_model(**SMALL)
    torch._dynamo.reset()
    fast_plain = torch.compile(plain, backend="aot_eager")
    fast_captured = torch.compile(captured, backend="aot_eager")
    with torch.no_grad():
        fast_plain(tokens)  # compiled first, without hooks
        outs, dump, _ = _capture(fast_captured, tmp_path / "d", lambda m: (fast_plain(tokens), m(tokens)))
    torch._dynamo.reset()
    ds = DumpSet.open(tmp_path / "d")
    keys = ds.get_pass(0).keys  # the captured twin's calls only: expert runs 3 times a forward
    assert len(ds.ops) > 10 and [k for k in keys if "::call" in k] == [
        "model.expert::call1",
        "model.expert::call2",
    ]
    assert torch.equal(ds.tensor("model.lm_head"), outs[0][1])
    assert torch._dynamo.config.skip_nnmodule_hook_guards  # dynamo's default, restored at close
