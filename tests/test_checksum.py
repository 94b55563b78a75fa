"""Bitwise fingerprints: the definition, what they always catch, and determinism checks with them."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import tdinspect
from tdinspect import DumpSet
from tdinspect.examples.models import make_model, make_tokens
from tdinspect.numerics.checksum import checksum_hex, tensor_checksum
from tdinspect.numerics.fingerprint import BLOCK, SEED_K, SEED_R

from .conftest import only_folder

MASK = (1 << 64) - 1


def splitmix64(i: int, seed: int) -> int:
    z = (seed + i * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference_checksum(t: torch.Tensor) -> int:
    """The documented formula with Python integers (no wrapping arithmetic to trust)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).tolist()
    raw += [0] * (-len(raw) % 4)
    h = 0
    for j in range(0, len(raw), 4):
        w = int.from_bytes(bytes(raw[j : j + 4]), "little", signed=True)
        c, k = divmod(j // 4, BLOCK)
        h += w * (splitmix64(k, SEED_K) | 1) * (splitmix64(c, SEED_R) | 1)
    return h & MASK


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(2 * BLOCK + 5),  # two full blocks and a tail
        torch.randn(7, 3, dtype=torch.float64).t(),  # non-contiguous: logical order
        torch.randn(5, dtype=torch.bfloat16),  # 10 bytes: zero-padded word
        torch.tensor([True, False, True]),
        torch.randint(-128, 127, (9,), dtype=torch.int8),
        torch.tensor(3.5),  # 0-d
        torch.randn(3, dtype=torch.complex64),
        torch.empty(0),
    ],
)
def test_matches_the_documented_formula(t):
    assert checksum_hex(tensor_checksum(t)) == f"{reference_checksum(t):016x}"


@pytest.mark.parametrize(
    "numel, dtype",
    [
        (3 * BLOCK + 1, torch.bfloat16),  # words of two elements, a zero-padded last one
        (BLOCK + 3, torch.float64),  # two words an element
    ],
)
def test_conversion_chunks_keep_the_documented_value(numel, dtype, monkeypatch):
    """Big tensors are converted to int64 a few blocks at a time (CHUNK_BLOCKS): one block at
    a time, blocks and a tail over several chunks, still the formula's value."""
    from tdinspect.numerics import checksum

    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    x[numel // 2] = -0.0
    want = f"{reference_checksum(x):016x}"
    assert checksum_hex(tensor_checksum(x)) == want
    monkeypatch.setattr(checksum, "CHUNK_BLOCKS", 1)
    assert checksum_hex(tensor_checksum(x)) == want


def test_any_change_to_one_word_is_caught_and_layout_does_not_matter():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3 * BLOCK + 11, generator=gen)
    h = tensor_checksum(x)
    words = x.view(torch.int32)
    for pos in torch.randint(0, x.numel(), (40,), generator=gen).tolist():
        for bit in (0, 1, 22, 23, 30, 31):  # mantissa, exponent, sign
            y = words.clone()
            y[pos] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
            assert tensor_checksum(y.view(torch.float32)) != h, (pos, bit)
    assert tensor_checksum(x.roll(1)) != h  # the same values elsewhere
    assert tensor_checksum(-x) != h
    m = torch.randn(64, 48, generator=gen)
    assert tensor_checksum(m.t()) == tensor_checksum(m.t().contiguous())
    assert tensor_checksum(m[:, 1:]) == tensor_checksum(m[:, 1:].clone())
    assert tensor_checksum(torch.zeros(2)) == tensor_checksum(torch.tensor([0.0, 0.0]))
    assert tensor_checksum(torch.tensor([0.0])) != tensor_checksum(torch.tensor([-0.0]))  # bits


class SplitK(torch.nn.Module):
    """``linear`` summed over two halves of the inner dimension: the same numbers, in a
    different reduction order."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        k = x.shape[-1] // 2
        return F.linear(x[..., :k], self.weight[:, :k]) + F.linear(x[..., k:], self.weight[:, k:]) + self.bias


def checksum_run(path, split=False):
    model = make_model(seed=0)
    if split:
        model.layers[1].mlp.down = SplitK(model.layers[1].mlp.down)
    with torch.no_grad(), tdinspect.capture(model, path, stats_only=True, checksum=True, environ={}) as dump:
        for step in range(2):
            model(make_tokens(seed=step))
            dump.step()
    return path


def test_reduction_order_is_found_by_checksum_alone(tmp_path):
    a, a2 = checksum_run(tmp_path / "a"), checksum_run(tmp_path / "a2")
    b = checksum_run(tmp_path / "b", split=True)
    side = json.loads((only_folder(a) / "pass00000.json").read_text())
    assert side["stats_only"] is True and not list(only_folder(a).glob("*.pt"))
    digests = side["entries"]["checksum"]
    assert len(digests) == len(side["entries"]["key"])
    assert all(isinstance(c, str) and len(c) == 16 for c in digests)
    # identical runs: bitwise equal everywhere
    assert DumpSet.open(a).diff(a2).first_divergence(metric="equal") is None
    # another reduction order: not bitwise equal from that module on; its statistics agree
    diff = DumpSet.open(a).diff(b)
    div = diff.first_divergence(metric="equal")
    assert (div.key, div.pass_) == ("model.layers.1.mlp.down", 0)
    assert (
        diff.table(progress=False).set_index(["pass", "key"]).loc[(0, "model.layers.1.mlp.down"), "stats_rel"]
        < 1e-5
    )
    # the live tensors confirm it: close, not equal
    x = torch.randn(2, 16, 256)
    lin = make_model(seed=0).layers[1].mlp.down
    torch.testing.assert_close(SplitK(lin)(x), lin(x))


def test_equal_without_checksums_is_a_clear_error(tmp_path):
    a = checksum_run(tmp_path / "a")
    model = make_model(seed=0)
    with torch.no_grad(), tdinspect.capture(model, tmp_path / "s", stats_only=True, environ={}) as dump:
        model(make_tokens())
        dump.step()
    with pytest.raises(ValueError, match=r"metric='equal'.*B \(.*s\) has none.*checksum=True"):
        DumpSet.open(a).diff(tmp_path / "s").first_divergence(metric="equal")
    with pytest.raises(ValueError, match="use metric='stats_rel'"):
        DumpSet.open(a).diff(tmp_path / "s").first_divergence(metric="rel_diff")


def test_op_level_checksums_tell_a_rounding_change(tmp_path):
    def run(path, dtype):
        x = torch.linspace(-2, 2, 64, dtype=torch.float64).reshape(4, 16)
        with tdinspect.capture_ops(path, stats_only=True, checksum=True, environ={}) as dump:
            torch.nn.functional.layer_norm(x.to(dtype).double(), (16,))
            dump.step()
        return path

    a, a2 = run(tmp_path / "a", torch.float64), run(tmp_path / "a2", torch.float64)
    b = run(tmp_path / "b", torch.float32)  # the input rounded through float32 first
    entries = json.loads((only_folder(a) / "pass00000.json").read_text())["entries"]
    assert all(isinstance(c, str) for c in entries["checksum"])
    assert DumpSet.open(a).diff(a2).first_divergence(metric="equal") is None
    div = DumpSet.open(a).diff(b).first_divergence(metric="equal")
    assert div is not None and "aten." in div.key
