"""Per-op CPU cost of op capture on a view-heavy loop (views of recorded tensors are references).

Run: ``python bench/view_refs.py``. Process CPU time, not wall time: on a shared
machine the wall-clock ratios of ``bench/capture_ops.py`` swing several-fold
between identical runs, while the CPU time our own thread spends per op holds.
"""

from __future__ import annotations

import tempfile
import time

import torch

import tdinspect

ROUNDS, OPS_PER_ROUND = 300, 7


def work(x: torch.Tensor) -> None:
    for _ in range(ROUNDS):
        y = x * 1
        y.view(-1)
        y.t()
        y[1:]
        y.transpose(0, 1).unsqueeze(0)
        y + 1


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(32, 32)
    eager = min(cpu_seconds(lambda: work(x)) for _ in range(3))
    for mode in ("stats_only", "full"):
        times = []
        for _ in range(3):
            with (
                tempfile.TemporaryDirectory() as out,
                tdinspect.capture_ops(out, stats_only=mode == "stats_only", background_write=False) as dump,
            ):
                times.append(cpu_seconds(lambda: work(x)))
                dump.step()
        per_op = (min(times) - eager) / (ROUNDS * OPS_PER_ROUND) * 1e6
        print(f"{mode:10s} {min(times) / eager:5.1f}x eager CPU time, {per_op:.0f} us per op")


if __name__ == "__main__":
    main()
