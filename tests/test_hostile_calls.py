"""A call number in a key is a file's text, of any size: cubes hold the calls present, not
every number up to the largest. A 5-entry dump with one key ``m.l0::call3000000`` made
``to_xarray()`` 1.2 GB and the diff's cube 2.6 GB (peak RSS; 9 digits more, past any memory)."""

from __future__ import annotations

import numpy as np
import torch

from tdinspect import DumpSet

from .recorded import record_dump

FAR = 10**5


def test_cubes_hold_the_calls_present_whatever_their_numbers(tmp_path):
    passes = [
        {"m.l0": torch.ones(2, 3), "m.l1": torch.ones(2, 3), f"m.l0::call{FAR}": torch.full((2, 3), 2.0)}
    ]
    record_dump(tmp_path / "a", passes)
    record_dump(tmp_path / "b", [{**passes[0], f"m.l0::call{FAR}": torch.full((2, 3), 3.0)}])
    cube = DumpSet.open(tmp_path / "a").to_xarray()
    assert cube["call"].values.tolist() == [0, FAR]
    assert cube["max"].sel(op="m.l0", call=FAR).values.tolist() == [2.0]  # one pass
    assert np.isnan(cube["max"].sel(op="m.l1", call=FAR).values).all()
    d = DumpSet.open(tmp_path / "a").diff(tmp_path / "b")
    metrics = d.to_xarray()
    assert metrics["call"].values.tolist() == [0, FAR]
    assert metrics["rel_diff"].sel(op="m.l0", call=0).values.tolist() == [0]
    assert metrics["rel_diff"].sel(op="m.l0", call=FAR).values.item() > 0.05
    positions = d.per_position("m.l0", dim=1)
    assert positions["call"].values.tolist() == [0, FAR]
    assert (positions.sel(call=0).values == 0).all() and (positions.sel(call=FAR).values > 0.05).all()
