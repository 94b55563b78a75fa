"""The local pool of ``map_in_waves`` and the frames of a diff: order, waves, failures, threads,
fork, and the exact table pandas made of the rows before."""

from __future__ import annotations

import multiprocessing
import re
import threading
import traceback
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tdinspect.compare.diff as diff_module
from tdinspect import DumpSet
from tdinspect.compare import passframes
from tdinspect.compare.passes import compare_pass
from tdinspect.compare.passframes import frame_of, typed_columns
from tdinspect.compare.rule import COLUMNS, ROW_METRICS
from tdinspect.compare.thresholds import upstream_of
from tdinspect.numerics.slices import SLICE_COLUMNS
from tdinspect.util import parallel

from .test_dumpset_diff import write_dump


# -- map_in_waves on the local pool -----------------------------------------------------------
def test_results_come_in_input_order_when_a_later_job_ends_first():
    second_done = threading.Event()

    def job(x):
        if x == 0:
            second_done.wait(timeout=10)  # the first ends after the second (with 2+ threads)
        if x == 1:
            second_done.set()
        return x * 10

    assert list(parallel.map_in_waves(job, range(6), wave=2)) == [0, 10, 20, 30, 40, 50]


def test_a_consumer_that_stops_never_starts_the_next_wave():
    started, lock = [], threading.Lock()

    def job(x):
        with lock:
            started.append(x)
        return x

    results = parallel.map_in_waves(job, range(9), wave=3)
    assert [next(results), next(results)] == [0, 1]
    results.close()
    assert set(started) <= {0, 1, 2}  # the second wave was never submitted


def test_a_failing_job_raises_its_own_error_and_leaves_the_pool_working():
    def job(x):
        if x == 3:
            raise ValueError(f"item {x} is bad")
        return x

    with pytest.raises(ValueError, match="item 3 is bad") as info:
        list(parallel.map_in_waves(job, range(8), wave=4))
    assert "job" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    for _ in range(3):  # every thread free again
        assert list(parallel.map_in_waves(lambda x: x + 1, range(8), wave=4)) == list(range(1, 9))


def test_the_local_pool_is_one_pool_sized_by_the_cpus():
    list(parallel.map_in_waves(abs, range(4)))
    pool = parallel._pool()
    list(parallel.map_in_waves(abs, range(4)))
    assert parallel._pool() is pool and pool._max_workers == parallel.local_threads() >= 1
    assert parallel.default_wave() == max(2, 2 * parallel.local_threads())


def test_maps_from_other_threads_and_from_inside_a_job():
    """A job that maps in waves itself runs its items in its own thread: on the pool, jobs
    waiting on the jobs they queued behind them could wait forever."""
    threads = parallel.local_threads()

    def inner(x):
        return sum(parallel.map_in_waves(lambda y: x * y, range(4), wave=2))

    got = {}

    def caller(name):
        got[name] = list(parallel.map_in_waves(inner, range(2 * threads + 1)))

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in callers)
    assert got == {i: [6 * x for x in range(2 * threads + 1)] for i in range(3)}


def _map_in_child(queue):
    queue.put(list(parallel.map_in_waves(lambda x: -x, range(5), wave=5)))


def test_a_forked_child_maps_on_a_pool_of_its_own():
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork here")
    list(parallel.map_in_waves(abs, range(4)))  # the parent's pool exists, its threads idle
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        child = ctx.Process(target=_map_in_child, args=(queue,))
        child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0 and queue.get(timeout=5) == [0, -1, -2, -3, -4]


def test_an_unknown_scheduler_is_refused():
    with pytest.raises(ValueError, match="processes"):
        list(parallel.map_in_waves(abs, [1, 2], scheduler="processes"))


# -- the frames of a diff ---------------------------------------------------------------------
def _rows_frame(rows):
    """What a pass's frame was made of before (``pd.DataFrame`` of the rows, then upstream)."""
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["upstream"] = upstream_of(frame["dtype_a"], frame["dtype_b"])
    return frame


def _assert_same(got, expected):
    pd.testing.assert_frame_equal(
        got, expected, check_exact=True, check_index_type=True, check_column_type=True
    )


