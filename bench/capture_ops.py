"""Op-level capture overhead: median step time, capture_ops / eager, on the benchmark transformer.

Run: ``python bench/capture_ops.py [--steps 10] [--dir /dev/shm]``. Reports
``stats_only`` and full outputs (views of recorded tensors are stored as
references), with bytes per pass.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model, compare_modes, report_line, scratch_dir, threads_note  # noqa: E402

import tdinspect  # noqa: E402


def run(steps: int, out: Path) -> dict:
    model, tokens = bench_model()
    with torch.no_grad():
        for _ in range(3):
            model(tokens)
        with tdinspect.capture_ops(out / "warmup", model=model, stats_only=True) as dump:
            model(tokens)  # the first dispatch mode of a process imports torch._dynamo (~1.5 s)
            dump.step()
        shutil.rmtree(out / "warmup")
        results = compare_modes(
            model,
            tokens,
            steps,
            out,
            {"stats_only": {"stats_only": True}, "full": {}},
            lambda folder, **kw: tdinspect.capture_ops(folder, model=model, **kw),
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with scratch_dir("ops", args.dir) as out:
        res = run(args.steps, out)
    print(f"op capture, {args.steps} steps, {threads_note()}, writing to {out.parent}")
    for mode, r in res.items():
        target = 2.0 if mode == "stats_only" else 4.0
        print(report_line(mode, r, target, f"{r['entries']:.0f} entries, "))


if __name__ == "__main__":
    main()
