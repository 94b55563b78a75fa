"""Hostile dumps: a dump file can make tdinspect read its tensors, nothing else.

Each test doctors a real dump the way an attacker (or an unlucky edit) would,
and checks that tdinspect neither acts on the machine nor gives a wrong answer.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._pytree import tree_flatten, treespec_dumps

import tdinspect
from tdinspect import DumpFormatError, DumpSet
from tdinspect.cli import main

from .conftest import only_folder


def _capture(path):
    x = torch.arange(4.0)
    with tdinspect.capture_ops(path, inputs=True) as dump:
        y = x * 3
        z = y.view(2, 2)
        z + 1
        dump.step()
    return only_folder(path) / "pass00000.json"


def _edit(sidecar, change):
    doc = json.loads(sidecar.read_text())
    change(doc, doc["entries"])
    sidecar.write_text(json.dumps(doc))


def _call(op, *args):
    leaves, spec = tree_flatten((args, {}))
    return {"aten": op, "spec": treespec_dumps(spec),
            "leaves": [{"t": a[1:]} if isinstance(a, str) and a.startswith("@") else a
                       for a in leaves]}


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "canary.bin"
    path.write_bytes(b"SECRET-bytes-of-a-file-you-own!!")
    return path


def _from_file_then_copy(canary):
    """The reported attack: a view 'rebuilt' by from_file(shared=True), then copy_ into it."""
    def change(doc, e):
        v = e["key"].index("model/aten.view.default[out0]")
        a = e["key"].index("model/aten.add.Tensor[in0]")
        e["ref"][v] = {"kind": "view", "of": "model/aten.mul.Tensor[out0]"}
        e["call_args"][v] = _call("aten.from_file.default", str(canary), True, 4)
        e["ref"][a] = {"kind": "view", "of": "model/aten.view.default[out0]"}
        e["call_args"][a] = _call("aten.copy_.default", "@model/aten.view.default[out0]",
                                  "@model/aten.mul.Tensor[out0]")
        out = e["key"].index("model/aten.add.Tensor[out0]")
        e["call_args"][out] = _call("aten.from_file.default", str(canary), True, 4)
    return change


def test_views_are_never_rebuilt_by_running_a_named_operator(tmp_path, canary):
    sidecar = _capture(tmp_path / "a")
    _capture(tmp_path / "b")
    _edit(sidecar, _from_file_then_copy(canary))
    before = canary.read_bytes(), canary.stat().st_mtime_ns
    ds = DumpSet.open(tmp_path / "a", on_error="warn")
    for key in ("model/aten.view.default[out0]", "model/aten.add.Tensor[in0]"):
        try:
            t = ds.tensor(key)
        except DumpFormatError as exc:
            assert "pass00000" in str(exc)
        else:  # the sidecar was ignored, or the view re-indexed: the stored values, never the file's
            assert b"SECRET" not in t.numpy().tobytes()
    assert main(["first-divergence", str(tmp_path / "a"), str(tmp_path / "b")]) in (0, 1, 2)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) in (0, 1, 2)
    with pytest.raises(DumpFormatError, match="pass00000.*from_file.*not run"):
        tdinspect.replay(tmp_path / "a", "model/aten.add.Tensor")
    assert (canary.read_bytes(), canary.stat().st_mtime_ns) == before


@pytest.mark.parametrize("op, why", [
    ("aten.from_file.default", "never runs"),
    ("aten.stft.center", "string 'pad_mode'"),
    ("aten.copy_.default", "never runs"),
    ("aten.mul_.Tensor", "written or aliased"),
    ("aten.add_.Tensor", "written or aliased"),
    ("aten.add.out", "written or aliased"),
    ("aten.save.default", "never runs"),
    ("aten._copy_from.default", "never runs"),
    ("aten.bernoulli.default", "random"),
    ("aten.view.default", "aliased"),
    ("prims.add.default", "not an aten operator"),
    ("aten.__class__.default", "no such operator"),
    ("aten.add.__init__", "no such operator"),
    ("os.system.default", "not an aten operator"),
    ("aten.add", "not an aten operator"),
])
def test_replay_runs_only_operators_without_side_effects(op, why):
    from tdinspect.replay import ReplayRefused, safe_op

    with pytest.raises(ReplayRefused, match=why):
        safe_op(op, "f.json")
    assert safe_op("aten.gelu.default") is torch.ops.aten.gelu.default  # a fixed-choice string
    assert safe_op("aten.addmm.default") is torch.ops.aten.addmm.default


@pytest.mark.parametrize("leaf", [{"dtype": "load"}, {"layout": "save"}, {"device": 3},
                                  {"f": "__import__('os')"}, {"t": ["x"]}, {"a": 1, "b": 2},
                                  [1, 2], {"memory_format": "__class__"}])
def test_replay_arguments_are_plain_data(tmp_path, leaf):
    sidecar = _capture(tmp_path)

    def change(doc, e):
        i = e["key"].index("model/aten.mul.Tensor[out0]")
        e["call_args"][i]["leaves"][1] = leaf
    _edit(sidecar, change)
    with pytest.raises(DumpFormatError, match="pass0000"):
        tdinspect.replay(tmp_path, "model/aten.mul.Tensor")


def test_replay_argument_structure_names_no_other_type(tmp_path):
    sidecar = _capture(tmp_path)

    def change(doc, e):
        i = e["key"].index("model/aten.mul.Tensor[out0]")
        spec = json.loads(e["call_args"][i]["spec"])
        spec[1]["type"] = "collections.namedtuple"
        e["call_args"][i]["spec"] = json.dumps(spec)
    _edit(sidecar, change)
    with pytest.raises(DumpFormatError, match="pass00000.*malformed argument structure"):
        tdinspect.replay(tmp_path, "model/aten.mul.Tensor")
