"""Checksums on every tensor kind capture accepts (issue 36, cases 1-2): ``checksum=True`` never
crashes the process, breaks the model's forward, changes the model's tensors or loses a pass;
a fingerprint is equal for equal values and differs for one changed element, whatever the
dtype (bool, complex, float8, uint16/32/64, quantized) and layout (strided, transposed,
expanded, conjugate, negative, sparse COO/CSR, nested, subclass); a meta tensor gets none,
named in a warning, its pass written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import tdinspect
from tdinspect import DumpSet
from tdinspect.numerics.checksum import tensor_checksum

from .conftest import ROOT, only_folder

warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")


class _Emit(torch.nn.Module):
    """A module whose output is ``make()``: a tensor of any kind, made fresh each call."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make()


def _isolated(request) -> bool:
    """Run the calling test again in a child process (a segfault there fails this test, never
    the whole run): ``True`` in the parent once the child passed, ``False`` in the child."""
    if os.environ.get("TDINSPECT_ISOLATED") == request.node.nodeid:
        return False
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TDINSPECT_ISOLATED": request.node.nodeid},
    )
    assert out.returncode == 0, (out.returncode, out.stdout[-3000:], out.stderr[-1000:])
    return True


def _entries(folder, p=0) -> dict:
    e = json.loads((only_folder(folder) / f"pass{p:05d}.json").read_text())["entries"]
    return dict(zip(e["key"], e.get("checksum") or [None] * len(e["key"])))  # none: no column


# -- case 1: quantized outputs (a segfault: run in a subprocess) ----------------------------


QUANTIZED = textwrap.dedent(
    """
    import json, sys, warnings
    import torch, tdinspect
    warnings.simplefilter("ignore")
    x = torch.linspace(-3, 3, 24).reshape(4, 6)
    kinds = {
        "qint8": lambda v: torch.quantize_per_tensor(v, 0.1, 0, torch.qint8),
        "per_channel_quint8": lambda v: torch.quantize_per_channel(
            v, torch.full((4,), 0.1), torch.full((4,), 3), 0, torch.quint8),
        "quint4x2": lambda v: torch.quantize_per_tensor(v, 0.5, 1, torch.quint4x2),
        "qint32": lambda v: torch.quantize_per_tensor(v, 0.1, 0, torch.qint32),
    }
    class Emit(torch.nn.Module):
        def __init__(self, f):
            super().__init__()
            self.f = f
        def forward(self, v):
            return self.f(v)
    model = torch.nn.ModuleDict({k: Emit(f) for k, f in kinds.items()})
    changed = x.clone()
    changed[1, 2] += 1.0  # one element, moved past the quantization step of every kind
    with tdinspect.capture(model, sys.argv[1], checksum=True) as dump:
        for step in range(5):
            for k, m in model.items():
                m(x)
                m(x.clone())
                m(changed)
            dump.step()
    print("done")
    """
)


