"""Reliability: damaged and odd files, property-based fuzzing, readers during writes, results unchanged."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import tdinspect
from tdinspect import DumpFormatError, DumpSet, load_pass
from tdinspect.examples.models import make_model, make_tokens

from .conftest import ROOT, only_folder, rewrite_sidecar
from .test_dumpset_diff import write_dump

ALL_DTYPES = [
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _tensor(dtype, shape=(3, 4)):
    base = torch.randn(shape) * 3
    if dtype == torch.bool:
        return base > 0
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)


def test_every_dtype_and_odd_shapes_open_and_diff(tmp_path):
    entries = {f"model.{str(dt).removeprefix('torch.')}": _tensor(dt) for dt in ALL_DTYPES}
    entries.update(
        {
            "model.empty": torch.empty(0, 5),
            "model.scalar": torch.tensor(2.5),
            "model.noncontig": torch.randn(6, 4).t(),
            "model.huge_shape": torch.ones(1).expand(10**6, 10**6),  # 10^12 elements, 4 bytes stored
        }
    )
    write_dump(tmp_path / "a", [entries])
    other = dict(entries)
    other["model.float32"] = entries["model.float32"] + 1
    write_dump(tmp_path / "b", [other])
    ds = DumpSet.open(tmp_path / "a")
    cube = ds.to_xarray(progress=False)
    assert float(cube["numel"].sel(op="model.huge_shape", call=0).sel({"pass": 0})) == 1e12
    assert float(cube["max"].sel(op="model.bool", call=0).sel({"pass": 0})) == 1.0
    assert float(cube["numel"].sel(op="model.empty", call=0).sel({"pass": 0})) == 0
    assert math.isnan(float(cube["mean"].sel(op="model.empty", call=0).sel({"pass": 0})))
    assert ds.tensor("model.huge_shape").shape == (10**6, 10**6)
    rows = ds.diff(tmp_path / "b").table(progress=False).set_index("key")
    assert rows.loc["model.float32", "max_abs"] == pytest.approx(1.0)
    others = rows.drop(index=["model.float32", "model.huge_shape"])
    assert (others["equal"] == 1.0).all() and not rows["structural"].any()


def test_sidecar_disagreeing_with_pass_file(tmp_path, model, tokens):
    with tdinspect.capture(model, tmp_path, filter=r"lm_head|norm$") as dump:
        model(tokens)
        dump.step()
    side = only_folder(tmp_path) / "pass00000.json"
    doc = json.loads(side.read_text())
    doc["entries"]["key"][0] = "model.renamed"
    rewrite_sidecar(side, doc)  # consistently re-bound: only the tensors can tell
    ds = DumpSet.open(tmp_path)
    with pytest.raises(DumpFormatError, match=r"pass00000\.pt: sidecar and pass file disagree.*renamed"):
        ds.tensor("model.lm_head")
    doc["entries"]["dtype"] = doc["entries"]["dtype"][:1]
    rewrite_sidecar(side, doc)
    with pytest.raises(DumpFormatError, match=r"pass00000\.json: sidecar column 'dtype'"):
        DumpSet.open(tmp_path)
    side.write_text("{not json")
    with pytest.raises(DumpFormatError, match="unreadable sidecar"):
        DumpSet.open(tmp_path)


def test_missing_pass_in_the_middle(tmp_path):
    passes = [{"model.a": torch.ones(2) * i} for i in range(3)]
    write_dump(tmp_path / "a", passes)
    write_dump(tmp_path / "b", passes)
    (tmp_path / "b" / "rank0_pid1" / "pass00001.pt").unlink()
    b = DumpSet.open(tmp_path / "b")
    assert b.passes == [0, 2]
    div = DumpSet.open(tmp_path / "a").diff(b).first_divergence()
    assert div.pass_ == 1 and div.reason == "pass 1 only in A"


def test_keys_that_break_the_grammar_still_open(tmp_path):
    odd = {
        "": torch.ones(1),
        "a/b/c": torch.ones(2),
        "x[": torch.ones(3),
        "y::call0": torch.ones(4),
        "z::call2": torch.ones(5),
        "weird key with spaces": torch.ones(6),
    }
    write_dump(tmp_path, [odd])
    ds = DumpSet.open(tmp_path)
    assert "a/b/c" in ds.ops and "z" in ds.ops
    cube = ds.to_xarray(progress=False)
    assert float(cube["numel"].sel(op="z", call=2).sel({"pass": 0})) == 5
    assert ds.diff(tmp_path).first_divergence() is None
    with pytest.raises(ValueError, match="invalid key"):
        tdinspect.parse_key("")


@st.composite
def dumps(draw):
    n = draw(st.integers(1, 4))
    entries = {}
    for i in range(n):
        dtype = draw(st.sampled_from(ALL_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
        entries[f"model.m{i}" + ("" if draw(st.booleans()) else f"::call{i + 1}")] = _tensor(dtype, shape)
    return entries


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entries=dumps(),
    damage=st.sampled_from(["none", "truncate", "flip", "garbage", "empty"]),
    where=st.floats(0, 1),
)
def test_fuzz_dumps_and_damage(tmp_path_factory, entries, damage, where):
    root = tmp_path_factory.mktemp("fuzz")
    write_dump(root, [entries, entries])
    victim = root / "rank0_pid1" / "pass00001.pt"
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(data[: int(len(data) * where)])
    elif damage == "flip":
        pos = int((len(data) - 1) * where)
        data[pos] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "garbage":
        victim.write_bytes(bytes(range(256)) * 3)
    elif damage == "empty":
        victim.write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ds = DumpSet.open(root, on_error="warn")
            ds.to_xarray(progress=False)
            ds.diff(root).table(progress=False)
        except DumpFormatError as exc:
            assert "pass0000" in str(exc)  # our documented error, naming the file


def test_reader_during_writes_sees_only_complete_passes(tmp_path):
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import torch, tdinspect
        from tdinspect.examples.models import make_model, make_tokens
        model = make_model(d_model=128)
        with torch.no_grad(), tdinspect.capture(model, {str(tmp_path)!r}) as dump:
            for s in range(25):
                model(make_tokens(batch=8, seq=64, seed=s))
                dump.step()
    """),
        ],
        cwd=ROOT,
    )
    seen = set()
    deadline = time.time() + 120
    while writer.poll() is None and time.time() < deadline:
        try:
            ds = DumpSet.open(tmp_path)
        except DumpFormatError:
            continue  # nothing complete yet
        for pi in ds.pass_indexes():
            if pi.index not in seen:
                assert len(pi.load()) == pi.keys.__len__() == 42
                seen.add(pi.index)
    assert writer.wait(timeout=120) == 0
    assert DumpSet.open(tmp_path).passes == list(range(25))


