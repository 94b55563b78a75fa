"""Explorer responsiveness on the bundled sample dumps, measured through the widget callbacks.

``python bench/explorer.py``: builds ``explore(diff)`` and the dashboard, then drives the
callbacks a browser would (threshold moves, metric switches, pass picks) and prints the
seconds each took (``ex.timings``), median of a few repeats. The browser test measures the
same interactions end to end (``test-artifacts/browser_timings.json``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import tdinspect  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "sample_dumps"


def main(repeats: int = 3) -> None:
    ref = tdinspect.DumpSet.open(ROOT / "float32")
    rows = {}
    for other in ("wrong_layer", "bfloat16"):
        builds, thr, metric, pick = [], [], [], []
        for _ in range(repeats):
            diff = ref.diff(ROOT / other)
            t0 = time.perf_counter()
            ex = tdinspect.explore(diff, threshold=1e-5)
            builds.append(time.perf_counter() - t0)
            for value in (1e-7, 1e-2, 1e-5):
                ex.threshold.value = value
                thr.append(ex.timings["threshold"])
            for name in ("cosine", "rel_diff"):
                ex.metric.value = name
                metric.append(ex.timings["metric"])
            for p in (1, 0, 1):
                ex.pass_.value = p
                pick.append(ex.timings["pick"])
        t0 = time.perf_counter()
        tdinspect.dashboard(ref, ROOT / other)
        board = time.perf_counter() - t0
        rows[other] = (statistics.median(builds), max(thr), max(metric), max(pick), board)
    print(f"{'B':12s} {'build':>7s} {'thr max':>8s} {'metric max':>10s} {'pick max':>8s} "
          f"{'dashboard':>9s}   (seconds)")
    for other, r in rows.items():
        print(f"{other:12s} " + " ".join(f"{v:{w}.3f}" for v, w in zip(r, (7, 8, 10, 8, 9))))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
