"""A plain torch.save file's layout read from its pickle's opcodes: exactly what torch.load reads,
or nothing (and torch.load) for anything else; never a call, an import or an error."""

from __future__ import annotations

import io
import os
import pickle
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tdinspect.picklelayout import layout_of_pickle
from tdinspect.rawpass import read_plain

from .test_rawpass import same_bits


def _pickle_of(tensors) -> bytes:
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return zipfile.ZipFile(buf).read("archive/data.pkl")


def test_plain_files_read_as_torch_load_reads_them(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    tensors = {"f32": base, "view": base[1:, ::2], "t": base.t(), "bf16": base.bfloat16()[2],
               "f16": base.half(), "f64": base.double(), "i64": torch.arange(5),
               "i8": torch.arange(5, dtype=torch.int8), "u8": torch.arange(5, dtype=torch.uint8),
               "bool": torch.tensor([True, False]), "c64": torch.randn(3, dtype=torch.complex64),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "again": base}
    path = tmp_path / "pass00000.pt"
    torch.save(tensors, path)
    keys, raw, back = read_plain(path)
    assert keys == list(tensors)
    assert raw[0][0] == raw[1][0] == raw[-1][0]  # one storage, one record
    truth = torch.load(path, weights_only=True)
    for k in tensors:
        assert same_bits(back[k], truth[k]) and back[k].stride() == truth[k].stride(), k


@pytest.mark.parametrize("tensors", [
    {"fp8": torch.zeros(3, dtype=torch.float8_e4m3fn)},          # _rebuild_tensor_v3
    {"sparse": torch.eye(3).to_sparse()},
    {"param": torch.nn.Parameter(torch.ones(2))},
    {"nested": {"a": torch.ones(2)}},
    {1: torch.ones(2)},
    [torch.ones(2)],
])
def test_anything_else_is_left_to_torch_load(tmp_path, tensors):
    path = tmp_path / "pass00000.pt"
    torch.save(tensors, path)
    assert read_plain(path) is None


def test_a_pickle_naming_anything_else_is_refused():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo hacked",))

    assert layout_of_pickle(pickle.dumps({"a": Evil()}, protocol=2)) is None
    assert layout_of_pickle(pickle.dumps({"a": 1}, protocol=4)) is None
    assert layout_of_pickle(b"not a pickle") is None
    assert layout_of_pickle(b"") is None


def test_mutated_pickles_give_a_checked_layout_or_none(tmp_path):
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    path = tmp_path / "pass00000.pt"
    torch.save(tensors, path)
    pickled = _pickle_of(tensors)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True)
    @given(at=st.integers(0, len(pickled) - 1), byte=st.integers(0, 255),
           cut=st.integers(1, len(pickled)))
    def run(at, byte, cut):
        data = bytearray(pickled)
        data[at] = byte
        found = layout_of_pickle(bytes(data[:cut]))  # never raises, never calls anything
        if found is not None:
            keys, raw = found
            assert all(isinstance(k, str) for k in keys) and len(keys) == len(raw)
            assert all(len(e) == 5 and isinstance(e[0], str) and isinstance(e[4], str)
                       for e in raw)

    run()
