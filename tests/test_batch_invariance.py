"""Batch invariance, bitwise, without tensors (issue 27 case 7).

``capture(stats_only=True, checksum=True, checksum_dim=0)`` stores one fingerprint per row of
dim 0, so row 0 of a batch-4 run compares bitwise with a batch-1 run: entries whose shapes differ
only in that dim pair their rows instead of being a shape mismatch. The planted fault is a
split-K path taken only when the batch is larger than 1 (two parts of K summed separately: the
float result differs in the last bits); the batch-invariant model computes each row alone.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tdinspect
from tdinspect import DumpSet
from tdinspect.errors import ConfigError
from tdinspect.numerics.checksum import checksum_hex, row_checksums, tensor_checksum


class RowLinear(nn.Module):
    """A Linear computed one row at a time (batch-invariant by construction), or, with
    ``split_k``, summing two parts of K separately when the batch is larger than 1."""

    def __init__(self, n_in: int, n_out: int, split_k: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out) / 10)
        self.split_k = split_k

    def forward(self, x):
        w, b = self.weight, self.bias
        if self.split_k and x.shape[0] > 1:
            h = w.shape[1] // 3  # uneven: no kernel blocks K this way
            return F.linear(x[:, :h], w[:, :h]) + F.linear(x[:, h:], w[:, h:]) + b
        return torch.cat([F.linear(x[i : i + 1], w, b) for i in range(x.shape[0])])


def _model(split_k: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        RowLinear(16, 64), nn.ReLU(), RowLinear(64, 64, split_k), nn.ReLU(), RowLinear(64, 8)
    )


def _capture(model, path, x, stats_only=True, **options):
    with (
        torch.no_grad(),
        tdinspect.capture(model, path, stats_only=stats_only, checksum=True, **options) as dump,
    ):
        model(x)
        dump.step()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, split_k in (("invariant", False), ("split_k", True)):
        model = _model(split_k)
        out[name + "1"] = _capture(model, root / f"{name}1", x[:1], checksum_dim=0)
        out[name + "4"] = _capture(model, root / f"{name}4", x, checksum_dim=0)
    out["whole4"] = _capture(_model(True), root / "whole4", x)  # checksum=True alone
    for n, rows in (("1", x[:1]), ("4", x)):  # tensors stored too
        out["tensors" + n] = _capture(
            _model(True), root / f"tensors{n}", rows, stats_only=False, checksum_dim=0
        )
    return out


def test_row_checksums_are_the_checksums_of_the_rows():
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.bool):
        x = (torch.randn(3, 5, 7) * 4).to(dtype)
        for dim in (0, 1, -1):
            want = [tensor_checksum(x.select(dim, i)) for i in range(x.shape[dim])]
            assert torch.equal(row_checksums(x, dim), torch.stack(want))
    assert row_checksums(torch.zeros(3), 1) is None


def test_the_sidecar_holds_one_fingerprint_per_row(runs):
    sidecar = next(runs["split_k4"].glob("*/pass00000.json"))
    entries = json.loads(sidecar.read_text())["entries"]
    rows = dict(zip(entries["key"], entries["checksum_rows"]))["model.2"]
    assert rows["dim"] == 0 and len(rows["rows"]) == 4
    one = dict(
        zip(
            *(
                json.loads(next(runs["split_k1"].glob("*/pass00000.json")).read_text())["entries"][c]
                for c in ("key", "checksum")
            )
        )
    )
    assert rows["rows"][0] != one["model.2"]  # the split-K path changed row 0's bits
    assert all(len(r) == 16 for r in rows["rows"]) and checksum_hex(0) == "0" * 16


def test_a_split_k_path_is_named_at_its_module_and_row(runs):
    d = DumpSet.open(runs["split_k1"]).diff(runs["split_k4"])
    v = d.verdict(metric="equal")
    assert v.outcome == "diverges"
    div = v.divergence
    assert div.key == "model.2" and div.pass_ == 0
    assert div.reason.endswith(
        "; not batch-invariant: row 0 of dim 0 differs in its bits (1 row compared, 1 vs 4)"
    )
    assert not div.structural  # paired by rows, not a shape mismatch


def test_a_batch_invariant_model_matches(runs):
    v = DumpSet.open(runs["invariant1"]).diff(runs["invariant4"]).verdict(metric="equal")
    assert v.outcome == "matches" and v.compared == 5


def test_without_checksum_dim_the_shapes_differ(runs):
    v = DumpSet.open(runs["split_k1"]).diff(runs["whole4"]).verdict(metric="equal")
    assert v.divergence.structural and v.divergence.reason == "shape [1, 64] vs [4, 64]"


def test_stats_rel_on_row_paired_entries_says_to_compare_rows(runs):
    v = DumpSet.open(runs["invariant1"]).diff(runs["invariant4"]).verdict()
    assert v.outcome == "diverges"  # statistics of a batch of 1 and of 4: never a silent pass
    assert "metric='equal' compares the rows" in v.divergence.reason


def test_checksum_dim_needs_checksum(tmp_path):
    with pytest.raises(ConfigError, match="checksum_dim"):
        tdinspect.capture(_model(False), tmp_path, checksum_dim=0).__enter__()


def test_narrow_of_a_checksummed_statistics_dump_does_not_say_capture_with_checksum(runs):
    """narrow() on a statistics-only dump captured with checksum=True said "capture it with
    checksum=True": it was. Checksums fingerprint whole stored tensors; a narrowed entry has none."""
    four = DumpSet.open(runs["split_k4"]).narrow(0, 0, 1)
    with pytest.raises(ValueError) as info:
        DumpSet.open(runs["split_k1"]).diff(four).verdict(metric="equal")
    text = str(info.value)
    assert "capture it with checksum=True" not in text
    assert "narrow" in text and "checksum_dim" in text


