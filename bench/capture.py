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
import common  # noqa: E402
from common import bench_model, compare_modes, report_line, threads_note  # noqa: E402


MODES = {"full": {}, "stats_only": {"stats_only": True},
         "checksum": {"stats_only": True, "checksum": True}}
TARGETS = {"full": 1.6, "stats_only": 1.25, "checksum": 1.3}


def run(steps: int, out: Path, modes=tuple(MODES)) -> dict:
    model, tokens = bench_model()
    with torch.no_grad():
        for _ in range(3):
            model(tokens)  # warm up
        results = compare_modes(
            model, tokens, steps, out, {m: MODES[m] for m in modes},
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
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma list of {', '.join(MODES)} (checksum: stats_only with checksums)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by the wall clock, or by this process's CPU time (for a "
                             "machine shared with other jobs; the writer then runs inline)")
    args = parser.parse_args()
    if args.clock == "cpu":
        common.clock = common.CLOCK["cpu"]
        MODES.update({m: {**kw, "background_write": False} for m, kw in MODES.items()})
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(tempfile.mkdtemp(prefix="tdinspect-bench-", dir=args.dir))
    try:
        res = run(args.steps, out, [m.strip() for m in args.modes.split(",") if m.strip()])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    from tdinspect.dumper.writer import default_threaded

    inline = args.clock == "cpu" or not default_threaded()
    print(f"module capture, {args.steps} steps, {threads_note()}, writing to {out.parent}, "
          f"{'inline' if inline else 'background'} writer, {args.clock} clock")
    for mode, r in res.items():
        print(report_line(mode, r, TARGETS[mode]))


if __name__ == "__main__":
    main()
