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


# -- growth and nearest: a row without an error takes no part ------------------------------
@pytest.fixture(scope="module")
def up_proj_bug(tmp_path_factory):
    """A float32 reference and a bfloat16 run of the same tiny HF Llama with layer 1's up_proj
    weight x1.05; the run records no ``act_fn`` (as a port that fuses it): each act_fn is
    one-sided, right before its layer's up_proj."""
    root = tmp_path_factory.mktemp("growth")
    for name, dtype, scale, only in (
        ("a", torch.float32, 1.0, None),
        ("b", torch.bfloat16, 1.05, r"^(?!.*act_fn)"),
    ):
        model = make_hf_llama(seed=0).to(dtype)
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight.mul_(scale)
            with tdinspect.capture(model, root / name, filter=only) as cap:
                model(port_tokens())
                cap.step()
    return DumpSet.open(root / "a").diff(root / "b")


def test_growth_carries_the_running_maximum_over_one_sided_rows(up_proj_bug):
    """The one-sided act_fn's missing error became 0 in the running maximum: the up_proj after
    it had growth inf in both layers (layer 0's only inherits noise), tying with the real
    fault, and nearest said of layer 1's up_proj "the first error of its pass"."""
    g = up_proj_bug.growth(all_entries=True, progress=False).set_index("key")
    up0, up1 = "model.model.layers.0.mlp.up_proj", "model.model.layers.1.mlp.up_proj"
    gate0 = "model.model.layers.0.mlp.gate_proj"
    assert g.loc[up0, "prev_max"] >= g.loc[gate0, "error"] > 0  # the maximum before act_fn
    assert g.loc[up0, "growth"] < 2 and g.loc[up1, "growth"] > 20
    for layer in (0, 1):  # no error: no growth, never listed
        row = g.loc[f"model.model.layers.{layer}.mlp.act_fn"]
        assert row["growth"] != row["growth"] and row["added"] != row["added"]  # NaN
    adds = up_proj_bug.growth(progress=False)
    assert not adds["key"].str.endswith("act_fn").any()
    later = adds[adds["prev_max"] > 0].sort_values("growth", ascending=False)
    assert later["key"].iloc[0] == up1  # the entry that makes the error, alone at the top
    assert not (later["growth"] == float("inf")).any()
    near = up_proj_bug.nearest(progress=False)
    assert near["key"] == up1 and near["growth"] == pytest.approx(g.loc[up1, "growth"])
    assert "x the largest error before it" in near["text"]