def test_quantized_outputs_with_checksums_are_captured_not_a_segfault(tmp_path):
    """qint8, per-channel quint8, quint4x2 and qint32 outputs under ``checksum=True``: the
    process died (SIGSEGV, bytes of a quantized tensor reinterpreted) and the five passes
    stepped were lost; now every pass is written, each checksum built from ``int_repr()`` and
    the quantization parameters: equal for equal values, different for one changed element."""
    out = subprocess.run(
        [sys.executable, "-c", QUANTIZED, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0 and "done" in out.stdout, (out.returncode, out.stderr[-2000:])
    ds = DumpSet.open(tmp_path)
    assert len(ds.passes) == 5
    for p in range(5):
        sums = _entries(tmp_path, p)
        for k in ("qint8", "per_channel_quint8", "quint4x2", "qint32"):
            same, again, changed = (sums[f"model.{k}" + s] for s in ("", "::call1", "::call2"))
            assert isinstance(same, str) and same == again != changed, (p, k, same, again, changed)
    assert torch.equal(
        ds.tensor("model.qint8", pass_=4),
        torch.quantize_per_tensor(torch.linspace(-3, 3, 24), 0.1, 0, torch.qint8).dequantize().reshape(4, 6),
    )


def test_quantized_checksums_see_the_scale_and_the_dtype(request):
    """Two quantized tensors with the same integers differ in checksum when their scale, zero
    point or dtype differs (their values differ). In a child process: a segfault before."""
    if _isolated(request):
        return
    x = torch.linspace(-1, 1, 12)
    a = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
    b = torch._make_per_tensor_quantized_tensor(a.int_repr(), 0.2, 0)
    c = torch._make_per_tensor_quantized_tensor(a.int_repr(), 0.1, 1)
    assert torch.equal(a.int_repr(), b.int_repr())
    digests = {int(tensor_checksum(t)) for t in (a, b, c)}
    assert len(digests) == 3
    assert int(tensor_checksum(a)) == int(
        tensor_checksum(torch.quantize_per_tensor(x.clone(), 0.1, 0, torch.qint8))
    )


# -- case 2: conjugate and negative views, FFT, nested, meta, TwoTensor ----------------------


def test_conjugate_and_negative_views_keep_the_forward_and_get_their_values_checksum(tmp_path):
    """``y.conj()`` and ``y.conj().imag`` under ``checksum=True`` raised inside the model's forward
    (a view to another dtype is refused for a conjugate or negative view); now their bits are
    resolved on a copy: the model's outputs keep their conjugate and negative bits, and the
    checksum is that of the value they show."""
    y = torch.complex(torch.linspace(-1, 1, 6), torch.linspace(2, 3, 6))
    model = torch.nn.ModuleDict({"conj": _Emit(lambda: y.conj()), "imag": _Emit(lambda: y.conj().imag)})
    with tdinspect.capture(model, tmp_path, checksum=True, checksum_dim=0) as dump:
        conj, imag = model["conj"](None), model["imag"](None)
        dump.step()
    assert conj.is_conj() and imag.is_neg()  # the model's tensors untouched
    assert torch.equal(conj.resolve_conj(), torch.complex(y.real, -y.imag))
    sums = _entries(tmp_path)
    want_conj = int(tensor_checksum(conj.resolve_conj()))
    want_imag = int(tensor_checksum(imag.resolve_neg()))
    assert sums["model.conj"] == f"{want_conj & (2**64 - 1):016x}"
    assert sums["model.imag"] == f"{want_imag & (2**64 - 1):016x}"
    assert sums["model.conj"] != f"{int(tensor_checksum(y)) & (2**64 - 1):016x}"


def test_an_fft_power_spectrum_at_op_level_with_checksums(tmp_path):
    """An FFT power spectrum (``X * X.conj()``) under ``capture_ops(checksum=True)`` broke at the
    conjugate view; now every op is fingerprinted and two equal runs are equal bitwise."""

    def run(path):
        x = torch.sin(torch.linspace(0, 20, 64))
        with tdinspect.capture_ops(path, checksum=True, environ={}) as dump:
            spec = torch.fft.rfft(x)
            power = (spec * spec.conj()).real
            dump.step()
        return power

    p1, p2 = run(tmp_path / "a"), run(tmp_path / "b")
    assert torch.equal(p1, p2)
    sums = _entries(tmp_path / "a")
    assert sums and all(isinstance(c, str) for c in sums.values()), sums
    assert any("conj" in k for k in sums), list(sums)
    assert DumpSet.open(tmp_path / "a").diff(tmp_path / "b").first_divergence(metric="equal") is None


def test_a_nested_output_with_checksums(tmp_path):
    """A nested tensor broke the forward under ``checksum=True`` (``reshape`` of a nested tensor);
    now its checksum is its components' values and shapes."""
    a, b = torch.arange(6.0), torch.arange(3.0)
    model = _Emit(lambda: torch.nested.nested_tensor([a, b]))
    other = _Emit(lambda: torch.nested.nested_tensor([torch.arange(5.0), torch.arange(4.0)]))
    with tdinspect.capture(torch.nn.ModuleDict({"n": model, "m": other}), tmp_path, checksum=True) as dump:
        out = model(None)
        model(None)
        other(None)
        dump.step()
    assert out.is_nested and torch.equal(out.unbind()[0], a)
    sums = _entries(tmp_path)
    assert sums["model.n"] == sums["model.n::call1"]
    assert sums["model.m"] != sums["model.n"]  # the same 9 values joined, other components


def test_a_meta_output_with_checksums_writes_the_pass_and_names_the_entry(tmp_path):
    """A meta output under ``checksum=True`` raised at ``step()`` (the checksum, a meta tensor,
    could not be copied to the host): the pass was not written. Now the entry is named in a
    warning, its checksum null, the pass and its other entries written, and ``metric="equal"``
    sets it aside (never "equal")."""
    model = torch.nn.ModuleDict(
        {"meta": _Emit(lambda: torch.empty(5, 2, device="meta")), "p": _Emit(lambda: torch.ones(3))}
    )
    for side in ("a", "b"):
        with tdinspect.capture(model, tmp_path / side, checksum=True) as dump:
            with pytest.warns(
                RuntimeWarning, match=r"model\.meta has no checksum.*meta tensor holds no data"
            ):
                out = model["meta"](None)
            model["p"](None)
            dump.step()
        assert out.device.type == "meta"
    sums = _entries(tmp_path / "a")
    assert sums["model.meta"] is None and isinstance(sums["model.p"], str)
    d = DumpSet.open(tmp_path / "a").diff(tmp_path / "b")
    v = d.verdict(metric="equal")
    assert v.outcome != "matches", v


def test_a_fake_tensor_output_with_checksums_has_none_and_the_pass_is_written(tmp_path):
    """A forward under ``FakeTensorMode`` with ``checksum=True`` lost its pass
    (``CaptureWriteError``: the checksum was itself fake); now it has none, the pass is written
    and the real call beside it is fingerprinted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with tdinspect.capture(model, tmp_path, checksum=True) as dump:
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.warns(RuntimeWarning, match="fake tensor"):
            assert model(torch.ones(4, 3)).shape == (4, 2)
        model(torch.ones(1, 3))
        dump.step()
    sums = _entries(tmp_path)
    assert sums["model.0"] is None and isinstance(sums["model.0::call1"], str)
    assert torch.equal(DumpSet.open(tmp_path).tensor("model.0::call1"), model(torch.ones(1, 3)).detach())


def test_a_wrapper_subclass_with_checksums_keeps_the_pass(tmp_path):
    """A ``TwoTensor`` output lost its pass with ``CaptureWriteError`` (the checksum was itself a
    ``TwoTensor``); now its checksum is that of its components, in order."""
    x = torch.arange(4.0)
    model = torch.nn.ModuleDict(
        {
            "two": _Emit(lambda: TwoTensor(x, x * 2)),
            "swap": _Emit(lambda: TwoTensor(x * 2, x)),
            "p": _Emit(lambda: x + 1),
        }
    )
    with tdinspect.capture(model, tmp_path, checksum=True) as dump:
        for _ in range(2):
            for m in model.values():
                m(None)
            dump.step()
    ds = DumpSet.open(tmp_path)
    assert len(ds.passes) == 2 and torch.equal(ds.tensor("model.p", pass_=1), x + 1)
    sums = _entries(tmp_path, 1)
    assert isinstance(sums["model.two"], str) and sums["model.two"] != sums["model.swap"]
    assert sums["model.two"] == _entries(tmp_path, 0)["model.two"]


# -- every dtype and layout torch makes on the CPU ------------------------------------------


QUANTIZED_DTYPES = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)


def _dtypes() -> list[torch.dtype]:
    """Every non-quantized dtype this torch can hold on the CPU (random bytes viewed as it)."""
    out = []
    for name in dir(torch):
        d = getattr(torch, name)
        if not isinstance(d, torch.dtype) or d in out or d in QUANTIZED_DTYPES:
            continue
        try:  # one torch's ops produce on the CPU: converts to float (not bits*, float4 x2)
            torch.zeros(16, dtype=torch.uint8).view(d).float()
        except Exception:  # noqa: BLE001 - a dtype only a view makes, or none at all
            continue
        out.append(d)
    return out


def _values(dtype: torch.dtype, change: bool) -> torch.Tensor:
    """A [4, 6] tensor of ``dtype`` from fixed random bytes; ``change``: one element's lowest
    bit flipped (element [1, 2])."""
    size = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (24 * size,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    raw[0::size] |= 2 if dtype != torch.bool else 0  # no zero element (sparse keeps each)
    if change:
        raw[(1 * 6 + 2) * size] ^= 1
        if dtype.is_complex:  # the imaginary part too (the "neg" layout shows only it)
            raw[(1 * 6 + 2) * size + size // 2] ^= 1
    return raw.view(dtype).reshape(4, 6)


def _quantized(dtype, per_channel: bool, change: bool):
    v = torch.linspace(-2, 2, 24).reshape(4, 6)
    if change:
        v[1, 2] += 1.0
    if per_channel:
        return torch.quantize_per_channel(v, torch.full((4,), 0.5), torch.full((4,), 1), 0, dtype)
    return torch.quantize_per_tensor(v, 0.5, 1, dtype)


LAYOUTS = {
    "strided": lambda v: v,
    "transposed": lambda v: v.t(),
    "expanded": lambda v: v[1:2].expand(3, 6),  # row 1 holds the changed element
    "conj": lambda v: v.conj() if v.is_complex() else None,
    "neg": lambda v: v.conj().imag if v.is_complex() else torch._neg_view(v),
    "sparse_coo": lambda v: v.to_sparse(),
    "sparse_csr": lambda v: v.to_sparse_csr(),
    "nested": lambda v: torch.nested.nested_tensor([v[0], v[1, :4], v[2:].reshape(-1)]),
    "jagged": lambda v: torch.nested.nested_tensor([v[0], v[1, :4]], layout=torch.jagged),
    "subclass": lambda v: TwoTensor(v, v.flip(0)),
}


def _makers(layout: str) -> dict[str, tuple]:
    """``{name: (make(change) -> tensor)}`` of every dtype this layout can be made of here."""
    out = {}
    shape = LAYOUTS.get(layout, lambda v: None)
    for d in _dtypes():

        def make(change, d=d):
            return shape(_values(d, change))

        try:
            if make(False) is None:
                continue
            _bits(make(True))  # its value resolves (no negated bool)
        except Exception:  # noqa: BLE001 - a kind torch cannot make of this dtype
            continue
        out[str(d).removeprefix("torch.")] = make
    if layout == "quantized":
        out.clear()
        for d in QUANTIZED_DTYPES:
            for per_channel in (False, True):
                try:
                    _quantized(d, per_channel, False)
                except Exception:  # noqa: BLE001 - no per-channel form of this dtype
                    continue
                key = f"{d}{'_per_channel' if per_channel else ''}".removeprefix("torch.")
                out[key] = lambda change, d=d, pc=per_channel: _quantized(d, pc, change)
    return out


def _bits(t) -> list:
    """The model's output as plain bytes and flags, without tdinspect's code: what must be
    unchanged by capture."""
    if isinstance(t, TwoTensor):
        return ["two", *_bits(t.a), *_bits(t.b)]
    if t.is_quantized:
        params = (
            (t.q_scale(), t.q_zero_point())
            if t.qscheme() == torch.per_tensor_affine
            else (t.q_per_channel_scales().tolist(), t.q_per_channel_zero_points().tolist())
        )
        return [str(t.dtype), params, t.int_repr().reshape(-1).view(torch.uint8).tolist()]
    if t.is_nested:
        return [str(t.layout), *[b for c in t.unbind() for b in _bits(c)]]
    if t.layout == torch.sparse_coo:
        return [str(t.layout), *_bits(t._indices()), *_bits(t._values())]
    if t.layout != torch.strided:
        return [str(t.layout), *_bits(t.crow_indices()), *_bits(t.col_indices()), *_bits(t.values())]
    flags = (t.is_conj(), t.is_neg(), tuple(t.shape), t.stride(), str(t.dtype))
    plain = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return [flags, plain.view(torch.uint8).tolist()]


@pytest.mark.parametrize("layout", [*LAYOUTS, "quantized", "meta"])
def test_every_dtype_and_layout_gets_a_checksum_and_the_forward_is_unchanged(tmp_path, layout, request):
    """For each dtype torch makes on the CPU (bool, complex, float8 variants, uint16/32/64...;
    quantized per tensor and per channel) in this layout: captured with ``checksum=True``, the
    model's output is bitwise what it is without capture, the pass is written, the checksum is
    equal for equal values and differs for one changed element (meta: none, the pass written).
    Quantized in a child process (a segfault before)."""
    if layout == "quantized" and _isolated(request):
        return
    makers = (
        {
            str(d).removeprefix("torch."): (lambda change, d=d: torch.empty(4, 6, dtype=d, device="meta"))
            for d in _dtypes()[:6]
        }
        if layout == "meta"
        else _makers(layout)
    )
    assert len(makers) >= (3 if layout in ("conj", "meta") else 8), sorted(makers)
    model = torch.nn.ModuleDict({"t_" + name: _Emit(lambda m=m: m(False)) for name, m in makers.items()})
    changed = torch.nn.ModuleDict({"t_" + name: _Emit(lambda m=m: m(True)) for name, m in makers.items()})
    want = {name: _bits(m(False)) for name, m in makers.items() if layout != "meta"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tdinspect.capture(
            torch.nn.ModuleDict({"m": model, "c": changed}), tmp_path, checksum=True
        ) as dump:
            got = {}
            for name in makers:
                k = "t_" + name
                got[name] = model[k](None)
                model[k](None)
                changed[k](None)
            dump.step()
    sums = _entries(tmp_path)
    ds = DumpSet.open(tmp_path)
    assert len(ds.passes) == 1
    for name in makers:
        k = "t_" + name
        first, again, other = sums[f"model.m.{k}"], sums[f"model.m.{k}::call1"], sums[f"model.c.{k}"]
        if layout == "meta":
            assert first is None and got[name].device.type == "meta", name
            continue
        assert _bits(got[name]) == want[name], f"{name}: the model's output changed under capture"
        assert isinstance(first, str) and first == again, (name, first, again)
        assert other != first, f"{name} ({layout}): one changed element, the same checksum {first}"
