"""One verdict: diverges, matches or incomplete, never a "no divergence" that is not true.

A comparison that set entries aside or never compared them says so in every surface
(``Diff.verdict()``, the summary, the CLI's exit status 3, live capture), and a
structural mode never hides a divergence that was measured (an op run with other
arguments).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import tdinspect  # noqa: E402
from tdinspect import DumpSet  # noqa: E402
from tdinspect.examples.port import make_hf_llama, port_tokens  # noqa: E402

EPS_KEY = "model.model.layers.0.input_layernorm/aten.add.Tensor[out0]"


@pytest.fixture(scope="module")
def eps_runs(tmp_path_factory):
    """Op-level dumps (inputs recorded) of the HF Llama's first norm, RMSNorm eps 1e-6 and 1e-5."""
    root = tmp_path_factory.mktemp("eps")
    for name, eps in (("a", 1e-6), ("b", 1e-5)):
        model = make_hf_llama(seed=0, rms_norm_eps=eps, num_hidden_layers=1)
        with (
            torch.no_grad(),
            tdinspect.capture_ops(
                root / name, model=model, inputs=True, filter=r"layers\.0\.input_layernorm"
            ) as dump,
        ):
            model(port_tokens(length=6, batch=1))
            dump.step()
    return root


@pytest.mark.parametrize("structural", ["diverge", "report"])
def test_an_argument_difference_diverges_in_both_structural_modes(eps_runs, structural):
    """structural="report" set an op run with another eps aside, as if it were one-sided: the
    answer was None, with no warning (the whole comparison "matched"). It is a divergence in
    both modes, named by its argument."""
    d = DumpSet.open(eps_runs / "a").diff(eps_runs / "b")
    div = d.first_divergence(structural=structural)
    assert div is not None and div.key == EPS_KEY
    assert div.reason == "argument 'other' of aten.add.Tensor: 1e-06 vs 1e-05"
    assert EPS_KEY not in set(d.structural_entries(progress=False)["key"])


def test_live_comparison_with_report_names_an_argument_difference(eps_runs, tmp_path):
    """Live comparison set it aside too (cap.live.set_aside) and went on in silence."""
    model = make_hf_llama(seed=0, rms_norm_eps=1e-5, num_hidden_layers=1)
    with (
        pytest.raises(tdinspect.DivergenceError) as info,
        torch.no_grad(),
        tdinspect.capture_ops(
            model=model,
            inputs=True,
            filter=r"layers\.0\.input_layernorm",
            compare_to=eps_runs / "a",
            structural="report",
        ) as cap,
    ):
        model(port_tokens(length=6, batch=1))
        cap.step()
    assert info.value.divergence.key == EPS_KEY
