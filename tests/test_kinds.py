"""Tensor kinds: sparse, quantized, nested, expanded, meta, FakeTensor and subclass outputs never
break the forward; what can be stored reads back equal, the rest is listed with its reason."""

from __future__ import annotations

import json

import pytest
import torch

import tdinspect
from tdinspect import DumpSet, load_pass
from tdinspect.naming import split_call


class _Sub(torch.Tensor):
    """A plain tensor subclass (no __torch_dispatch__)."""


class _Emit(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make(x)


def _kinds():
    torch.manual_seed(0)
    dense = torch.randn(3, 4)
    dense[0, 1] = dense[2, 2] = 0.0
    return {
        "coo": lambda x: (dense * x).to_sparse(),
        "csr": lambda x: (dense * x).to_sparse_csr(),
        "quant": lambda x: torch.quantize_per_tensor(dense * x, 0.05, 3, torch.quint8),
        "nested": lambda x: torch.nested.nested_tensor([dense[0] * x, dense[1, :2] * x]),
        "expand": lambda x: (x * 2).reshape(1, 1).expand(4096, 4096),
        "huge": lambda x: x.reshape(1, 1).expand(10**6, 10**6),
        "meta": lambda x: torch.empty(5, 2, device="meta"),
        "sub": lambda x: (dense * x).as_subclass(_Sub),
    }


def test_every_kind_is_captured_or_listed_and_the_forward_goes_on(tmp_path):
    kinds = _kinds()
    model = torch.nn.ModuleDict({k: _Emit(f) for k, f in kinds.items()})
    x = torch.tensor(1.5)
    with tdinspect.capture(model, tmp_path, on_nonfinite="raise") as dump:  # checked, too
        outs = {k: m(x) for k, m in model.items()}
        dump.step()
    folder = dump.folder
    assert (folder / "pass00000.pt").stat().st_size < 1 << 20  # no 64 MB expand, no 4 TB one
    raw = load_pass(folder / "pass00000.pt")  # a plain torch.load, weights_only
    assert raw["model.coo"].layout == torch.sparse_coo and raw["model.quant"].is_quantized
    assert raw["model.expand"].shape == (1, 1)
    side = json.loads((folder / "pass00000.json").read_text())["entries"]
    row = {k: i for i, k in enumerate(side["key"])}
    assert side["storage"][row["model.quant"]]["quantized"]["scale"] == 0.05
    assert side["storage"][row["model.sub"]]["subclass"].endswith("_Sub")
    assert side["shape"][row["model.huge"]] == [10**6, 10**6]
    ds = DumpSet.open(tmp_path)
    read = {k: ds.tensor(f"model.{k}") for k in ("coo", "csr", "quant", "nested", "expand", "huge", "sub")}
    assert torch.equal(read["coo"], outs["coo"].to_dense())
    assert torch.equal(read["csr"], outs["csr"].to_dense())
    assert torch.equal(read["quant"], outs["quant"].dequantize())
    assert torch.equal(read["nested"], torch.cat([t.reshape(-1) for t in outs["nested"].unbind()]))
    assert read["expand"].shape == (4096, 4096) and torch.equal(read["expand"], outs["expand"])
    assert read["huge"].shape == (10**6, 10**6) and read["huge"].stride() == (0, 0)
    assert type(read["sub"]) is torch.Tensor and torch.equal(
        read["sub"], outs["sub"].as_subclass(torch.Tensor)
    )
    stats = ds.entries(progress=False).set_index("key")
    for k in ("coo", "csr"):
        dense = outs[k].to_dense()
        assert stats.loc[f"model.{k}", "max"] == pytest.approx(float(dense.max()))
        assert stats.loc[f"model.{k}", "min"] == pytest.approx(float(dense.min()))
        assert stats.loc[f"model.{k}", "mean"] == pytest.approx(float(dense.mean()))
        assert stats.loc[f"model.{k}", "std"] == pytest.approx(float(dense.std(correction=0)))
        assert stats.loc[f"model.{k}", "numel"] == 12
    assert stats.loc["model.huge", "numel"] == 1e12
    assert ds.not_stored() == [(0, 0, "model.meta", "meta tensor: no data")]
    assert "1 tensors not stored" in repr(ds)
    with pytest.raises(tdinspect.DumpFormatError, match="model.meta.*not stored: meta tensor"):
        ds.tensor("model.meta")
    assert ds.diff(DumpSet.open(tmp_path)).first_divergence(metric="equal") is None


def test_fake_tensor_output_does_not_break_the_forward(tmp_path):
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with tdinspect.capture(model, tmp_path, on_nonfinite="raise") as dump:
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = model(torch.ones(4, 3))
        assert out.shape == (4, 2)
        model(torch.ones(1, 3))
        dump.step()
    side = json.loads((dump.folder / "pass00000.json").read_text())["entries"]
    assert side["skipped"][0].startswith("FakeTensor") and side["shape"][0] == [4, 2]
    assert side["stored"] == [False, True]
    assert list(load_pass(dump.folder / "pass00000.pt")) == ["model.0::call1"]


class _NoData(torch.Tensor):
    """A wrapper subclass without storage of its own (like DTensor or FP8 wrappers)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, size, stride):
        return _NoData(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, _NoData) else t  # noqa: E731
        args = torch.utils._pytree.tree_map(unwrap, args)
        kwargs = torch.utils._pytree.tree_map(unwrap, kwargs or {})
        out = func(*args, **kwargs)
        return torch.utils._pytree.tree_map(lambda t: _NoData(t) if isinstance(t, torch.Tensor) else t, out)


def test_wrapper_subclass_keeps_the_pass_readable(tmp_path):
    """A wrapper subclass output made the whole pass unreadable (refused by weights_only): now it
    is listed with its reason, and the rest of the pass reads."""
    model = torch.nn.ModuleDict({"w": _Emit(lambda x: _NoData(x * 2)), "p": _Emit(lambda x: x + 1)})
    x = torch.ones(3)
    with tdinspect.capture(model, tmp_path) as dump:
        model["w"](x)
        model["p"](x)
        dump.step()
    ds = DumpSet.open(tmp_path)
    assert torch.equal(ds.tensor("model.p"), x + 1)
    ((_, _, key, reason),) = ds.not_stored()
    assert key == "model.w" and "wrapper without storage" in reason


def test_dtensor_output_stores_its_local_shard_and_placements(tmp_path):
    """A DTensor output made the whole pass unreadable: now its local shard is stored, with
    the placements, mesh and global shape in the sidecar (a real one-process gloo group)."""
    import json

    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = _Emit(lambda x: distribute_tensor(x * 2, mesh, [Shard(0)]))
        x = torch.arange(6.0).reshape(2, 3)
        with tdinspect.capture(model, tmp_path / "dump") as dump:
            out = model(x)
            dump.step()
        assert torch.equal(out.to_local(), x * 2)  # the forward went on
    finally:
        dist.destroy_process_group()
    ds = DumpSet.open(tmp_path / "dump")
    assert torch.equal(ds.tensor("model"), x * 2)
    (side,) = (tmp_path / "dump").rglob("pass00000.json")
    storage = json.loads(side.read_text())["entries"]["storage"][0]
    assert storage["dtensor"] == {"placements": [str(Shard(0))], "mesh": [1], "global_shape": [2, 3]}


def _op_kinds():
    """Each kind made by ops, then used by another op (an input that is not plain)."""
    torch.manual_seed(0)
    dense = torch.randn(3, 4)
    dense[0, 1] = dense[2, 2] = 0.0

    def coo(x):
        t = (dense * x).to_sparse()
        t.mul_(2)  # an in-place op writing a sparse tensor
        return t, t.to_dense()

    def fake(x):
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            t = torch.ones(4, 3) @ torch.ones(3, 2)
        return t, None

    return {
        "mul_.": coo,
        "_to_sparse_csr.": lambda x: (t := (dense * x).to_sparse_csr(), t.to_dense()),
        "quantize_per_tensor.": lambda x: (
            t := torch.quantize_per_tensor(dense * x, 0.05, 3, torch.quint8),
            t.dequantize(),
        ),
        "nested_tensor": lambda x: (
            t := torch.nested.nested_tensor([dense[0] * x, dense[1, :2] * x]),
            t.to_padded_tensor(0.0),
        ),
        "empty.": lambda x: (torch.empty(5, 2, device="meta"), None),
        "ones.": fake,
        "add.": lambda x: (t := _NoData(dense * x) + 1, t * 2),
    }


def test_every_kind_under_capture_ops_is_stored_or_listed_and_the_forward_goes_on(tmp_path):
    """Op capture meets these kinds as outputs and as inputs (and writes one in place): each
    pass holds one kind, so nothing plain before it hides how the pass file is laid out."""
    kinds = _op_kinds()
    x = torch.tensor(1.5)
    eager = [f(x) for f in kinds.values()]
    with tdinspect.capture_ops(tmp_path, inputs=True, on_nonfinite="raise") as cap:
        live = []
        for f in kinds.values():
            live.append(f(x))
            cap.step()
    ds = DumpSet.open(tmp_path)
    assert ds.passes == list(range(len(kinds)))
    plain = lambda t: t.inner if isinstance(t, _NoData) else t  # noqa: E731
    for p, (name, (out, used), (_, live_used)) in enumerate(zip(kinds, eager, live)):
        if used is not None:  # the forward went on, with the same values
            assert torch.equal(plain(live_used), plain(used)), name
        key = [k for k in ds.sel(pass_=p).ops if name in k and "[out0]" in k][-1]
        why = [w for _, q, k, w in ds.not_stored() if q == p and split_call(k)[0] == key]
        if name in ("ones.", "add."):  # fake and storage-less wrapper: listed with their reason
            assert why and ("FakeTensor" if name == "ones." else "wrapper") in why[0]
        elif name == "empty.":
            assert ds.get_pass(p).uninitialized[ds.get_pass(p).position[key]]
        else:
            expected = (
                out.to_dense()
                if out.layout != torch.strided
                else out.dequantize()
                if out.is_quantized
                else torch.cat([t.reshape(-1) for t in out.unbind()])
            )
            assert torch.equal(ds.tensor(key, pass_=p), expected), name
    assert ds.diff(DumpSet.open(tmp_path)).first_divergence(metric="equal") is None


def test_statistics_without_a_sidecar_are_those_of_the_tensors_as_read(tmp_path):
    """With the sidecar gone, statistics come from the pass file: sparse, quantized and nested
    entries are reduced as analysis reads them (dense, dequantized, joined), as capture did."""
    kinds = {k: f for k, f in _kinds().items() if k in ("coo", "csr", "quant", "nested", "sub")}
    model = torch.nn.ModuleDict({k: _Emit(f) for k, f in kinds.items()})
    with tdinspect.capture(model, tmp_path) as dump:
        for m in model.values():
            m(torch.tensor(1.5))
        dump.step()
    with_sidecar = DumpSet.open(tmp_path).entries(progress=False).set_index("key")
    (dump.folder / "pass00000.json").unlink()
    ds = DumpSet.open(tmp_path)
    assert ds.get_pass(0).stats is None  # nothing left to read them from
    without = ds.entries(progress=False).set_index("key")
    for k in kinds:
        for stat in ("min", "max", "mean", "std", "numel"):
            assert without.loc[f"model.{k}", stat] == pytest.approx(
                with_sidecar.loc[f"model.{k}", stat], rel=1e-6
            ), (k, stat)


def test_live_comparison_reads_every_kind_as_the_offline_diff_does(tmp_path):
    """compare_to sees each kind as a diff of the dumps would: dense, dequantized, joined, an
    expand by its distinct elements (never 4 TB), meta and storage-less wrappers as not stored."""
    kinds = {**_kinds(), "wrapper": lambda x: _NoData(x * 2)}
    model = torch.nn.ModuleDict({k: _Emit(f) for k, f in kinds.items()})

    def run(x, *args, **kw):
        with tdinspect.capture(model, *args, **kw) as cap:
            for m in model.values():
                m(torch.tensor(x))
            cap.step()
        return cap

    run(1.5, tmp_path / "ref")
    assert run(1.5, compare_to=tmp_path / "ref").live.first is None  # the same run: no divergence
    run(1.6, tmp_path / "other")
    live = run(1.6, tmp_path / "live", compare_to=tmp_path / "ref", on_divergence="record")
    live = live.live.table()
    offline = DumpSet.open(tmp_path / "ref").diff(tmp_path / "other").table(progress=False)
    assert live["key"].tolist() == offline["key"].tolist()
    assert live["reason"].tolist() == offline["reason"].tolist()
    assert live["structural"].tolist() == offline["structural"].tolist()
    assert live["rel_diff"].tolist() == pytest.approx(offline["rel_diff"].tolist(), rel=1e-12, nan_ok=True)
    assert (offline["rel_diff"] > 1e-3).sum() == 7  # every kind with data differs
