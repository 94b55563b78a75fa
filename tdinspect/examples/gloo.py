"""Run one process per rank in a real ``gloo`` group: what the tensor-parallel examples capture with.

:func:`spawn_ranks` starts ``python -m MODULE RANK SIZE STORE ARGS...`` once per rank (this
package on the ``PYTHONPATH``, one thread each) and waits for them; the worker calls
:func:`joined` around its work. A notebook kernel spawns its ranks the same way (the group
lives in the children, never in the kernel).

Examples
--------
>>> spawn_ranks("tdinspect.examples.port_tp", 2, "dumps/.tp2.store", lambda r: ["dumps/tp2"])  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def spawn_ranks(
    module: str,
    size: int,
    store: str | os.PathLike,
    args: Callable[[int], list[str]],
    timeout: float = 300.0,
) -> None:
    """Run ``python -m module RANK SIZE STORE *args(RANK)`` for each rank, all at once.

    ``store`` is the rendezvous file (removed before and after). A rank that fails or runs
    past ``timeout`` seconds is a ``RuntimeError`` with the end of its standard error; the
    other ranks are stopped.
    """
    store = Path(store)
    store.unlink(missing_ok=True)
    package_parent = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_parent, os.environ.get("PYTHONPATH", "")])}
    env.pop("RANK", None)
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny matmuls: threads only contend
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, str(r), str(size), str(store), *args(r)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(size)
    ]
    errors = []
    try:
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=timeout)
            if p.returncode:
                errors.append(f"rank {r} exited {p.returncode}: {err[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        store.unlink(missing_ok=True)
    if errors:
        raise RuntimeError(f"{module}: " + "\n".join(errors))


@contextlib.contextmanager
def joined(rank: int, size: int, store: str):
    """This process as ``rank`` of ``size`` in the ``gloo`` group met at the file ``store``."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
