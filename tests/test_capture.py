"""Module-level capture on a real transformer: layout, names, calls, filters, safety."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

import tdinspect
from tdinspect import ConfigError, DumpConfig, load_pass
from tdinspect.examples.models import make_model, make_tokens
from tdinspect.numerics.stats import STAT_NAMES, tensor_stats

from .conftest import only_folder


def test_outputs_bitwise_identical_and_layout(tmp_path, model, tokens):
    ref = model(tokens)
    with tdinspect.capture(model, tmp_path / "d") as dump:
        out = model(tokens)
        dump.step()
        out2 = model(make_tokens(seed=5))
        dump.step()
    assert torch.equal(ref, out)
    assert torch.equal(model(make_tokens(seed=5)), out2)
    folder = only_folder(tmp_path / "d")
    assert re.fullmatch(rf"rank0_pid{os.getpid()}", folder.name)
    assert sorted(p.name for p in folder.iterdir()) == [
        "pass00000.json",
        "pass00000.pt",
        "pass00001.json",
        "pass00001.pt",
        "run.json",
    ]
    tensors = load_pass(folder / "pass00000.pt")
    keys = list(tensors)
    # execution order, dotted names rooted at "model", leaves only, no weights
    assert keys[:3] == ["model.embed", "model.layers.0.ln1", "model.layers.0.attn.q_proj"]
    assert "model.layers.0.attn" not in keys and "model.layers.0" not in keys
    assert keys[-2:] == ["model.norm", "model.lm_head"]
    assert torch.equal(tensors["model.lm_head"], ref)
    assert all(t.device.type == "cpu" and not t.requires_grad for t in tensors.values())
    # hooks are gone afterwards
    assert all(not m._forward_hooks for m in model.modules())


def test_repeated_calls_get_call_suffix(tmp_path, model, tokens):
    with tdinspect.capture(model, tmp_path, filter=r"expert") as dump:
        model(tokens)
        dump.step()
    tensors = load_pass(only_folder(tmp_path) / "pass00000.pt")
    assert list(tensors) == ["model.expert", "model.expert::call1", "model.expert::call2"]
    assert not torch.equal(tensors["model.expert"], tensors["model.expert::call1"])


def test_step_always_writes_and_exit_writes_pending(tmp_path, model, tokens):
    with tdinspect.capture(model, tmp_path, filter=r"lm_head") as dump:
        model(tokens)
        dump.step()
        with pytest.warns(RuntimeWarning, match="captured nothing"):
            dump.step()  # nothing ran: still writes pass00001 (pass numbers are step numbers)
        model(tokens)  # pending at exit: written as pass00002
    folder = only_folder(tmp_path)
    assert load_pass(folder / "pass00001.pt") == {}
    assert list(load_pass(folder / "pass00002.pt")) == ["model.lm_head"]


def test_sidecar_has_order_types_and_shared_stats(tmp_path, model, tokens):
    with tdinspect.capture(model, tmp_path, filter=[r"layers\.0\.", r"lm_head"]) as dump:
        model(tokens)
        dump.step()
    folder = only_folder(tmp_path)
    side = json.loads((folder / "pass00000.json").read_text())
    tensors = load_pass(folder / "pass00000.pt")
    e = side["entries"]
    assert e["key"] == list(tensors)
    i = e["key"].index("model.layers.0.attn.o_proj")
    assert e["module_type"][i] == "Linear"
    assert e["shape"][i] == list(tensors["model.layers.0.attn.o_proj"].shape)
    assert e["dtype"][i] == "torch.float32"
    expected = tensor_stats(tensors["model.layers.0.attn.o_proj"]).tolist()
    assert e["stats"][i] == pytest.approx(expected)
    assert len(e["stats"][i]) == len(STAT_NAMES)


def test_stats_only_writes_no_tensors(tmp_path, model, tokens):
    with tdinspect.capture(model, tmp_path / "s", stats_only=True) as dump:
        model(tokens)
        dump.step()
    with tdinspect.capture(model, tmp_path / "f") as dump:
        model(tokens)
        dump.step()
    folder = only_folder(tmp_path / "s")
    assert sorted(p.name for p in folder.iterdir()) == ["pass00000.json", "run.json"]
    s = json.loads((folder / "pass00000.json").read_text())
    f = json.loads((only_folder(tmp_path / "f") / "pass00000.json").read_text())
    assert s["stats_only"] is True and s["entries"]["key"] == f["entries"]["key"]
    np.testing.assert_allclose(s["entries"]["stats"], f["entries"]["stats"], rtol=1e-6)


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    aux: tuple


class ModelOutputLike(OrderedDict):
    pass


class Structured(nn.Module):
    def forward(self, x):
        return (x + 1, None, {"a": x * 2, "b": [x * 3]}, Out(x * 4, (x * 5, None)))


class HFStyle(nn.Module):
    def forward(self, x):
        return ModelOutputLike(logits=x - 1, past=(x - 2,))


def test_structured_outputs_get_parseable_sub_names(tmp_path):
    model = nn.Sequential(Structured())
    x = torch.arange(4.0)
    with tdinspect.capture(model, tmp_path) as dump:
        model(x)
        dump.step()
    t = load_pass(only_folder(tmp_path) / "pass00000.pt")
    assert list(t) == [
        "model.0[0]",
        "model.0[2][a]",
        "model.0[2][b][0]",
        "model.0[3][hidden]",
        "model.0[3][aux][0]",
    ]
    assert torch.equal(t["model.0[3][aux][0]"], x * 5)
    parts = tdinspect.parse_key("model.0[2][b][0]")
    assert parts.module == "model.0" and parts.labels == ("2", "b", "0")


def test_hf_style_mapping_output(tmp_path):
    model = nn.Sequential(HFStyle())
    with tdinspect.capture(model, tmp_path) as dump:
        model(torch.ones(2))
        dump.step()
    assert list(load_pass(only_folder(tmp_path) / "pass00000.pt")) == ["model.0[logits]", "model.0[past][0]"]


def test_views_are_saved_compactly(tmp_path):
    class Slice(nn.Module):
        def forward(self, x):
            return x[:, :2]

    big = torch.randn(1000, 1000)
    model = nn.Sequential(Slice())
    with tdinspect.capture(model, tmp_path) as dump:
        model(big)
        dump.step()
    path = only_folder(tmp_path) / "pass00000.pt"
    assert path.stat().st_size < 100_000  # not the 4 MB storage the view lives in
    assert torch.equal(load_pass(path)["model.0"], big[:, :2])


def test_inplace_mutation_after_hook_does_not_change_dump(tmp_path):
    class Relu(nn.Module):
        def forward(self, x):
            return x * 1

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Relu()

        def forward(self, x):
            y = self.a(x)
            y.mul_(100)  # the model changes the output in place after the hook ran
            return y

    x = torch.ones(3)
    net = Net()
    with tdinspect.capture(net, tmp_path / "2") as dump:
        net(x)
        dump.step()
    assert torch.equal(load_pass(only_folder(tmp_path / "2") / "pass00000.pt")["model.a"], x)


def test_root_and_modules_all(tmp_path, model, tokens):
    with tdinspect.capture(
        model, tmp_path, root="net", modules="all", filter=r"^net(\.layers\.0(\.attn)?)?$"
    ) as dump:
        model(tokens)
        dump.step()
    assert list(load_pass(only_folder(tmp_path) / "pass00000.pt")) == [
        "net.layers.0.attn",
        "net.layers.0",
        "net",
    ]


def test_off_by_default_registers_nothing(model, tokens, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dump = tdinspect.capture(model)
    assert not dump.enabled
    assert all(not m._forward_hooks for m in model.modules())
    model(tokens)
    assert dump.step() is None
    dump.close()
    assert list(tmp_path.iterdir()) == []


def test_filters_regex_list_callable_and_file(tmp_path, model, tokens):
    def keep(name, module):
        return name.endswith("o_proj") and isinstance(module, nn.Linear)

    predicate_file = tmp_path / "myfilter.py"
    predicate_file.write_text("def keep(name, module):\n    return name.endswith('.up')\n")
    cases = {
        "regex": dict(filter=r"layers\.1\.mlp\.down$"),
        "list": dict(filter=[r"layers\.0\.ln1$", r"lm_head"]),
        "callable": dict(filter=keep),
        "file": dict(filter_fn=f"{predicate_file}:keep"),
        "module": dict(filter_fn="tests.predicates:only_norms"),
    }
    expected = {
        "regex": ["model.layers.1.mlp.down"],
        "list": ["model.layers.0.ln1", "model.lm_head"],
        "callable": [f"model.layers.{i}.attn.o_proj" for i in range(4)],
        "file": [f"model.layers.{i}.mlp.up" for i in range(4)],
        "module": ["model.norm"],
    }
    for name, kwargs in cases.items():
        with tdinspect.capture(model, tmp_path / name, **kwargs) as dump:
            model(tokens)
            dump.step()
        assert list(load_pass(only_folder(tmp_path / name) / "pass00000.pt")) == expected[name], name


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(filter="layers.(0"), "invalid filter regex"),
        (dict(filter=r"no_such_module"), "selects no module"),
        (dict(filter_fn="/no/such/file.py:keep"), "no such file"),
        (dict(filter_fn="tests.predicates:missing"), "no callable 'missing'"),
        (dict(filter_fn="no_such_pkg_xyz.mod:keep"), "importing"),
        (dict(filter=r"x", filter_fn="tests.predicates:only_norms"), "exclusive"),
        (dict(filter=[]), "empty list"),
    ],
)
def test_bad_filters_fail_at_capture_time(tmp_path, model, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        tdinspect.capture(model, tmp_path, **kwargs)
    assert not any(m._forward_hooks for m in model.modules())


def test_environment_switches_dump_on_and_overlays_config(tmp_path, model, tokens, monkeypatch):
    monkeypatch.setenv("PHYAI_DEBUG_TENSOR_DUMP_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("PHYAI_DEBUG_TENSOR_DUMP_FILTER", '["layers\\\\.0\\\\.ln1$", "lm_head"]')
    cfg = DumpConfig(dump_dir=tmp_path / "code", filter=r"expert")
    with tdinspect.capture(model, config=cfg) as dump:  # code said "code" + expert; env wins
        model(tokens)
        dump.step()
    assert not (tmp_path / "code").exists()
    assert list(load_pass(only_folder(tmp_path / "env") / "pass00000.pt")) == [
        "model.layers.0.ln1",
        "model.lm_head",
    ]


def test_environment_bare_pattern_and_own_family(tmp_path, model, tokens, monkeypatch):
    monkeypatch.setenv("TDINSPECT_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("TDINSPECT_DUMP_FILTER", r"mlp\.down$")
    with tdinspect.capture(model) as dump:
        model(tokens)
        dump.step()
    assert len(load_pass(only_folder(tmp_path) / "pass00000.pt")) == 4


def test_environment_filter_fn_and_conflicts(tmp_path, monkeypatch):
    env = {"TDINSPECT_DUMP_DIR": str(tmp_path), "TDINSPECT_DUMP_FILTER_FN": "tests.predicates:only_norms"}
    assert DumpConfig(filter=r"x").with_env(env).filter_fn == "tests.predicates:only_norms"
    with pytest.raises(ConfigError, match="exclusive"):
        DumpConfig().with_env(
            {"PHYAI_DEBUG_TENSOR_DUMP_FILTER": "a", "PHYAI_DEBUG_TENSOR_DUMP_FILTER_FN": "m:f"}
        )
    with pytest.raises(ConfigError, match="exclusive"):
        DumpConfig().with_env({"TDINSPECT_DUMP_FILTER": "a", "PHYAI_DEBUG_TENSOR_DUMP_FILTER_FN": "m:f"})
    with pytest.raises(ConfigError, match="disagree"):
        DumpConfig().with_env({"TDINSPECT_DUMP_DIR": "/a", "PHYAI_DEBUG_TENSOR_DUMP_DIR": "/b"})
    assert (
        DumpConfig().with_env({"TDINSPECT_DUMP_DIR": "/a", "PHYAI_DEBUG_TENSOR_DUMP_DIR": "/a"}).dump_dir
        == "/a"
    )
    with pytest.raises(ConfigError, match="JSON"):
        DumpConfig().with_env({"TDINSPECT_DUMP_FILTER": "[not json"})


def test_use_cuda_graph_forced_off_with_warning():
    assert DumpConfig().use_cuda_graph(True) is True
    with pytest.warns(UserWarning, match="use_cuda_graph=False"):
        assert DumpConfig(dump_dir="/tmp/x").use_cuda_graph(True) is False


def test_step_with_no_hook_fired_warns(tmp_path, model, tokens):
    with pytest.warns(RuntimeWarning) as record:
        with tdinspect.capture(model, tmp_path, filter=r"lm_head|expert") as dump:
            model.forward(tokens)  # hooks fire: forward() calls submodules through __call__
            dump.step()
            model.lm_head.forward(torch.randn(1, 64))  # bypasses the hook
            dump.step()
    messages = [str(w.message) for w in record]
    assert any("captured nothing" in m and "forward()" in m for m in messages)


def test_unfired_modules_reported(tmp_path):
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    model = nn.Sequential(mha)
    x = torch.randn(1, 3, 8)
    with pytest.warns(RuntimeWarning, match="never ran"):
        with tdinspect.capture(model, tmp_path) as dump:
            model[0](x, x, x)
            dump.step()
            assert dump.unfired == ["model.0.out_proj"]
    with tdinspect.capture(model, tmp_path / "all", modules="all", warn_unfired=False) as dump:
        model[0](x, x, x)
        dump.step()
    assert "model.0[0]" in load_pass(only_folder(tmp_path / "all") / "pass00000.pt")


def test_compiled_model_runs_eagerly_with_warning(tmp_path, tokens):
    model = make_model(seed=0)
    ref = model(tokens)
    compiled = torch.compile(model)
    with pytest.warns(UserWarning, match="compile"):
        with tdinspect.capture(compiled, tmp_path, filter=r"lm_head", compile="eager") as dump:
            out = compiled(tokens)
            dump.step()
    assert torch.equal(out, ref)
    t = load_pass(only_folder(tmp_path) / "pass00000.pt")
    assert list(t) == ["model.lm_head"] and torch.equal(t["model.lm_head"], ref)


def test_exception_in_model_removes_hooks_keeps_passes(tmp_path, model, tokens):
    with pytest.raises(RuntimeError, match="boom"):
        with tdinspect.capture(model, tmp_path) as dump:
            model(tokens)
            dump.step()
            raise RuntimeError("boom")
    assert all(not m._forward_hooks for m in model.modules())
    assert len(load_pass(only_folder(tmp_path) / "pass00000.pt")) == 42


def test_rank_from_environment(tmp_path, model, tokens, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with tdinspect.capture(model, tmp_path, filter="lm_head") as dump:
        model(tokens)
        dump.step()
    assert only_folder(tmp_path).name == f"rank3_pid{os.getpid()}"


@pytest.mark.parametrize("cap", [1, 1 << 40])
def test_writer_backpressure_bounded_queue(tmp_path, model, tokens, monkeypatch, cap):
    """A slow disk: with a byte cap below one pass, step() waits until at most one pass is queued;
    without one (a huge cap), passes pile up. Either way every pass is written."""
    import threading

    from tdinspect.dumper.writer import PendingPass

    slow_write = PendingPass.write
    disk_free = threading.Event()  # without a cap the disk stays busy until every step is in:
    # a timed sleep let a loaded machine drain the queue between steps (flaky)

    def write(self, fsync):
        if cap == 1:
            time.sleep(0.2)
        else:
            disk_free.wait(30)
        slow_write(self, fsync)

    monkeypatch.setattr(PendingPass, "write", write)
    queued = []
    with tdinspect.capture(model, tmp_path, max_pending_bytes=cap, background_write=True) as dump:
        for _ in range(3):
            model(tokens)
            dump.step()
            queued.append(dump.recorder.writer._items)
        disk_free.set()
    assert len(list(only_folder(tmp_path).glob("*.pt"))) == 3
    assert max(queued) == 1 if cap == 1 else max(queued) > 1


def test_import_is_light():
    import subprocess
    import sys

    code = (
        "import sys, tdinspect; tdinspect.capture; tdinspect.capture_ops; "
        "print([m for m in ('xarray','pandas','matplotlib','IPython','dask','numba','tdinspect.numerics.kernels') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_warnings_not_raised_for_normal_capture(tmp_path, model, tokens):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tdinspect.capture(model, tmp_path) as dump:
            model(tokens)
            dump.step()


def test_background_and_inline_writers_write_the_same_bytes(tmp_path, model, tokens):
    for mode in (True, False):
        with tdinspect.capture(model, tmp_path / str(mode), background_write=mode) as dump:
            assert dump.recorder.writer.threaded is mode
            for s in range(2):
                model(make_tokens(seed=s))
                dump.step()
    a, b = only_folder(tmp_path / "True"), only_folder(tmp_path / "False")
    for name in ("pass00000.pt", "pass00001.pt", "pass00000.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
