"""torch.compile meets capture: hooks stay out of dynamo's traces, and the model runs."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

import tdinspect
from tdinspect import DumpSet
from tdinspect.examples.models import make_model, make_tokens


def test_compiling_after_capture_started_runs_and_records_the_eager_entries(tmp_path):
    """Issue 13: compiling after capture() installed its hooks crashed the forward (dynamo
    traced into tensor_stats and hit its recompile limit)."""
    tokens = make_tokens()
    eager_model, model = make_model(seed=0), make_model(seed=0)
    with torch.no_grad(), tdinspect.capture(eager_model, tmp_path / "eager", environ={}) as dump:
        expected = eager_model(tokens)
        dump.step()
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad(), tdinspect.capture(model, tmp_path / "compiled", environ={}) as dump:
            compiled = torch.compile(model, backend="eager")  # dynamo only: fast, same numerics
            out = compiled(tokens)
            dump.step()
    torch._dynamo.reset()
    # dynamo never traced into the recorder (it did: its lock, tensor_stats, recompile limits);
    # the only graph breaks are the hooks it was told to skip
    traced_into = [
        why.splitlines()[0] for why in counters["unimplemented"] if "torch.compiler.disable" not in why
    ]
    assert not traced_into, traced_into
    assert torch.equal(out, expected)
    a, b = DumpSet.open(tmp_path / "eager"), DumpSet.open(tmp_path / "compiled")
    assert a.ops == b.ops and len(a.ops) > 10
    assert a.diff(b).first_divergence(metric="equal") is None


def _eager_and(tmp_path, prepare, **options):
    """Capture an eager run and a run of the same model after ``prepare(model)``."""
    tokens = make_tokens()
    runs = {}
    for name, fn in (("eager", lambda m: m), ("compiled", prepare)):
        model = fn(make_model(seed=0))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with (
                torch.no_grad(),
                tdinspect.capture(model, tmp_path / name, environ={}, **options) as dump,
            ):
                model(tokens)
                dump.step()
        runs[name] = (DumpSet.open(tmp_path / name), [str(w.message) for w in seen])
    torch._dynamo.reset()
    return runs


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_in_place_compile_is_detected_at_capture(tmp_path, mode):
    """Issue 13: m.compile() in place captured nothing, with only a warning at the end.
    compile="eager" runs it eagerly and says so; "graph" (issue 30) records in its graphs."""

    def compile_in_place(m):
        m.compile(backend="eager")
        return m

    runs = _eager_and(tmp_path, compile_in_place, compile=mode)
    (eager, _), (compiled, said) = runs["eager"], runs["compiled"]
    assert any("compile" in s and "eagerly" in s for s in said) == (mode == "eager"), said
    assert json.loads(next(compiled.path.glob("*/pass00000.json")).read_text())["compile"]["mode"] == mode
    assert compiled.ops == eager.ops and len(eager.ops) > 10
    assert eager.diff(compiled).first_divergence(metric="equal") is None


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_compiled_submodule_names_line_up_with_the_eager_run(tmp_path, mode):
    """Issue 13: a compiled submodule gave names with _orig_mod and 18 modules missing."""

    def compile_a_layer(m):
        m.layers[1] = torch.compile(m.layers[1], backend="eager")
        return m

    runs = _eager_and(tmp_path, compile_a_layer, compile=mode)
    (eager, _), (compiled, _) = runs["eager"], runs["compiled"]
    assert not [op for op in compiled.ops if "_orig_mod" in op]
    assert compiled.ops == eager.ops
    assert eager.diff(compiled).first_divergence(metric="equal") is None


_FRESH = """
import sys, tempfile, warnings
import torch, tdinspect
from tdinspect.examples.models import make_model, make_tokens
model, tokens, out = make_model(seed=0), make_tokens(), tempfile.mkdtemp()
with torch.no_grad(), tdinspect.capture(model, out + '/eager', environ={}) as dump:
    expected = model(tokens); dump.step()
print('dynamo after a plain capture:', 'torch._dynamo' in sys.modules)
with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    with torch.no_grad(), tdinspect.capture(model, out + '/compiled', environ={}) as dump:
        got = torch.compile(model, backend='eager')(tokens); dump.step()
from torch._dynamo.utils import counters
print('traced into:', sorted({why.splitlines()[0] for why in counters['unimplemented']
                              if 'torch.compiler.disable' not in why
                              and 'function `disable` in file' not in why}))
a, b = tdinspect.DumpSet.open(out + '/eager'), tdinspect.DumpSet.open(out + '/compiled')
print('same output, entries, values:', torch.equal(got, expected), a.ops == b.ops,
      len(a.ops) > 10 and a.diff(b).first_divergence(metric='equal') is None)
"""


def test_a_plain_capture_never_loads_dynamo_and_a_later_compile_still_runs_eagerly():
    """torch.compiler.disable imports dynamo (~1 s): the hooks are disabled only once dynamo is
    loaded. In a fresh process, a plain capture leaves it unloaded; compiling the model while
    a capture runs (dynamo loaded after the hooks were made) still keeps dynamo out of the
    recorder, and records the eager entries."""
    out = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.splitlines() == [
        "dynamo after a plain capture: False",
        "traced into: []",
        "same output, entries, values: True True True",
    ], out.stdout


def test_the_recompile_count_counts_recompiles_not_guard_failures(tmp_path):
    """A compiled model called at four batch sizes (static shapes) is compiled four times: three
    recompiles, one a pass. Dynamo records the failure of every cached graph at each recompile
    (1 + 2 + 3 = 6 failures): the capture counted those and warned of 2 and 3 recompiles at the
    third and fourth passes."""
    import torch._dynamo

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    compiled = torch.compile(model, backend="eager", dynamic=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad(), tdinspect.capture(compiled, tmp_path / "run") as dump:
            for n in (1, 2, 3, 4):
                compiled(torch.randn(n, 4))
                dump.step()
    assert dump.compile_counts["recompiles"] == 3 and dump.compile_counts["graphs"] == 4
    said = [str(w.message) for w in seen if "recompile(s)" in str(w.message)]
    assert len(said) == 3 and all("1 recompile(s)" in m for m in said), said