@pytest.mark.parametrize("other,max_rows", [("wrong", None), ("bf16", None), ("wrong", 3)])
def test_table_and_pass_frames_are_the_frames_pandas_makes_of_the_rows(runs, other, max_rows, monkeypatch):
    if max_rows is not None:  # passes over MAX_ROWS rows: pandas' frames, then their concat
        monkeypatch.setattr(passframes, "MAX_ROWS", max_rows)
    d = DumpSet.open(runs["ref"]).diff(runs[other])
    table = d.table(progress=False)
    held = [type(v) for v in d._results._data.values()]  # the road each pass took
    assert held == [pd.DataFrame if max_rows else dict] * 3
    text = pd.Series(["x"]).dtype  # pandas' string dtype (object before pandas 3)
    expected = {
        "rank": "int64",
        "pass": "int64",
        "op": text,
        "call": "int64",
        "order": "float64",
        "key": text,
        "key_b": text,
        "dtype_a": text,
        "dtype_b": text,
        "shape": text,
        "structural": "bool",
        "reason": text,
        **{m: "float64" for m in ROW_METRICS},
        **{c: "float64" for c in SLICE_COLUMNS},
        "upstream": text,
    }
    assert list(table.columns) == list(expected)
    assert table.dtypes.to_dict() == {
        k: np.dtype(v) if isinstance(v, str) else v for k, v in expected.items()
    }
    passes = [_rows_frame(compare_pass(job)) for job in d._jobs()]
    _assert_same(table, pd.concat(passes, ignore_index=True))
    for job, frame in zip(d._jobs(), passes):
        _assert_same(d._results[job.rank, job.pass_], frame)
    assert d.passes_read == [(0, p) for p in range(3)]


def test_a_table_after_first_divergence_and_with_stats_rel_is_the_same_table(runs):
    a = DumpSet.open(runs["ref"])
    fresh = a.diff(runs["wrong"]).table(progress=False)
    d = a.diff(runs["wrong"])
    assert d.first_divergence().pass_ == 0 and d.passes_read == [(0, 0)]
    _assert_same(d.table(progress=False), fresh)  # pass 0 a frame, passes 1 and 2 columns
    d.first_divergence(metric="stats_rel")
    with_stats = d.table(progress=False)
    compared = ~fresh["structural"] & (fresh["reason"] == "")
    assert with_stats.loc[compared, "stats_rel"].notna().all()
    _assert_same(with_stats.drop(columns="stats_rel"), fresh.drop(columns="stats_rel"))


def test_an_empty_pass_and_no_rows_at_all(tmp_path):
    x = torch.ones(4)
    a = write_dump(tmp_path / "a", [{"model.a": x}, {}, {"model.a": x}])
    b = write_dump(tmp_path / "b", [{"model.a": x + 1}, {}, {"model.a": x}])
    d = DumpSet.open(a).diff(b)
    table = d.table(progress=False)
    assert table["pass"].tolist() == [0, 2] and table.index.equals(pd.RangeIndex(2))
    _assert_same(d._results[0, 1], _rows_frame([]))
    with pytest.raises(KeyError, match="'nothing matches' matches no entry"):
        DumpSet.open(a).filter("nothing matches")
    full = DumpSet.open(a)  # an empty selection made by hand: a diff of no rows at all
    empty = DumpSet(full.path, dict(full.pass_map), op_pattern=re.compile("nothing matches"))
    _assert_same(empty.diff(b).table(progress=False), pd.DataFrame(columns=COLUMNS))


def test_early_exit_compares_only_the_first_waves_passes(tmp_path, monkeypatch):
    passes = [{"model.a": torch.full((8,), float(i))} for i in range(6)]
    other = [dict(p) for p in passes]
    other[2] = {"model.a": torch.full((8,), 30.0)}
    compared, lock = [], threading.Lock()

    def recording(job):
        with lock:
            compared.append(job.pass_)
        return compare_pass(job)

    monkeypatch.setattr(diff_module, "compare_pass", recording)
    a = DumpSet.open(write_dump(tmp_path / "a", passes))
    d = a.diff(write_dump(tmp_path / "b", other), passes_in_flight=4)
    assert d.first_divergence().pass_ == 2
    assert sorted(compared) == [0, 1, 2]  # waves of 1 then 2 passes: 3 to 5 never started


_VALUES = st.one_of(
    st.floats(allow_nan=True),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.text(max_size=3),
    st.floats(width=32).map(np.float64),
    st.integers(-9, 9).map(np.int64),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_VALUES, _VALUES), max_size=5))
def test_typed_columns_are_what_pandas_infers_or_nothing(pairs):
    rows = [{"x": x, "y": y} for x, y in pairs]
    columns = typed_columns(rows, ["x", "y"])
    if columns is not None:
        _assert_same(frame_of(columns), pd.DataFrame(rows, columns=["x", "y"]))
    kinds = [{type(r[c]) for r in rows} for c in "xy"]
    if rows and all(len(k) == 1 and k <= {float, bool, str} for k in kinds):
        assert columns is not None  # the usual rows take the typed road
