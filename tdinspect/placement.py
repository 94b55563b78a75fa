"""Keep the local pool's busy threads on distinct CPUs while they compare (Linux only).

:func:`held_apart` holds the calling thread on one CPU that no other holder is on (the
one it runs on where that is free), by its own affinity, and gives its affinity back on
exit. :func:`tdinspect.diff.compare_pass` holds it, on the pool's threads, while it reads
and compares a pass's plain pairs of 1 MB a side or more (``diff.HOLD_MIN_BYTES``; below,
the hold costs more than it saves): numpy and the compiled loops, which start no threads
(a thread started while held would inherit the one CPU); torch's ops for the other pairs
run after it, free.

Why: two pool threads released at once, or handing the GIL to each other, are woken by
Linux onto one CPU although the other is idle (on a virtual machine an idle virtual CPU
may be reported as preempted by its host, and wake-ups avoid it), and the load balancer
moves one only at a later tick: traces showed one pool thread waiting ~4 ms for the CPU
where the other ran its loop. Measured on the 2-CPU development VM, ``diff().table()`` of
two passes of one 16 MB float16 pair (30 rounds): 12.5-12.8 ms median unheld, 9.8-10.0 ms
held; moving a thread once at the start of its job, then leaving it free, gave 12.4 ms (the
GIL hand-overs that follow put it back). Elsewhere (no ``sched_getcpu``, a single CPU, all
CPUs held) nothing is done.

Where other programs take the CPUs, a held thread cannot leave a CPU they share with it
(measured: 1-20% slower than free threads with a busy process beside, up to 50% back to
back under a test suite). So each hold reads, from ``/proc/thread-self/schedstat``, how
long its thread waited runnable for its CPU: a hold that waited over a quarter of its time
stops holding on that CPU for a while (:data:`BACKOFF_S`, doubled at each such hold there in
a row, at most :data:`BACKOFF_MAX_S`); one there that did not resets the doubling. Per CPU,
because other work often takes some CPUs only (one busy process: a thread held on the other
CPU is as fast as ever, and its clean holds reset a machine-wide doubling, so the busy CPU
kept being held every other diff: 1.04x unheld). Short at first, because
contention is often brief (torch's OpenMP threads spin ~10 ms after an op: a 1 s backoff
taken from a diff right after a torch compare left the diffs of the next second unheld, 5.0
against 6.8-7.9 GB/s for 1 MB pairs), and doubling so that lasting load stops it within a
dozen holds. On an idle machine nothing changes.

Examples
--------
>>> with held_apart():
...     pass   # reads and compares, on a CPU no other holder is on
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Callable, Iterator

_LOCK = threading.Lock()
_HELD: dict[int, int] = {}  # thread ident -> the CPU it is held on
BACKOFF_S, BACKOFF_MAX_S = 0.1, 60.0  # no holding on a CPU this long after a hold that waited
_BACKOFF: dict[int, tuple[float, float]] = {}  # CPU -> (time.monotonic() to hold there again,
#                                                 the last length)


def _forget_held() -> None:
    """In a forked child: the parent's holders do not exist here, and a fork while one held
    the lock (``sched_getcpu`` through ctypes lets the GIL go) would leave it locked."""
    global _LOCK, _HELD
    _LOCK, _HELD = threading.Lock(), {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_held)


def _cpu_getter() -> Callable[[], int] | None:
    """glibc's ``sched_getcpu`` (the CPU the calling thread runs on), or ``None``."""
    if not (hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        getcpu = libc.sched_getcpu
    except (OSError, AttributeError):
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu if getcpu() >= 0 else None


_GETCPU = _cpu_getter()


def _waited_ns() -> int | None:
    """How long the calling thread has waited runnable for a CPU (ns), or ``None`` (no
    scheduler statistics)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _judge(cpu: int, waited_ns: int, took_ns: int) -> None:
    """Back off from holding on ``cpu`` after a hold there that waited for it over a quarter
    of its time (other work on that CPU); reset its doubling after one that did not."""
    if took_ns < 1_000_000:  # too short to tell
        return
    with _LOCK:
        if 4 * waited_ns > took_ns:
            length = min(max(2 * _BACKOFF.get(cpu, (0.0, 0.0))[1], BACKOFF_S), BACKOFF_MAX_S)
            _BACKOFF[cpu] = (time.monotonic() + length, length)
        elif cpu in _BACKOFF:
            _BACKOFF[cpu] = (_BACKOFF[cpu][0], 0.0)


def _backing_off(now: float) -> set[int]:
    """The CPUs not to hold on now (call with the lock)."""
    return {cpu for cpu, (until, _) in _BACKOFF.items() if now < until}


def _hold() -> tuple[set[int], int] | None:
    """Hold the calling thread on a CPU no other holder is on and none backs off from: its
    affinity before and that CPU, or ``None`` (not held)."""
    mask = os.sched_getaffinity(0)  # 0: the calling thread
    with _LOCK:
        free = mask - set(_HELD.values()) - _backing_off(time.monotonic())
        if len(mask) < 2 or not free:
            return None
        cpu = _GETCPU()
        cpu = cpu if cpu in free else min(free)
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:  # a cpuset that does not allow it
            return None
        _HELD[threading.get_ident()] = cpu
    return mask, cpu


@contextlib.contextmanager
def held_apart() -> Iterator[None]:
    """Run the body held on one CPU that no other holder is on, where one is free (see the
    module's text); the thread's affinity is given back on exit. The body must start no
    threads. An affinity set from outside while held (``taskset -a``) is left as set. Never
    held on a CPU backing off from other work (see the module's text)."""
    held = _hold() if _GETCPU is not None else None
    waited, start = (_waited_ns(), time.perf_counter_ns()) if held is not None else (None, 0)
    try:
        yield
    finally:
        if held is not None:
            mask, cpu = held
            with _LOCK:
                _HELD.pop(threading.get_ident(), None)
            # set from outside meanwhile (taskset -a, a cpuset): theirs, not given back
            if os.sched_getaffinity(0) == {cpu}:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, mask)
            now = _waited_ns() if waited is not None else None
            if now is not None:
                _judge(cpu, now - waited, time.perf_counter_ns() - start)