def test_module_capture_keeps_training_bitwise_identical(tmp_path):
    def run(capture_dir):
        torch.manual_seed(0)
        model = nn.Sequential(make_model(seed=0, n_layers=2), nn.Dropout(0.3)).train()
        x = make_tokens(seed=0)
        if capture_dir is None:
            out = model(x)
            out.square().mean().backward()
        else:
            with tdinspect.capture(model, capture_dir) as dump:
                out = model(x)
                out.square().mean().backward()
                dump.step()
            assert not any(m._forward_hooks for m in model.modules())
        return out.detach(), [p.grad for p in model.parameters()], torch.get_rng_state()

    out0, g0, rng0 = run(None)
    out1, g1, rng1 = run(tmp_path)
    assert torch.equal(out0, out1) and torch.equal(rng0, rng1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert len(load_pass(only_folder(tmp_path) / "pass00000.pt")) == 25


def test_diff_numerics_edge_cases(tmp_path):
    inf, nan = float("inf"), float("nan")
    a = {
        "model.same_nan": torch.tensor([1.0, nan]),
        "model.same_inf": torch.tensor([inf, -inf, 2.0]),
        "model.zeros": torch.zeros(4),
        "model.denormal": torch.tensor([1e-45, 1e-40]),
        "model.one": torch.tensor([3.0]),
        "model.sign_inf": torch.tensor([inf]),
    }
    b = {
        "model.same_nan": torch.tensor([1.0, nan]),
        "model.same_inf": torch.tensor([inf, -inf, 2.0]),
        "model.zeros": torch.zeros(4),
        "model.denormal": torch.tensor([2e-45, 1e-40]),
        "model.one": torch.tensor([3.0]),
        "model.sign_inf": torch.tensor([-inf]),
    }
    write_dump(tmp_path / "a", [a])
    write_dump(tmp_path / "b", [b])
    rows = DumpSet.open(tmp_path / "a").diff(tmp_path / "b").table(progress=False).set_index("key")
    for key in ("model.same_nan", "model.same_inf", "model.zeros", "model.one"):
        assert rows.loc[key, "reason"] == "" and rows.loc[key, "rel_diff"] == 0, key
        assert rows.loc[key, "cosine"] == 1.0 and rows.loc[key, "max_abs"] == 0
    assert rows.loc["model.sign_inf", "structural"]
    assert math.isfinite(rows.loc["model.denormal", "rel_diff"])
