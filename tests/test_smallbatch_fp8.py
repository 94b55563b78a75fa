"""float8 small pairs in the batch: every code decoded as a pair alone decodes it, same bits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tdinspect.numerics import kernels, metrics_batch
from tdinspect.numerics.metrics import TENSOR_METRICS, compare_tensors, sxy_derived, tolerances

from .recorded import record_dump
from .test_dumpset_diff import write_dump
from .test_live import _tiny_llama
from .test_smallbatch import _assert_bitwise_equal, _tables, bits, same_numbers

FP8 = [dt for dt in metrics_batch.BATCHED if dt.itemsize == 1]


def test_every_float8_dtype_torch_has_is_batched():
    names = {str(dt).removeprefix("torch.") for dt in FP8}
    assert {"float8_e4m3fn", "float8_e5m2"} <= names
    for dt in FP8:  # the batch's decoder is torch's own conversion of every code
        codes = torch.arange(256, dtype=torch.uint8)
        want = codes.view(dt).to(torch.float64).numpy()
        got = kernels.decoded(codes.numpy(), metrics_batch.BATCHED[dt][1])
        assert got.tobytes() == want.tobytes(), dt


def nonfinite_codes(dtype: torch.dtype) -> list[int]:
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return torch.nonzero(~torch.isfinite(values)).flatten().tolist()


# a pair: its reference codes, then how the compared side is made from them
PAIR = st.tuples(
    st.lists(st.integers(0, 255), min_size=1, max_size=300),
    st.sampled_from(["same", "near", "any", "nonfinite", "negzero"]),
    st.integers(0, 2**16),
)


def partner(codes: np.ndarray, how: str, seed: int, dtype: torch.dtype) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = codes.copy()
    if how == "near":  # a neighbouring code (one step of the format) at some elements
        x = np.clip(x.astype(np.int16) + rng.integers(-1, 2, x.shape[0]), 0, 255).astype(np.uint8)
    elif how == "any":
        x = rng.integers(0, 256, x.shape[0]).astype(np.uint8)
    elif how == "nonfinite":  # a NaN (or Inf) code at one element, on one side only
        x[rng.integers(0, x.shape[0])] = rng.choice(nonfinite_codes(dtype))
    elif how == "negzero":
        x[x == 0] = 0x80
    return x


@settings(max_examples=120, deadline=None)
@given(dtype=st.sampled_from(FP8), pairs=st.lists(PAIR, min_size=1, max_size=10))
def test_float8_codes_batched_give_the_bits_of_each_pair_alone(dtype, pairs):
    """Any codes, NaN and Inf codes included: the batch settles a pair with the bits
    compare_tensors gives it alone, or leaves it to compare_tensors."""
    ys = [np.array(codes, np.uint8) for codes, _, _ in pairs]
    xs = [partner(y, how, seed, dtype) for y, (_, how, seed) in zip(ys, pairs)]
    starts = np.cumsum([0] + [y.shape[0] for y in ys[:-1]])
    values, settled = metrics_batch.compare_segments(np.concatenate(xs), np.concatenate(ys), starts, dtype)
    table = kernels.decode_table(dtype)
    for j, (x, y) in enumerate(zip(xs, ys)):
        tx, ty = torch.from_numpy(x).view(dtype), torch.from_numpy(y).view(dtype)
        finite = np.isfinite(table[x]).all() and np.isfinite(table[y]).all()
        if not settled[j]:  # left to compare_tensors: a NaN/Inf to mask, or Σxy to sum directly
            name = metrics_batch.BATCHED[dtype][1]
            alone = kernels.pair_sums(x, y, rtol=0.0, atol=0.0, codes=name)
            assert not finite or sxy_derived(alone) is None, (x, y)
            continue
        alone = compare_tensors(tx, ty)
        same_numbers({k: float(values[k][j]) for k in TENSOR_METRICS}, alone)
        if not finite:  # settled with a NaN inside only where the codes are the same
            assert x.tobytes() == y.tobytes() and alone["equal"] == 1.0


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_a_float8_pair_alone_is_the_batch_with_one_segment(dtype):
    """pair_sums of a float8 pair (compare_tensors, live comparison) is segment_sums with one
    segment of the batch, bit for bit, wherever the pair lies among others."""
    rng = np.random.default_rng(3)
    finite = np.flatnonzero(np.isfinite(kernels.decode_table(dtype))).astype(np.uint8)
    x, y = rng.choice(finite, 5000), rng.choice(finite, 5000)
    name = metrics_batch.BATCHED[dtype][1]
    rtol, atol = tolerances(dtype, dtype)
    starts = np.array([0, 1234, 3000])
    batch = kernels.segment_sums(kernels.decoded(x, name), kernels.decoded(y, name), starts, rtol, atol)
    for j, (lo, hi) in enumerate(zip(starts, [1234, 3000, 5000])):
        alone = kernels.pair_sums(x[lo:hi], y[lo:hi], rtol=rtol, atol=atol, codes=name)
        got = [alone.sxx, alone.syy, alone.sdd, alone.sabs, alone.max_abs, alone.max_rel, alone.mismatch]
        assert [bits(v) for v in got] == [bits(v) for v in batch[:, j].tolist()]
    d = kernels.decoded(x, name) - kernels.decoded(y, name)  # the sums are the definitions
    assert batch[2, 0] == pytest.approx(math.fsum(d[:1234] ** 2), rel=1e-14)


def _llama_activations(change: str | None, seed: int = 0) -> list[dict]:
    """Two passes of a tiny HF Llama's module outputs (float32 tensors), one weight
    multiplied by 1.2 when ``change`` names it."""
    model = _tiny_llama(seed)
    if change:
        with torch.no_grad():
            model.get_parameter(change).mul_(1.2)
    outputs: dict = {}

    def keep(name):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            if isinstance(out, torch.Tensor):
                outputs[name] = out.detach().clone()

        return hook

    hooks = [m.register_forward_hook(keep(name)) for name, m in model.named_modules() if name]
    passes = []
    for p in range(2):
        ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(p))
        outputs.clear()
        with torch.no_grad():
            model(ids)
        passes.append(dict(outputs))
    for h in hooks:
        h.remove()
    return passes


@pytest.mark.parametrize("writer", ["recorder", "torch.save"])
def test_a_tiny_model_dump_cast_to_float8_diffs_the_same_batched(tmp_path, monkeypatch, writer):
    """A tiny HF Llama's activations cast to float8 (as an fp8 engine stores them), one
    weight changed on one side and a NaN in one entry, written by our Recorder (records read
    straight from the file) or by plain ``torch.save`` (the tensors torch loads): every row as
    pair by pair, bitwise."""
    norm = "model.layers.1.post_attention_layernorm.weight"
    ref, wrong = _llama_activations(None), _llama_activations(norm)
    write = record_dump if writer == "recorder" else write_dump
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a = [{k: v.to(dtype) for k, v in p.items() if v.is_floating_point()} for p in ref]
        b = [{k: v.to(dtype) for k, v in p.items() if v.is_floating_point()} for p in wrong]
        nan = next(k for k in b[1] if k.endswith("mlp.up_proj"))
        b[1][nan].view(-1)[3] = math.nan
        name = str(dtype).removeprefix("torch.")
        x, y = write(tmp_path / f"a_{name}", a), write(tmp_path / f"b_{name}", b)
        batched, single, count = _tables(x, y, monkeypatch)
        assert count >= 2 * len(a[0]) - 2  # every float8 pair but the NaN's went through ...
        _assert_bitwise_equal(batched, single)  # ... with the rows compare_pair fills
        rows = batched.set_index(["pass", "key"])
        assert rows.loc[(1, nan), "reason"] == "NaN/Inf on one side (1 elements)"
        assert (rows["dtype_a"] == str(dtype)).all()
        before = rows.loc[[(0, k) for k in a[0] if k.startswith("model.layers.0.")]]
        assert (before["equal"] == 1.0).all()  # upstream of the change: the same codes
        changed = rows.loc[(0, "model.layers.1.post_attention_layernorm")]
        assert changed["equal"] == 0.0 and changed["rel_diff"] > 1e-3
