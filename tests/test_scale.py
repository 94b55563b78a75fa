"""Scale: several ranks written by several processes, dask (threads and a LocalCluster), ranks view."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

from tdinspect import DumpSet

from .conftest import ROOT

CAPTURE_RANK = textwrap.dedent("""
    import sys, torch, tdinspect
    from tdinspect.examples.models import make_model, make_tokens
    out, perturb = sys.argv[1], sys.argv[2] == "1"
    model = make_model(seed=0)
    if perturb:
        with torch.no_grad():
            model.layers[1].attn.o_proj.weight.mul_(1.3)
    with torch.no_grad(), tdinspect.capture(model, out) as dump:
        for step in range(3):
            model(make_tokens(seed=step))
            dump.step()
""")


def capture_ranks(out, perturb_rank=None, ranks=(0, 1)):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CAPTURE_RANK, str(out), "1" if r == perturb_rank else "0"],
            env={**os.environ, "RANK": str(r)},
            cwd=ROOT,
        )
        for r in ranks
    ]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    return out


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranked")
    return {
        "a": capture_ranks(root / "a"),
        "b": capture_ranks(root / "b", perturb_rank=1),
        "one": capture_ranks(root / "one", ranks=(0,)),
    }


def test_processes_per_rank_open_and_diff(ranked):
    a = DumpSet.open(ranked["a"])
    assert a.ranks == [0, 1] and a.passes == [0, 1, 2]
    assert len({p.parent.name for p in ranked["a"].rglob("pass*.pt")}) == 2  # one folder per process
    cube = a.to_xarray(progress=False)
    assert cube.sizes["rank"] == 2
    div = a.diff(ranked["b"]).first_divergence()
    assert (div.rank, div.pass_, div.op) == (1, 0, "model.layers.1.attn.o_proj")
    by = a.diff(ranked["b"]).by_rank_pass()
    assert by.loc[(1, 0), "first"] == "model.layers.1.attn.o_proj"
    assert by.loc[(0, 0), "first"] == "" and by.loc[(0, 0), "n_divergent"] == 0
    assert by.loc[(1, 2), "n_divergent"] > 0
    import matplotlib

    matplotlib.use("Agg")
    import tdinspect

    fig = tdinspect.plot.rank_pass(a.diff(ranked["b"]))
    assert fig.axes[0].get_title() == "first: rank 1, pass 0: model.layers.1.attn.o_proj"


def test_rank_in_one_run_only_is_structural(ranked):
    div = DumpSet.open(ranked["a"]).diff(ranked["one"]).first_divergence()
    assert div.structural and div.reason == "rank 1 only in A"


def _metrics(diff):
    t = diff.table(progress=False).sort_values(["rank", "pass", "order"]).reset_index(drop=True)
    return t


def test_local_cluster_gives_identical_results(ranked):
    distributed = pytest.importorskip("distributed")
    plain = DumpSet.open(ranked["a"]).diff(ranked["b"])
    expected = _metrics(plain)
    expected_div = plain.first_divergence()
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        a = DumpSet.open(ranked["a"], client=client)
        diff = a.diff(ranked["b"])
        assert diff.client is client
        got = _metrics(diff)
        div = diff.first_divergence()
        stats = a.to_xarray(progress=False)
    pd.testing.assert_frame_equal(got, expected)
    assert (div.key, div.rank, div.pass_, div.value) == (
        expected_div.key,
        expected_div.rank,
        expected_div.pass_,
        expected_div.value,
    )
    np.testing.assert_array_equal(
        stats["max"].values, DumpSet.open(ranked["a"]).to_xarray(progress=False)["max"].values
    )


def test_sync_and_threaded_schedulers_agree():
    from tdinspect.util import parallel

    items = list(range(7))
    assert (
        list(parallel.map_in_waves(lambda x: x * 3, items, scheduler="sync"))
        == list(parallel.map_in_waves(lambda x: x * 3, items, wave=3))
        == [x * 3 for x in items]
    )
