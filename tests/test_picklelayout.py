"""A plain torch.save file's layout read from its pickle's opcodes: exactly what torch.load reads,
or nothing (and torch.load) for anything else; never a call, an import or an error."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import random
import struct
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tdinspect.store import picklelayout
from tdinspect.store.picklelayout import layout_of_pickle
from tdinspect.store.rawpass import read_plain

from .test_rawpass import same_bits


def _pickle_of(tensors) -> bytes:
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return zipfile.ZipFile(buf).read("archive/data.pkl")


def test_plain_files_read_as_torch_load_reads_them(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    tensors = {
        "f32": base,
        "view": base[1:, ::2],
        "t": base.t(),
        "bf16": base.bfloat16()[2],
        "f16": base.half(),
        "f64": base.double(),
        "i64": torch.arange(5),
        "i8": torch.arange(5, dtype=torch.int8),
        "u8": torch.arange(5, dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
        "c64": torch.randn(3, dtype=torch.complex64),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "again": base,
    }
    path = tmp_path / "pass00000.pt"
    torch.save(tensors, path)
    keys, raw, back = read_plain(path)
    assert keys == list(tensors)
    assert raw[0][0] == raw[1][0] == raw[-1][0]  # one storage, one record
    truth = torch.load(path, weights_only=True)
    for k in tensors:
        assert same_bits(back[k], truth[k]) and back[k].stride() == truth[k].stride(), k


@pytest.mark.parametrize(
    "tensors",
    [
        {"fp8": torch.zeros(3, dtype=torch.float8_e4m3fn)},  # _rebuild_tensor_v3
        {"sparse": torch.eye(3).to_sparse()},
        {"param": torch.nn.Parameter(torch.ones(2))},
        {"nested": {"a": torch.ones(2)}},
        {1: torch.ones(2)},
        [torch.ones(2)],
    ],
)
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

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(at=st.integers(0, len(pickled) - 1), byte=st.integers(0, 255), cut=st.integers(1, len(pickled)))
    def run(at, byte, cut):
        data = bytearray(pickled)
        data[at] = byte
        found = layout_of_pickle(bytes(data[:cut]))  # never raises, never calls anything
        if found is not None:
            keys, raw = found
            assert all(isinstance(k, str) for k in keys) and len(keys) == len(raw)
            assert all(len(e) == 5 and isinstance(e[0], str) and isinstance(e[4], str) for e in raw)

    run()


# -- the template reader (one compiled pattern an entry): the opcode reader's answer or none ------
def _usual_programs():
    base = torch.arange(24.0).reshape(4, 6)
    return {
        "kinds": {
            "f32": base,
            "view": base[1:, ::2],
            "t": base.t(),
            "bf16": base.bfloat16()[2],
            "f16": base.half(),
            "f64": base.double(),
            "i64": torch.arange(5),
            "bool": torch.tensor([True, False]),
            "c64": torch.ones(3, dtype=torch.complex64),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
            "again": base,
            "grad": torch.ones(2, requires_grad=True),
            "é\ud800": torch.ones(1),
        },
        "dims": {
            "4d": torch.zeros(2, 3, 4, 5),
            "big": torch.zeros(300, 70_000)[:, 5:7],
            "0d": torch.zeros(()),
        },
        "one": {"a": torch.ones(2)},
        "none": {},
        # > 256 memo puts (LONG_BINPUT / LONG_BINGET), > 1000 items (several SETITEMS batches,
        # the last of one item: SETITEM)
        "many": {f"model.layers.{i}.out": base[i % 4] if i % 3 else torch.ones(i % 5) for i in range(2001)},
    }


@pytest.mark.parametrize("name", list(_usual_programs()))
def test_the_template_reader_reads_what_the_opcode_reader_reads(name):
    tensors = _usual_programs()[name]
    pickled = _pickle_of(tensors)
    fast, exact = picklelayout._template_layout(pickled), picklelayout._exact_layout(pickled)
    assert fast is not None  # the usual program: read by the template reader itself
    assert fast == exact and fast[0] == list(tensors)
    assert layout_of_pickle(pickled) == exact


def _memo_variants(pickled: bytes):
    """The pickle with each memo put / read's index replaced by every other index in use (and
    one past them): reads of the wrong constant, of a later put, of a tensor; puts that
    overwrite a constant or skip a number."""
    ops = list(pickletools.genops(pickled))
    top = max(arg for op, arg, _ in ops if op.name in ("BINPUT", "LONG_BINPUT")) + 2
    for i, (op, arg, pos) in enumerate(ops):
        if op.name not in ("BINPUT", "BINGET", "LONG_BINPUT", "LONG_BINGET"):
            continue
        end = ops[i + 1][2]
        for other in range(top):
            if other == arg:
                continue
            if op.name.startswith("LONG") or other > 255:
                code = {"BINPUT": b"r", "BINGET": b"j"}.get(op.name, op.code.encode("latin-1"))
                new = code + struct.pack("<I", other)
            else:
                new = op.code.encode("latin-1") + bytes([other])
            yield pickled[:pos] + new + pickled[end:]


def test_memo_tricks_give_the_opcode_readers_answer_or_none():
    tensors = {
        "a": torch.arange(6.0).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.bfloat16),
        "c": torch.arange(6.0)[1:],
        "d": torch.zeros(2, dtype=torch.bfloat16),
    }
    tensors["e"] = tensors["a"]  # the same tensor: a memo read of the whole value
    tensors["f"] = tensors["a"][1]  # the same storage: a memo read of its record's name
    pickled = _pickle_of(tensors)
    truth, traps = picklelayout._exact_layout(pickled), 0
    for variant in _memo_variants(pickled):
        fast, exact = picklelayout._template_layout(variant), picklelayout._exact_layout(variant)
        assert fast is None or fast == exact
        traps += exact is not None and exact != truth
    assert traps > 10  # variants the opcode reader reads as another layout: none read otherwise


def test_mutated_pickles_give_the_opcode_readers_answer_or_none():
    tensors = {
        "model.a": torch.arange(6.0).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.bfloat16),
        "c": torch.arange(300.0)[7:],
        "d": torch.zeros(2, 2, 2, 2),
    }
    tensors["e"] = tensors["model.a"]
    pickled = _pickle_of(tensors)
    accepted = []

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(
        at=st.integers(0, len(pickled) - 1),
        byte=st.integers(0, 255),
        how=st.sampled_from(["replace", "insert", "delete", "cut"]),
    )
    def run(at, byte, how):
        data = bytearray(pickled)
        if how == "replace":
            data[at] = byte
        elif how == "insert":
            data.insert(at, byte)
        elif how == "delete":
            del data[at]
        else:
            del data[at:]
        fast = picklelayout._template_layout(bytes(data))
        if fast is not None:
            assert fast == picklelayout._exact_layout(bytes(data))
            accepted.append(fast != picklelayout._exact_layout(pickled))

    run()
    assert any(accepted)  # some mutations (a shape, an offset, a key's byte) still read, alike


def test_token_edits_give_the_opcode_readers_answer_or_none():
    """Whole opcodes replaced, inserted, deleted or swapped (memo reads of other constants,
    other tuple sizes, LONG1, stray SETITEMS...): the template reader's answer, when it
    gives one, is the opcode reader's."""
    base = torch.arange(24.0).reshape(4, 6)
    pickled = _pickle_of(
        {
            "a": base,
            "b": base[1:],
            "c": torch.ones(3, dtype=torch.bfloat16),
            "d": base,
            "e": torch.zeros(2, 2, 2, 2),
            "f": torch.tensor(1.0),
        }
    )
    ops = list(pickletools.genops(pickled))
    starts = [pos for _, _, pos in ops] + [len(pickled)]
    tokens = [pickled[starts[i] : starts[i + 1]] for i in range(len(ops))]
    vocab = [
        b"q\x01",
        b"h\x02",
        b"h\x03",
        b"h\x04",
        b"h\x05",
        b"h\x06",
        b"h\n",
        b"K\x00",
        b"K\x05",
        b"M\x00\x01",
        b"J\xff\xff\xff\xff",
        b")",
        b"(",
        b"t",
        b"\x85",
        b"\x86",
        b"\x87",
        b"\x88",
        b"\x89",
        b"R",
        b"Q",
        b"s",
        b"u",
        b".",
        b"X\x01\x00\x00\x000",
        b"X\x03\x00\x00\x00cpu",
        b"ctorch\nHalfStorage\n",
        b"r\x00\x01\x00\x00",
        b"j\x00\x01\x00\x00",
        b"\x8a\x01\x05",
    ]
    rng = random.Random(0)
    accepted = 0
    for _ in range(4000):
        edited = list(tokens)
        for _ in range(rng.randint(1, 3)):
            i, how = rng.randrange(len(edited)), rng.random()
            if how < 0.4:
                edited[i] = rng.choice(vocab)
            elif how < 0.6:
                edited.insert(i, rng.choice(vocab))
            elif how < 0.8:
                del edited[i]
            else:
                j = rng.randrange(len(edited))
                edited[i], edited[j] = edited[j], edited[i]
        data = b"".join(edited)
        fast = picklelayout._template_layout(data)
        if fast is not None:
            accepted += 1
            assert fast == picklelayout._exact_layout(data), data
    assert accepted > 10  # edits that keep the usual program (a shape, a dtype) are read
