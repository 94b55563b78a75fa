"""Per-pass work on local threads, or on a ``dask.distributed`` cluster.

Every per-pass job (statistics of a pass, metrics of a pass pair) is a pure
function of file paths, so it runs the same in a thread here or on a worker
that sees the same shared path. Results come back in input order, in waves,
so a caller can stop early (``first_divergence``) without computing the rest.

Locally the jobs run on one persistent :class:`concurrent.futures.ThreadPoolExecutor`
(as many threads as dask's default local pool: the CPUs this process may use),
not on dask's threaded scheduler. The jobs are independent, so a task graph
buys nothing here, while building, optimising and scheduling one cost about
1 ms a call (a no-op ``dask.compute`` of two tasks: 1.06 ms, the pool: 0.04 ms),
a third of a diff of two 16 MB passes; and ``import dask`` is 70 ms of a small
CLI diff. The heavy lifting is the compiled loops, which release the GIL; where each
thread runs is left to the operating system's scheduler.

Examples
--------
>>> list(map_in_waves(lambda x: x * x, [1, 2, 3]))
[1, 4, 9]
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_WORKER = threading.local()  # .busy: this thread is one of the pool's


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist here (a fresh pool is made)."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


@functools.cache
def local_threads() -> int:
    """The CPUs this process may use: its affinity, bounded by a cgroup's CPU quota (a
    container's ``--cpus``), as dask counts its default local pool. Counted here, not by
    ``dask.system.cpu_count``: dask is an optional extra, and importing it takes 0.17 s."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_cpus()
    return max(1, min(count, math.ceil(quota))) if quota else count


def _cgroup_cpus() -> float | None:
    """CPUs allowed by a cgroup quota (v2 ``cpu.max``, else v1), or None: no quota."""
    try:
        with open("/proc/self/cgroup") as f:
            group = f.read().strip().split(":")[-1].rstrip("/")
        with open(f"/sys/fs/cgroup{group}/cpu.max") as f:
            quota, period = f.read().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for folder in ("cpu,cpuacct", "cpuacct,cpu"):
        try:
            with open(f"/sys/fs/cgroup/{folder}/cpu.cfs_quota_us") as f:
                quota = int(f.read())
            with open(f"/sys/fs/cgroup/{folder}/cpu.cfs_period_us") as f:
                period = int(f.read())
            return quota / period if quota > 0 and period > 0 else None
        except (OSError, ValueError):
            continue
    return None


def default_wave(client: Any = None) -> int:
    """Passes per wave: twice the workers' threads (enough to keep them all busy)."""
    if client is not None:
        info = client.scheduler_info()
        threads = sum(w.get("nthreads", 1) for w in info.get("workers", {}).values())
        return max(2, 2 * threads)
    return max(2, 2 * local_threads())


def _mark_worker() -> None:
    _WORKER.busy = True


def _pool() -> ThreadPoolExecutor:
    """The process's pool, made on first use (and again in a forked child)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                local_threads(), thread_name_prefix="tdinspect", initializer=_mark_worker
            )
        return _POOL


def in_pool() -> bool:
    """Whether the calling thread is one of the local pool's."""
    return getattr(_WORKER, "busy", False)


def map_in_waves(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    client: Any = None,
    wave: int | None = None,
    scheduler: str = "threads",
) -> Iterator[R]:
    """``fn`` over ``items``, computed a wave at a time, yielded in order.

    Parameters
    ----------
    fn : callable
        A picklable function of one item (it runs on workers with a client).
    items : iterable
    client : dask.distributed.Client, optional
        Run on this cluster; otherwise on the local pool (``scheduler``).
    wave : int, optional
        Items computed together (default :func:`default_wave`). A consumer that
        stops iterating never starts the next wave (the rest of its own wave is
        cancelled where not started).
    scheduler : {"threads", "sync"}
        Without a client: the local pool's threads, or the calling thread alone.
        A job that maps in waves itself runs its items in its own thread (a job
        waiting on the pool that runs it could wait forever).
        A job that starts threads of its own which map in waves, and waits for
        them, must give them ``scheduler="sync"``: they are not the pool's,
        so their items would queue behind the jobs waiting for them.

    Raises
    ------
    Exception
        The first failing job's own exception, with its traceback, in input order.
    """
    if scheduler not in ("threads", "sync"):
        raise ValueError(f"scheduler={scheduler!r}: expected 'threads' or 'sync'")
    items = list(items)
    wave = default_wave(client) if wave is None else wave
    if isinstance(wave, bool) or not isinstance(wave, int) or wave < 1:
        raise ValueError(f"wave={wave!r}: expected a whole number of items, 1 or more")
    inline = client is None and (scheduler == "sync" or in_pool())
    for start in range(0, len(items), wave):
        chunk = items[start : start + wave]
        if client is not None:
            futures = client.map(fn, chunk, pure=False)
            yield from client.gather(futures)
        elif inline or len(chunk) == 1:
            for x in chunk:
                yield fn(x)
        else:
            futures = [_pool().submit(fn, x) for x in chunk]
            try:
                for f in futures:
                    yield f.result()
            finally:  # stopped early or failed: what has not started never will
                for f in futures:
                    f.cancel()