def test_with_tensors_the_rows_are_compared_in_numbers(runs):
    d = DumpSet.open(runs["tensors1"]).diff(runs["tensors4"])
    div = d.verdict(metric="equal").divergence
    assert (div.key, div.structural) == ("model.2", False)
    assert "row 0 of dim 0 differs in its bits" in div.reason
    rows = d.table().set_index("key")
    assert 0 < rows.at["model.2", "rel_diff"] < 1e-12  # last-bit differences: split-K rounding
    assert rows.at["model.0", "equal"] == 1 and rows.at["model.0", "rel_diff"] == 0
    assert d.verdict().outcome == "matches"  # under float32's auto threshold: only bits differ


def test_op_level_capture_stores_rows_too(tmp_path):
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    model = _model(False)
    with (
        torch.no_grad(),
        tdinspect.capture_ops(tmp_path, model=model, stats_only=True, checksum=True, checksum_dim=0) as dump,
    ):
        model(x)
        dump.step()
    entries = json.loads(next(tmp_path.glob("*/pass00000.json")).read_text())["entries"]
    rows = [r for r in entries["checksum_rows"] if r is not None]
    assert rows and all(r["dim"] == 0 for r in rows)
    last = dict(zip(entries["key"], entries["checksum_rows"]))[entries["key"][-1]]
    assert len(last["rows"]) == 3


def test_a_checksum_dim_no_entry_has_is_said_not_silent(tmp_path):
    """checksum_dim=5 on outputs of 2 dims wrote no per-row fingerprint and said nothing (the
    comparison then fell back to shapes); now one warning names the argument and the dims."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with pytest.warns(
        RuntimeWarning, match=r"checksum_dim=5: no entry of pass 0 has that dim \(they have 2 dims"
    ):
        _capture(_model(False), tmp_path / "d", x, checksum_dim=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dim the outputs have: nothing to say
        _capture(_model(False), tmp_path / "ok", x, checksum_dim=0)
