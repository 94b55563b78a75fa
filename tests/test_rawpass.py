"""Pass files read from their zip records (no unpickling) give exactly what torch.load gives."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch

import tdinspect
from tdinspect.dumpset import DumpSet
from tdinspect.store.format import load_pass
from tdinspect.store.rawpass import layout, read_plain, read_raw

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
        )
    )


class ManyKinds(torch.nn.Module):
    """Outputs one tensor of every dtype, a non-contiguous view and a zero-size tensor."""

    def forward(self, x):
        out = {str(d).removeprefix("torch."): (x * 3).to(d) for d in DTYPES}
        out["transposed"] = x.t()
        out["empty"] = x[:0]
        out["scalar"] = x.sum()
        out["nan"] = torch.tensor([float("nan"), -0.0, float("inf")])
        return out


def _pass_indexes(path):
    ds = DumpSet.open(path)
    return [ds.get_pass(p) for p in ds.passes]


def _assert_fast_equals_torch_load(path):
    for pi in _pass_indexes(path):
        assert pi.raw is not None, f"{pi.path}: the writer recorded no layout"
        fast = pi._read_records()
        assert fast is not None, f"{pi.path}: the layout did not check out"
        slow = load_pass(pi.files.tensors)
        assert list(fast) == list(slow)
        for key in slow:
            assert same_bits(fast[key], slow[key]), key
        assert pi.load().keys() == slow.keys()


def test_every_dtype_reads_back_bit_for_bit(tmp_path):
    model = ManyKinds()
    with tdinspect.capture(model, tmp_path) as dump:
        for seed in range(2):
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)))
            dump.step()
    _assert_fast_equals_torch_load(tmp_path)


def test_module_and_op_level_dumps_of_the_bundled_model(tmp_path, model, tokens):
    with tdinspect.capture(model, tmp_path / "mod") as dump:
        model(tokens)
        dump.step()
    _assert_fast_equals_torch_load(tmp_path / "mod")
    with tdinspect.capture_ops(tmp_path / "ops", model=model) as dump:
        model(tokens).sum().backward()
        dump.step()
    _assert_fast_equals_torch_load(tmp_path / "ops")
    ds = DumpSet.open(tmp_path / "ops")
    assert ds.diff(tmp_path / "ops").first_divergence() is None


def test_a_write_to_a_read_tensor_never_reaches_the_file(tmp_path, model, tokens):
    with tdinspect.capture(model, tmp_path, filter="lm_head") as dump:
        model(tokens)
        dump.step()
    (pi,) = _pass_indexes(tmp_path)
    before = pi.files.tensors.read_bytes()
    t = pi.load()[pi.keys[0]]
    t.mul_(2)
    assert pi.files.tensors.read_bytes() == before


def _saved(tmp_path, tensors):
    path = tmp_path / "pass00000.pt"
    torch.save(tensors, path)
    return path


def test_shared_storages_are_numbered_as_torch_numbers_them(tmp_path):
    base = torch.arange(20.0)
    tensors = {
        "a": torch.ones(3),
        "view": base[5:9],
        "b": torch.zeros(2),
        "base": base,
        "again": base.view(4, 5)[1:, ::2],
    }
    path = _saved(tmp_path, tensors)
    back = read_raw(path, list(tensors), layout(tensors))
    assert back is not None
    for key, t in tensors.items():
        assert same_bits(back[key], t), key


BAD_LAYOUTS = [
    ["0", 10**9, [4], [1], "torch.float32"],  # past the end of the record
    ["0", 0, [4], [-1], "torch.float32"],  # negative stride
    ["0", -1, [4], [1], "torch.float32"],  # negative offset
    ["0", 0, [5], [1], "torch.float32"],  # one element too many
    ["../../etc/passwd", 0, [4], [1], "torch.float32"],  # not a record of the archive
    ["data.pkl", 0, [4], [1], "torch.uint8"],  # not a storage record
    ["0", 0, [4], [1], "os.system"],  # not a dtype
    ["0", 0, [4], [1], "torch.float64"],  # 16 bytes do not hold 4 float64
    ["0", 0, "4", [1], "torch.float32"],  # malformed shape
    ["0", 0, [4], [1]],  # too short
    None,
]


@pytest.mark.parametrize("bad", BAD_LAYOUTS)
def test_a_layout_that_does_not_check_out_is_refused(tmp_path, bad):
    path = _saved(tmp_path, {"a": torch.arange(4.0)})
    assert read_raw(path, ["a"], [bad]) is None


def test_a_big_endian_archive_is_not_viewed(tmp_path):
    tensors = {"a": torch.arange(4.0)}
    path = _saved(tmp_path, tensors)
    assert read_raw(path, ["a"], layout(tensors)) is not None and read_plain(path) is not None
    with zipfile.ZipFile(path) as src:
        records = [(i, src.read(i)) for i in src.infolist()]
    with zipfile.ZipFile(path, "w") as dst:  # the same records, the byte order said big
        for info, data in records:
            dst.writestr(info, b"big" if info.filename.endswith("/byteorder") else data)
    assert read_raw(path, ["a"], layout(tensors)) is None and read_plain(path) is None


def test_a_refused_layout_falls_back_to_torch_load(tmp_path, model, tokens, monkeypatch):
    with tdinspect.capture(model, tmp_path, filter="lm_head") as dump:
        model(tokens)
        dump.step()
    (pi,) = _pass_indexes(tmp_path)
    truth = load_pass(pi.files.tensors)
    unpickled = []

    def spy(path, **kwargs):
        unpickled.append(path)
        return load_pass(path, **kwargs)

    monkeypatch.setattr(tdinspect.store.passindex, "load_pass", spy)
    assert pi.load().keys() == truth.keys() and unpickled == []  # the records, as laid out
    pi.raw = [["0", 10**12, [1], [1], "torch.float32"] for _ in pi.raw]
    assert pi._read_records() is None  # refused: the offset lies beyond the record
    loaded = pi.load()
    assert unpickled == [pi.files.tensors]  # so torch.load read it
    assert all(same_bits(loaded[k], truth[k]) for k in truth)


def test_files_without_a_layout_still_open(tmp_path):
    folder = tmp_path / "rank0_pid7"
    folder.mkdir()
    tensors = {"model.a": torch.randn(3, 4), "model.b": torch.randn(2)}
    torch.save(tensors, folder / "pass00000.pt")  # another tool: no sidecar
    ds = DumpSet.open(tmp_path)
    assert same_bits(ds.tensor("model.a"), tensors["model.a"])
    assert not os.path.exists(Path(folder) / "pass00000.json")


def test_a_renamed_or_swapped_entry_is_caught_by_the_archive_itself(tmp_path):
    tensors = {"a": torch.arange(4.0), "b": torch.arange(4.0) + 10}
    path = _saved(tmp_path, tensors)
    raw = layout(tensors)
    assert read_raw(path, ["a", "b"], raw) is not None
    assert read_raw(path, ["b", "a"], raw) is None  # reordered
    assert read_raw(path, ["a", "renamed"], raw) is None  # renamed
    assert read_raw(path, ["a", "b"], [raw[1], raw[0]]) is None  # records swapped
