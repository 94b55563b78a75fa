"""Scale-only dtypes (MX block scales) do not set the upstream precision of the data."""

from __future__ import annotations

import torch

from tdinspect import DumpSet


def _dump(folder, x):
    folder.mkdir(parents=True)
    scale = torch.tensor([1.0, 2.0, 4.0, 0.5]).to(torch.float8_e8m0fnu)  # identical on both sides
    torch.save({"model.scale": scale, "model.proj": x}, folder / "pass00000.pt")


def test_an_identical_e8m0_scale_early_in_a_pass_does_not_hide_a_30_percent_error(tmp_path):
    """One float8_e8m0fnu scale tensor before the data raised every later auto threshold to
    e8m0's (unit roundoff 0.5): a 30% relative-L2 error in float32 was 'no divergence'."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    _dump(tmp_path / "a", x)
    _dump(tmp_path / "b", x * 1.3)
    div = DumpSet.open(tmp_path / "a").diff(tmp_path / "b").first_divergence()
    assert div is not None and div.key == "model.proj" and "float32" in div.reason
    # the scale entry itself still meets its own (e8m0) rule
    table = DumpSet.open(tmp_path / "a").diff(tmp_path / "b").table(progress=False)
    assert table.set_index("op").loc["model.scale", "rel_diff"] == 0.0
