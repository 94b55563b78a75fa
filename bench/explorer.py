"""Explorer and dashboard responsiveness, measured through the widget callbacks.

``python bench/explorer.py [--repeats 3] [--passes 40]``: on the bundled sample dumps, builds
``explore(diff)`` and the dashboard, then drives the callbacks a browser would (threshold moves,
metric switches, pass picks) and prints the seconds each took (``ex.timings``), median of a few
repeats. Then the dashboard's own interactions (the same moves, the entry table included: the
seconds each assignment takes, and the share of it the health table and the module tree take),
on the samples and on a larger pair (the bundled model over
``--passes`` passes, a wrong layer in B: a table of 42 rows a pass). The browser test measures
the same interactions end to end (``test-artifacts/browser_timings.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import scratch_dir  # noqa: E402

import tdinspect  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "sample_dumps"


def explorer_rows(ref, repeats: int) -> dict:
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
    return rows


def dashboard_row(a, b, repeats: int) -> tuple:
    """(rows, build, max threshold move, max metric switch, auto tick, max entry-table share) of
    the dashboard, seconds: each the median over ``repeats`` boards of the worst of its moves;
    the last is the time one interaction spends on the health table and the module tree
    (``Overview.refresh``)."""
    from tdinspect.jupyter.overview import Overview

    table: list[float] = []
    real = Overview.refresh

    def timed_refresh(self, *args):
        t0 = time.perf_counter()
        real(self, *args)
        table.append(time.perf_counter() - t0)

    def timed(widget, value) -> tuple[float, float]:
        table.clear()
        t0 = time.perf_counter()
        widget.value = value
        return time.perf_counter() - t0, sum(table)

    builds, thr, metric, auto, marks = [], [], [], [], []
    Overview.refresh = timed_refresh
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            board = tdinspect.dashboard(a, b)
            builds.append(time.perf_counter() - t0)
            ex = board.explorer
            moves = [timed(ex.threshold, v) for v in (1e-7, 1e-2, 1e-5, 2e-5)]
            ticks = [timed(ex.auto, True)]
            switches = [timed(ex.metric, name) for name in ("cosine", "rel_diff")]
            for out, done in ((thr, moves), (auto, ticks), (metric, switches)):
                out.append(max(t for t, _ in done))
            marks.append(max(m for _, m in moves + ticks + switches))
    finally:
        Overview.refresh = real
    return (len(ex.table), *(statistics.median(x) for x in (builds, thr, metric, auto, marks)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passes", type=int, default=40, help="passes of the larger pair")
    parser.add_argument("--dir", default=None, help="where the larger pair goes (default: temporary)")
    args = parser.parse_args()
    ref = tdinspect.DumpSet.open(ROOT / "float32")
    rows = explorer_rows(ref, args.repeats)
    print(
        f"{'B':12s} {'build':>7s} {'thr max':>8s} {'metric max':>10s} {'pick max':>8s} "
        f"{'dashboard':>9s}   (seconds)"
    )
    for other, r in rows.items():
        print(f"{other:12s} " + " ".join(f"{v:{w}.3f}" for v, w in zip(r, (7, 8, 10, 8, 9))))
    from tdinspect.examples.samples import capture_model_run

    print(
        f"\ndashboard interactions (seconds; entry table included)\n{'pair':24s} {'rows':>6s} "
        f"{'build':>7s} {'thr max':>8s} {'metric max':>10s} {'auto':>6s} {'table max':>9s}"
    )
    with scratch_dir("explorer", args.dir) as out:
        pairs = {
            "float32 vs wrong_layer": (ref, ROOT / "wrong_layer"),
            f"{args.passes} passes": (
                capture_model_run(out / "a", steps=args.passes),
                capture_model_run(out / "b", steps=args.passes, perturb="layers.2.mlp.down.weight"),
            ),
        }
        for name, (a, b) in pairs.items():
            n, *r = dashboard_row(a, b, args.repeats)
            print(f"{name:24s} {n:6d} " + " ".join(f"{v:{w}.3f}" for v, w in zip(r, (7, 8, 10, 6, 9))))


if __name__ == "__main__":
    main()
