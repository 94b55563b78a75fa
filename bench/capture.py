"""Module-level capture overhead: median step time, capture / eager, on the benchmark transformer.

Run: ``python bench/capture.py [--steps 20]``. Eager and captured steps are
measured in the same run, interleaved block by block so both see the same
machine state; "total" adds the final flush of the background writer.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tdinspect  # noqa: E402
from common import bench_model, compare_modes, report_line, threads_note  # noqa: E402


def run(steps: int, out: Path) -> dict:
    model, tokens = bench_model()
    with torch.no_grad():
        for _ in range(3):
            model(tokens)  # warm up
        results = compare_modes(
            model, tokens, steps, out, {"full": {}, "stats_only": {"stats_only": True}},
            lambda folder, **kw: tdinspect.capture(model, folder, warn_unfired=False, **kw))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's); with fewer than the cores, "
                             "the background writer gets a core of its own")
    parser.add_argument("--dir", default=None,
                        help="where to write (default: a temporary folder on disk; pass /dev/shm "
                             "to measure tdinspect without the disk)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(tempfile.mkdtemp(prefix="tdinspect-bench-", dir=args.dir))
    try:
        res = run(args.steps, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    from tdinspect.dumper.writer import default_threaded

    print(f"module capture, {args.steps} steps, {threads_note()}, writing to {out.parent}, "
          f"{'background' if default_threaded() else 'inline'} writer")
    for mode, r in res.items():
        target = 1.6 if mode == "full" else 1.25
        print(report_line(mode, r, target))


if __name__ == "__main__":
    main()
