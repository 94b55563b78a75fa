"""Metrics of a pair in parts (pieces of a concatenation, one value per position) agree with
``compare_tensors`` on the whole, and fall back to it wherever they could not be exact."""

from __future__ import annotations

import math

import pytest
import torch

from tdinspect.align.logical import matching_slices
from tdinspect.numerics.metrics import TENSOR_METRICS, compare_tensors, same_bits
from tdinspect.numerics.metrics_split import compare_pieces, compare_positions

EXACT = ("max_abs", "max_rel", "mismatch", "equal", "max_abs_cast")  # maxima and counts: bit for bit


def _agree(got: dict, want: dict) -> None:
    for k in TENSOR_METRICS:
        g, w = got[k], want[k]
        if k in EXACT or math.isinf(w) or math.isnan(w):
            assert g == w or (math.isnan(g) and math.isnan(w)), (k, g, w)
        else:  # float64 sums added in another order: a few ulps
            assert g == pytest.approx(w, rel=1e-12, abs=1e-300), (k, g, w)


def _cut(t: torch.Tensor, sizes, dim: int):
    return dim, [(sum(sizes[:i]), p) for i, p in enumerate(t.split(sizes, dim))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [0, 1])
def test_pieces_agree_with_the_whole(dtype, dim):
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(12, 300, 5, generator=gen).to(dtype)
    x = (y.double() + 1e-3 * torch.randn(12, 300, 5, generator=gen, dtype=torch.float64)).to(dtype)
    n = y.shape[dim]
    # the two sides cut at different places, as a decode run (prefill + steps) meets another
    a = _cut(y, [n // 2, n - n // 2], dim)
    b = _cut(x, [1, 2, n - 4, 1], dim)
    slices = matching_slices(a, b)
    assert len(slices) == 5 and all(p.shape == q.shape for p, q in slices)
    got = compare_pieces([(q, p) for p, q in slices])
    _agree(got, compare_tensors(x, y))
    assert got["equal"] == 0.0


def test_pieces_of_identical_tensors_are_equal_and_a_whole_side_is_one_piece():
    y = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    got = compare_pieces([(q, p) for p, q in matching_slices(_cut(y, [16] * 4, 0), (0, [(0, y.clone())]))])
    assert got == compare_tensors(y.clone(), y)
    assert got["equal"] == 1.0 and got["sqnr_db"] == math.inf
    # one bit anywhere (here in the last piece, past the first block) is a difference
    x = y.clone()
    x.view(torch.int32)[-1, -1] ^= 1
    got = compare_pieces([(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)])
    assert got["equal"] == 0.0
    _agree(got, compare_tensors(x, y))


@pytest.mark.parametrize(
    "case", ["nan", "inf", "huge64", "tiny64", "far_norms", "int", "complex", "two_dtypes"]
)
def test_pieces_fall_back_where_only_the_whole_is_exact(case):
    y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = y + 1e-6
    if case == "nan":
        x[5, 3] = math.nan
    elif case == "inf":
        y[0, 0] = math.inf
    elif case == "huge64":
        x, y = x * 1e200, y * 1e200
    elif case == "tiny64":
        x, y = x * 1e-200, y * 1e-200
    elif case == "far_norms":
        y = torch.zeros(8, 16, dtype=torch.float64)
        y[0, 0] = 1e10
        x = torch.zeros(8, 16, dtype=torch.float64)
        x[0, 0], x[7, 15] = 1e-3, 1.0
    elif case == "int":
        x, y = (torch.arange(128).reshape(8, 16) + 2**60), torch.arange(128).reshape(8, 16)
    elif case == "complex":
        x, y = torch.complex(x, y), torch.complex(y, x)
    elif case == "two_dtypes":
        x = x.float()
    pieces = [(x[:3], y[:3]), (x[3:], y[3:])]
    assert compare_pieces(pieces) is None
    # what a diff then does: assemble, and compare_tensors applies its own rule
    whole = compare_tensors(torch.cat([p for p, _ in pieces]), torch.cat([q for _, q in pieces]))
    _agree(whole, compare_tensors(x, y))


def test_matching_slices_refuses_other_dims_or_lengths():
    t = torch.zeros(4, 6)
    assert matching_slices(_cut(t, [2, 2], 0), _cut(t, [3, 3], 1)) is None
    assert matching_slices(_cut(t, [2, 2], 0), _cut(t[:3], [1, 2], 0)) is None
    assert len(matching_slices(_cut(t, [2, 2], -2), _cut(t, [1, 3], 0))) == 3


def test_same_bits_by_bytes_keeps_the_bitwise_rules():
    a = torch.tensor([1.0, math.nan, 0.0, 2.0] * 1500)  # 24 KB: past the first block
    assert same_bits(a, a.clone())  # NaN meets the same NaN
    b = a.clone()
    b[2] = -0.0
    assert not same_bits(a, b)  # -0.0 is not 0.0
    c = a.clone()
    c[-1] = 3.0
    assert not same_bits(a, c)  # differs only at the very end
    odd = torch.arange(7, dtype=torch.uint8)  # not a multiple of 8 bytes
    assert same_bits(odd, odd.clone()) and not same_bits(odd, odd.flip(0))
    assert same_bits(a[::2], a.clone()[::2])  # not contiguous: torch's own comparison
    assert not same_bits(a.double(), a.double().float())  # two dtypes are never equal
    h = torch.randn(33).to(torch.bfloat16)
    assert same_bits(h, h.clone()) and not same_bits(h, (h.float() * 2).to(torch.bfloat16))


# -- one value per position ---------------------------------------------------------------------
def _by_loop(x, y, name):
    return [compare_tensors(x[j], y[j])[name] for j in range(x.shape[0])]


def _edge_rows(dtype):
    gen = torch.Generator().manual_seed(5)
    y = torch.randn(12, 40, generator=gen, dtype=torch.float64)
    x = y + 1e-4 * torch.randn(12, 40, generator=gen, dtype=torch.float64)
    x[1] = y[1]  # identical row
    x[2, 7] = math.nan  # NaN on one side
    x[3, 0] = y[3, 0] = math.nan  # NaN at the same place (masked, the rest compared)
    y[4, 9] = math.inf  # Inf on the reference only
    x[5], y[5] = 0.0, 0.0  # zeros: cosine 1
    x[6], y[6] = -0.0, 0.0  # equal numbers, different bits
    x[7] = 0.0  # one side zero: cosine 0
    y[8] = torch.zeros(40, dtype=torch.float64)  # far norms: Σxy summed directly
    y[8, 0], x[8] = 1e10, 0.0
    x[8, 0], x[8, 39] = 1e-3, 1.0
    if dtype == torch.float64:
        x[9], y[9] = x[9] * 1e200, y[9] * 1e200  # sums overflow: rescaled
        x[10], y[10] = x[10] * 1e-200, y[10] * 1e-200  # sums underflow: rescaled
    return x.to(dtype), y.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", TENSOR_METRICS)
def test_positions_agree_with_the_loop_on_edge_rows(dtype, name):
    x, y = _edge_rows(dtype)
    got = compare_positions(x, y, name)
    want = _by_loop(x, y, name)
    for j, (g, w) in enumerate(zip(got.tolist(), want)):
        if name in EXACT or not math.isfinite(w):
            assert g == w or (math.isnan(g) and math.isnan(w)), (j, g, w)
        else:
            assert g == pytest.approx(w, rel=1e-12, abs=1e-300), (j, g, w)


@pytest.mark.parametrize("pair", ["int", "two_dtypes", "empty", "blocks"])
def test_positions_other_pairs(pair):
    gen = torch.Generator().manual_seed(2)
    y = torch.randn(9, 3, 7, generator=gen)
    x = y + 1e-3
    if pair == "int":
        x, y = torch.arange(63).reshape(9, 7) + 2**60, torch.arange(63).reshape(9, 7) + 2**60
        x[4, 2] += 1  # 2**60 + 1 vs 2**60: max_abs exactly 1
    elif pair == "two_dtypes":
        x = x.double()
    elif pair == "empty":
        x, y = torch.zeros(5, 0), torch.zeros(5, 0)
    for name in ("rel_diff", "max_abs", "equal", "rel_diff_cast"):
        # chunk=30 puts a few positions in each vectorised block (blocks cut mid-tensor)
        got = compare_positions(x, y, name, chunk=30 if pair == "blocks" else 1 << 18).tolist()
        want = _by_loop(x, y, name)
        assert got == pytest.approx(want, rel=1e-12, abs=0, nan_ok=True), name
    if pair == "int":
        assert compare_positions(x, y, "max_abs")[4] == 1.0


def test_positions_refuse_bad_input():
    with pytest.raises(ValueError, match="stats_rel"):
        compare_positions(torch.zeros(2, 2), torch.zeros(2, 2), "stats_rel")
    with pytest.raises(ValueError, match="unknown metric"):
        compare_positions(torch.zeros(2, 2), torch.zeros(2, 2), "nope")
    with pytest.raises(ValueError, match="one shape"):
        compare_positions(torch.zeros(2, 2), torch.zeros(3, 2), "max_abs")


@pytest.mark.parametrize("dtype, slow", [(torch.float64, {2, 3, 4, 8, 9, 10}), (torch.float32, {2, 3, 4, 8})])
def test_positions_fall_back_exactly_where_the_loop_takes_a_special_road(dtype, slow, monkeypatch):
    import tdinspect.numerics.metrics_split as split

    asked = []

    def counted(x, y, **kw):
        asked.append(x)
        return compare_tensors(x, y, **kw)

    monkeypatch.setattr(split, "compare_tensors", counted)
    x, y = _edge_rows(dtype)
    compare_positions(x, y, "rel_diff")
    rows = {j for j in range(x.shape[0]) for t in asked if t.data_ptr() == x[j].data_ptr()}
    assert rows == slow  # NaN/Inf (not bitwise equal), far norms, float64 sums out of range


def test_same_bits_of_a_one_element_tensor_with_stride_zero():
    one = torch.tensor(7, dtype=torch.int16).expand(1)  # contiguous, stride 0
    assert one.stride() == (0,) and one.is_contiguous()
    assert same_bits(one, torch.tensor([7], dtype=torch.int16))
    assert not same_bits(one, torch.tensor([8], dtype=torch.int16))


def test_sides_cut_alike_are_compared_part_by_part_as_they_are():
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(10, 33, generator=gen)
    x = y + 1e-3 * torch.randn(10, 33, generator=gen)
    a, b = _cut(y, [4, 1, 5], 0), _cut(x, [4, 1, 5], 0)
    slices = matching_slices(a, b)
    assert [(p.data_ptr(), q.data_ptr()) for p, q in slices] == [
        (p.data_ptr(), q.data_ptr()) for (_, p), (_, q) in zip(a[1], b[1])
    ]
    _agree(compare_pieces([(q, p) for p, q in slices]), compare_tensors(x, y))
