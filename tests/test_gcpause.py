"""The collector paused while a pass is compared, and left as it was found, on any thread."""

from __future__ import annotations

import gc
import threading

import torch

from tdinspect import DumpSet
from tdinspect.compare import smallpairs
from tdinspect.util import gcpause

from .test_dumpset_diff import write_dump


def test_paused_while_any_thread_is_inside_and_back_on_when_the_last_leaves():
    assert gc.isenabled()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with gcpause.paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with gcpause.paused():
            second_in.set()
            first_out.wait(5)
            seen["after the first left"] = gc.isenabled()

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after the first left": False}
    assert gc.isenabled()


def test_a_collector_switched_off_by_the_caller_stays_off():
    gc.disable()
    try:
        with gcpause.paused():
            with gcpause.paused():
                pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_diff_compares_with_the_collector_paused_and_leaves_it_on(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    passes = [{f"m.l{i}": torch.randn(8, generator=g) for i in range(20)} for _ in range(3)]
    write_dump(tmp_path / "a", passes)
    write_dump(tmp_path / "b", [{k: v * 1.01 for k, v in p.items()} for p in passes])
    states = []
    real = smallpairs.compare_segments

    def spy(*args):
        states.append(gc.isenabled())
        return real(*args)

    monkeypatch.setattr(smallpairs, "compare_segments", spy)
    table = DumpSet.open(tmp_path / "a").diff(tmp_path / "b", passes_in_flight=3).table(progress=False)
    assert len(table) == 60 and (table["max_abs"] > 0).all()
    assert states == [False] * 3
    assert gc.isenabled()
