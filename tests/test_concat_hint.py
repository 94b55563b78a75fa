"""A shape mismatch that is a decode run against one full forward says how to compare it."""

from __future__ import annotations

import subprocess
import sys

import torch

from tdinspect import DumpSet

from .recorded import record_dump


def _runs(tmp_path):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 10, 4, generator=g)
    ref = record_dump(tmp_path / "ref", [{"m.attn": full, "m.norm": torch.ones(3)}])
    # the engine: a prefill of 6 tokens, then one call per decoded token
    calls = [full[:, :6]] + [full[:, i : i + 1] for i in range(6, 10)]
    eng = {("m.attn" if i == 0 else f"m.attn::call{i}"): c.clone() for i, c in enumerate(calls)}
    eng["m.norm"] = torch.ones(2)  # a plain shape mismatch: no calls to put end to end
    return ref, record_dump(tmp_path / "eng", [eng])


def test_a_decode_run_against_a_full_forward_names_the_concat(tmp_path):
    ref, eng = _runs(tmp_path)
    table = DumpSet.open(ref).diff(eng).table(progress=False).set_index("key")
    reason = table.loc["m.attn", "reason"]
    assert reason.startswith("shape [2, 10, 4] vs [2, 6, 4]"), reason
    assert "B calls this entry 5 times: end to end along dim 1 they have A's shape" in reason
    assert ".concat('call', dim=1)" in reason and "--concat call:1" in reason
    assert table.loc["m.norm", "reason"] == "shape [3] vs [2]"  # no hint where none fits
    # the hint is right: after it, the decode run matches the forward exactly
    fixed = DumpSet.open(ref).diff(DumpSet.open(eng).concat("call", dim=1))
    assert fixed.table(progress=False).set_index("key").loc["m.attn", "equal"] == 1.0


def test_the_hint_works_the_other_way_round_and_in_the_cli(tmp_path):
    ref, eng = _runs(tmp_path)
    row = DumpSet.open(eng).diff(ref).table(progress=False).set_index("key").loc["m.attn"]
    assert "A calls this entry 5 times: end to end along dim 1 they have B's shape" in row["reason"]
    out = subprocess.run(
        [sys.executable, "-m", "tdinspect", "diff", str(ref), str(eng)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "--concat call:1" in out.stdout, out.stdout + out.stderr
