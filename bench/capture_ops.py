"""Op-level capture overhead: median step time, capture_ops / eager, on the benchmark transformer.

Run: ``python bench/capture_ops.py [--steps 10] [--dir /dev/shm]``. Reports
``stats_only`` and full outputs (views of recorded tensors are stored as
references), with bytes per pass.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tdinspect  # noqa: E402
from common import bench_model, median_step, report_line, threads_note  # noqa: E402


def run(steps: int, out: Path) -> dict:
    model, tokens = bench_model()
    results = {}
    with torch.no_grad():
        for _ in range(3):
            model(tokens)
        with tdinspect.capture_ops(out / "warmup", model=model, stats_only=True) as dump:
            model(tokens)  # the first dispatch mode of a process imports torch._dynamo (~1.5 s)
            dump.step()
        shutil.rmtree(out / "warmup")
        eager, _ = median_step(lambda: model(tokens), steps)
        for mode, kw in (("stats_only", {"stats_only": True}), ("full", {})):
            target = out / mode
            t0 = time.perf_counter()
            with tdinspect.capture_ops(target, model=model, **kw) as dump:
                def step():
                    model(tokens)
                    dump.step()
                med, _ = median_step(step, steps)
                n_entries = dump.recorder.total_entries / steps
            total = time.perf_counter() - t0
            eager_again, _ = median_step(lambda: model(tokens), steps)
            base = (eager + eager_again) / 2
            size = sum(f.stat().st_size for f in target.rglob("pass*.pt")) / steps
            results[mode] = dict(ratio=med / base, total_ratio=total / (base * steps), median_s=med,
                                 eager_s=base, bytes_per_pass=size, entries=n_entries)
            eager = eager_again
            shutil.rmtree(target)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="tdinspect-bench-ops-", dir=args.dir))
    try:
        res = run(args.steps, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"op capture, {args.steps} steps, {threads_note()}, writing to {out.parent}")
    for mode, r in res.items():
        target = 2.0 if mode == "stats_only" else 4.0
        print(report_line(mode, r, target, f"{r['entries']:.0f} entries, "))


if __name__ == "__main__":
    main()
