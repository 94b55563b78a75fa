"""The pool's threads held on CPUs of their own while they compare plain pairs
(:mod:`tdinspect.placement`): one CPU each, never two on one, affinity given back, torch's
ops left free, the same numbers held or not."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest
import torch

import tdinspect.diff as diff_module
from tdinspect import DumpSet, parallel, placement
from tdinspect.dumper.recorder import Recorder

CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def _may_set_affinity() -> bool:
    """Whether this sandbox lets a thread set its own affinity (a fresh thread tries)."""
    out = []

    def attempt():
        try:
            os.sched_setaffinity(0, os.sched_getaffinity(0))
            out.append(True)
        except OSError:
            out.append(False)

    t = threading.Thread(target=attempt)
    t.start()
    t.join()
    return out[0]


holds = pytest.mark.skipif(placement._GETCPU is None or len(CPUS) < 2 or not _may_set_affinity(),
                           reason="needs Linux's sched_getcpu, two CPUs and leave to set a "
                                  "thread's affinity")
REAL_JUDGE = placement._judge


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch):
    """Every test starts holding, and (but those of the backoff) a loaded machine never
    makes it stop: what it checks is where threads are held, not when."""
    monkeypatch.setattr(placement, "_BACKOFF", {})
    monkeypatch.setattr(placement, "_judge", lambda cpu, waited_ns, took_ns: None)


def _in_thread(fn):
    """``fn()`` in a fresh thread (the test's own affinity is never touched); its result."""
    out = {}

    def run():
        out["value"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["value"]


@holds
def test_a_holder_runs_on_one_cpu_and_gets_its_affinity_back():
    def body():
        before = os.sched_getaffinity(0)
        with placement.held_apart():
            inside, cpu = os.sched_getaffinity(0), placement._GETCPU()
        return before, inside, cpu, os.sched_getaffinity(0)

    before, inside, cpu, after = _in_thread(body)
    assert inside == {cpu} and cpu in before
    assert after == before
    assert not placement._HELD


@holds
def test_holders_at_once_are_on_distinct_cpus_and_one_more_is_left_free():
    n = len(CPUS)
    all_in, release = threading.Barrier(n + 1), threading.Event()
    seen, lock = [], threading.Lock()

    def holder():
        with placement.held_apart():
            with lock:
                seen.append((os.sched_getaffinity(0), placement._GETCPU()))
            all_in.wait(timeout=30)
            release.wait(timeout=30)

    threads = [threading.Thread(target=holder) for _ in range(n)]
    for t in threads:
        t.start()
    all_in.wait(timeout=30)
    try:
        masks = [m for m, _ in seen]
        assert all(len(m) == 1 for m in masks)
        assert set().union(*masks) == CPUS  # one CPU each, every one taken
        assert all(m == {cpu} for m, cpu in seen)

        def one_too_many():
            with placement.held_apart():
                return os.sched_getaffinity(0)
        assert _in_thread(one_too_many) == CPUS  # no CPU free: not held
    finally:
        release.set()
        for t in threads:
            t.join()
    assert not placement._HELD


def test_where_nothing_can_be_held_the_body_runs_as_it_is(monkeypatch):
    monkeypatch.setattr(placement, "_GETCPU", None)

    def body():
        before = os.sched_getaffinity(0) if CPUS else None
        with placement.held_apart():
            inside = os.sched_getaffinity(0) if CPUS else None
        return before, inside

    before, inside = _in_thread(body)
    assert inside == before


def test_an_error_in_the_body_gives_the_affinity_back():
    def body():
        before = os.sched_getaffinity(0) if CPUS else None
        with pytest.raises(KeyError):
            with placement.held_apart():
                raise KeyError("the body failed")
        return before, os.sched_getaffinity(0) if CPUS else None

    before, after = _in_thread(body)
    assert after == before and not placement._HELD


def _runs(root, noise):
    """Two runs of 4 passes: a 1 MB float32 and a 8 KB bfloat16 plain pair (held: the
    compiled loop and the small pairs' batch, diff.HOLD_MIN_BYTES a side), and a pair stored
    as float32 on one side and float16 on the other (compared by torch, free)."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=g) for n in (1 << 18, 4096, 4096)]
    for name, scale in (("a", 0.0), ("b", noise)):
        rec = Recorder(root / name, level="module")
        jitter = torch.Generator().manual_seed(1)
        for p in range(4):
            for i, (key, dtype) in enumerate((("m.fc", torch.float32), ("m.act", torch.bfloat16),
                                              ("m.out", torch.float32))):
                t = base[i] * (1 + p) + scale * torch.randn(base[i].shape, generator=jitter)
                if key == "m.out" and name == "b":
                    dtype = torch.float16
                rec.record(key, t.to(dtype), module_type="Linear")
            rec.step()
        rec.close()
    return DumpSet.open(root / "a"), DumpSet.open(root / "b")


def _affinities_seen(monkeypatch) -> dict[str, list]:
    """The pool threads' affinities as they enter ``compare_plain`` and ``compare_pair``."""
    masks: dict[str, list] = {"plain": [], "pair": []}
    for name, key in (("compare_plain", "plain"), ("compare_pair", "pair")):
        real = getattr(diff_module, name)

        def spy(*args, real=real, key=key, **kwargs):
            if parallel.in_pool():
                masks[key].append(os.sched_getaffinity(0) if CPUS else None)
            return real(*args, **kwargs)
        monkeypatch.setattr(diff_module, name, spy)
    return masks


def test_a_diff_holds_its_threads_only_for_plain_pairs_and_gives_the_same_numbers(
        tmp_path, monkeypatch):
    a, b = _runs(tmp_path, 1e-3)
    unheld = a.diff(b, passes_in_flight=1).table(progress=False)  # one pass a wave: inline
    masks = _affinities_seen(monkeypatch)
    held = a.diff(b).table(progress=False)

    pd.testing.assert_frame_equal(held, unheld)  # bit for bit: one kernel a pair either way
    assert list(held["dtype_b"][:3]) == ["torch.float32", "torch.bfloat16", "torch.float16"]
    assert (held["max_abs"] > 0).all() and not held["structural"].any()
    if parallel.local_threads() < 2:
        return  # one thread: every wave of one pass runs inline, nothing to hold
    assert masks["plain"] and masks["pair"]
    assert all(m == CPUS for m in masks["pair"])  # torch's ops: never held
    if placement._GETCPU is not None and len(CPUS) >= 2:
        assert all(len(m) == 1 for m in masks["plain"])
    after = list(parallel.map_in_waves(lambda _: os.sched_getaffinity(0) if CPUS else None,
                                       range(8), wave=4))
    assert all(m == (CPUS or None) for m in after)  # the pool's threads given back
    assert not placement._HELD


@holds
def test_a_pass_of_little_plain_data_leaves_its_thread_free(tmp_path, monkeypatch):
    a, b = _runs(tmp_path, 1e-3)  # 1 MB and 8 KB a side a pass: under a 2 MB threshold
    monkeypatch.setattr(diff_module, "HOLD_MIN_BYTES", 2 << 20)
    masks = _affinities_seen(monkeypatch)
    a.diff(b).table(progress=False)
    assert masks["plain"] and all(m == CPUS for m in masks["plain"])


def _held_until(release: threading.Event, held: threading.Event, out: dict) -> threading.Thread:
    """A started thread that waits for ``release`` held (``out["inside"]``: its affinity
    then), and records its affinity after (``out["after"]``)."""
    def run():
        with placement.held_apart():
            out["inside"] = os.sched_getaffinity(0)
            held.set()
            release.wait(timeout=30)
        out["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=run)
    t.start()
    assert held.wait(timeout=30)
    return t


forks = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _in_fresh_interpreter(code: str, **env_vars: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter and check it exits with 0: a fork from this one
    copies whatever other tests left in it (a thread's state whose destructor waits on
    threads the child does not have), and a first torch call there starts what it starts."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(placement.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           **env_vars}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@holds
@forks
def test_a_child_forked_while_a_thread_is_held_starts_with_nothing_held():
    # the parent's held thread does not exist in the child, and a fork while another thread
    # holds the registry's lock (it asks sched_getcpu through ctypes, which lets the GIL go)
    # left the child a lock nobody would release: its first diff waited forever
    _in_fresh_interpreter("""
import os, threading
from tdinspect import placement
entered, locked, release = threading.Event(), threading.Event(), threading.Event()
def holder():
    with placement.held_apart():
        entered.set()
        release.wait(30)
def lock_holder():
    with placement._LOCK:
        locked.set()
        release.wait(30)
threads = [threading.Thread(target=f) for f in (holder, lock_holder)]
for t in threads:
    t.start()
assert entered.wait(30) and locked.wait(30) and placement._HELD
pid = os.fork()
if pid == 0:
    os._exit(0 if placement._LOCK.acquire(timeout=5) and not placement._HELD else 1)
release.set()
for t in threads:
    t.join()
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "child"
assert not placement._HELD
""")


@holds
def test_an_affinity_set_from_outside_while_held_is_left_as_set():
    # `taskset -a -p` (or a job's own sched_setaffinity) while a thread is held: giving the
    # old affinity back on exit would undo it for that thread
    release, held, out = threading.Event(), threading.Event(), {}
    holder = _held_until(release, held, out)
    try:
        (cpu,) = out["inside"]
        elsewhere = {min(CPUS - {cpu})}
        os.sched_setaffinity(holder.native_id, elsewhere)
    finally:
        release.set()
        holder.join()
    assert out["after"] == elsewhere and not placement._HELD


@holds
@forks
def test_a_child_forked_by_a_held_thread_gets_its_affinity_back():
    _in_fresh_interpreter("""
import os, threading
from tdinspect import placement
before, out = os.sched_getaffinity(0), {}
def body():
    with placement.held_apart():
        pid = os.fork()
        if pid == 0:
            inside = os.sched_getaffinity(0)
    if pid == 0:  # the child: the forking thread, alone, left its body
        os._exit(0 if len(inside) == 1 and os.sched_getaffinity(0) == before else 1)
    out["status"] = os.waitpid(pid, 0)[1]
t = threading.Thread(target=body)
t.start()
t.join()
assert os.waitstatus_to_exitcode(out["status"]) == 0, "child"
""")


# -- backing off where other work shares the CPUs --------------------------------------------
def test_a_hold_that_waited_for_its_cpu_stops_holding_there_for_a_while_doubling(monkeypatch):
    monkeypatch.setattr(placement, "_judge", REAL_JUDGE)
    ms, back = 1_000_000, placement._BACKOFF
    placement._judge(0, waited_ns=3 * ms, took_ns=10 * ms)  # waited 30%: other work on CPU 0
    until, length = back[0]
    assert length == placement.BACKOFF_S and until > 0 and 1 not in back
    placement._judge(1, waited_ns=0, took_ns=10 * ms)  # CPU 1 is clean: CPU 0's doubling stays
    placement._judge(0, waited_ns=5 * ms, took_ns=10 * ms)  # CPU 0 again, in a row: twice
    assert back[0][1] == 2 * placement.BACKOFF_S and back[0][0] > until
    placement._judge(0, waited_ns=0, took_ns=500_000)  # too short to tell: nothing changes
    assert back[0][1] == 2 * placement.BACKOFF_S
    until = back[0][0]
    placement._judge(0, waited_ns=2 * ms, took_ns=10 * ms)  # 20%: clean, the doubling restarts
    assert back[0] == (until, 0.0)
    for _ in range(12):
        placement._judge(0, waited_ns=9 * ms, took_ns=10 * ms)
    assert back[0][1] == placement.BACKOFF_MAX_S
    assert placement._backing_off(back[0][0] - 1.0) == {0}


@holds
def test_no_thread_is_held_on_a_cpu_backing_off(monkeypatch):
    first, *others = sorted(CPUS)
    later = time.monotonic() + 60

    def body():
        with placement.held_apart():
            return os.sched_getaffinity(0)
    monkeypatch.setattr(placement, "_BACKOFF", {cpu: (later, 60.0) for cpu in others})
    assert _in_thread(body) == {first}  # the one CPU not backing off
    monkeypatch.setattr(placement, "_BACKOFF", {cpu: (later, 60.0) for cpu in CPUS})
    assert _in_thread(body) == CPUS and not placement._HELD  # every CPU backing off: free


@holds
@pytest.mark.skipif(placement._waited_ns() is None, reason="no /proc/thread-self/schedstat")
def test_a_busy_program_on_the_held_cpu_makes_holding_there_back_off(monkeypatch):
    """A shell busy-looping on the held thread's CPU: the thread waits for it about half the
    time (the scheduler's fair share), so the next hold is on another CPU."""
    monkeypatch.setattr(placement, "_judge", REAL_JUDGE)

    def body():
        with placement.held_apart():
            cpu = placement._HELD[threading.get_ident()]
            hog = subprocess.Popen(["sh", "-c", "while :; do :; done"])
            try:
                os.sched_setaffinity(hog.pid, {cpu})
                end = time.perf_counter() + 0.4
                x = torch.zeros(1 << 12).numpy()
                while time.perf_counter() < end:  # our own work, on the held CPU
                    x += 1.0
            finally:
                hog.kill()
                hog.wait()
        with placement.held_apart():
            again = os.sched_getaffinity(0)
        return cpu, placement._BACKOFF.get(cpu, (0.0, 0.0))[0] - time.monotonic(), again
    cpu, left, again = _in_thread(body)
    assert left > 0  # that CPU backs off now
    assert len(again) == 1 and cpu not in again  # held on another


@holds
def test_a_two_byte_decode_table_built_on_a_held_thread_starts_no_thread_held_for_life():
    """kernels._table converts 65,536 codes: in one torch call that went parallel, and the
    OpenMP threads it started from a held thread kept its one CPU after the hold."""
    done = _in_fresh_interpreter("""if True:
        import os, threading, torch
        from tdinspect import kernels, placement
        built = []
        def build():  # its checks reported to the main thread (a thread's raise is not)
            with placement.held_apart():
                held = len(os.sched_getaffinity(0)) == 1
                table = kernels._table("float16")
            built.append(held and table[0x3C00] == 1.0 and table.shape == (65536,))
        t = threading.Thread(target=build)
        t.start()
        t.join()
        assert built == [True], built
        full = os.sched_getaffinity(0)
        for tid in os.listdir("/proc/self/task"):
            try:
                mask = os.sched_getaffinity(int(tid))
            except ProcessLookupError:  # ended since listed (the joined thread may linger)
                continue
            assert mask == full, tid
        print("OK", torch.get_num_threads())
    """, OMP_NUM_THREADS=str(len(CPUS)))
    assert "OK" in done.stdout
