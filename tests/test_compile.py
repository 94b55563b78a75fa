"""torch.compile meets capture: hooks stay out of dynamo's traces, and the model runs."""

from __future__ import annotations

import warnings

import torch

import tdinspect
from tdinspect import DumpSet
from tdinspect.examples import make_model, make_tokens


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
    traced_into = [why.splitlines()[0] for why in counters["unimplemented"]
                   if "torch.compiler.disable" not in why]
    assert not traced_into, traced_into
    assert torch.equal(out, expected)
    a, b = DumpSet.open(tmp_path / "eager"), DumpSet.open(tmp_path / "compiled")
    assert a.ops == b.ops and len(a.ops) > 10
    assert a.diff(b).first_divergence(metric="equal") is None
