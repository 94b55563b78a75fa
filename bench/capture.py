"""Module-level capture overhead: median step time, capture / eager, on the benchmark transformer.

Run: ``python bench/capture.py [--steps 20]``. Eager and captured steps are
measured in the same run, interleaved block by block so both see the same
machine state; "total" adds the final flush of the background writer.

``--rounds N`` instead repeats, N times, a block of steps of each case and of
eager steps (in an order rotated each round) and reports per case the median
over rounds of its median step over that round's eager one, with the range. ``--torch-too`` adds each capture mode computed by torch alone
(``TDINSPECT_ONEPASS=0``: no compiled statistics/checksum loop), side by side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import bench_model, compare_modes, median_step, report_line, scratch_dir, threads_note  # noqa: E402

import tdinspect  # noqa: E402

MODES = {"full": {}, "stats_only": {"stats_only": True}, "checksum": {"stats_only": True, "checksum": True}}
TARGETS = {"full": 1.6, "stats_only": 1.25, "checksum": 1.3}


def run(steps: int, out: Path, modes=tuple(MODES)) -> dict:
    model, tokens = bench_model()
    with torch.no_grad():
        for _ in range(3):
            model(tokens)  # warm up
        results = compare_modes(
            model,
            tokens,
            steps,
            out,
            {m: MODES[m] for m in modes},
            lambda folder, **kw: tdinspect.capture(model, folder, warn_unfired=False, **kw),
        )
    return results


def rounds(steps: int, n_rounds: int, out: Path, cases: dict) -> dict:
    """``{case: [ratio to eager, one per round]}`` for ``cases`` ``{name: (capture kwargs,
    TDINSPECT_ONEPASS value)}``, interleaved round by round with eager steps (see the
    module docstring)."""
    model, tokens = bench_model()
    names = ["eager", *cases]
    times = {name: [] for name in names}
    with torch.no_grad():
        for _ in range(3):
            model(tokens)  # warm up
        for r in range(n_rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if name == "eager":
                    times[name].append(median_step(lambda: model(tokens), steps)[0])
                    continue
                kw, onepass = cases[name]
                os.environ["TDINSPECT_ONEPASS"] = onepass
                target = out / f"{name}-{r}"
                with tdinspect.capture(model, target, warn_unfired=False, **kw) as dump:

                    def step():
                        model(tokens)
                        dump.step()

                    step()  # the first pass loads what it needs (numba's compiled loops)
                    times[name].append(median_step(step, steps)[0])
                shutil.rmtree(target)
    os.environ.pop("TDINSPECT_ONEPASS", None)
    eager = times.pop("eager")
    return {name: [t / e for t, e in zip(ts, eager)] for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's); with fewer than the cores, "
        "the background writer gets a core of its own",
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="where to write (default: a temporary folder on disk; pass /dev/shm "
        "to measure tdinspect without the disk)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma list of {', '.join(MODES)} (checksum: stats_only with checksums)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time steps by the wall clock, or by this process's CPU time (for a "
        "machine shared with other jobs; the writer then runs inline)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="interleave the modes this many rounds (see the module docstring)",
    )
    parser.add_argument(
        "--torch-too", action="store_true", help="with --rounds: also each mode with torch's reductions alone"
    )
    args = parser.parse_args()
    if args.clock == "cpu":
        common.clock = common.CLOCK["cpu"]
        MODES.update({m: {**kw, "background_write": False} for m, kw in MODES.items()})
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.rounds:
        cases = {m: (MODES[m], "1") for m in modes}
        if args.torch_too:
            cases.update({f"{m} (torch)": (MODES[m], "0") for m in modes})
        with scratch_dir("capture", args.dir) as out:
            ratios = rounds(args.steps, args.rounds, out, cases)
        print(
            f"module capture, {args.rounds} rounds x {args.steps} steps per case, "
            f"{threads_note()}, {args.clock} clock; ratio to the round's eager step"
        )
        for name, rs in ratios.items():
            target = TARGETS[name.split()[0]]
            print(
                f"  {name:20s} median {statistics.median(rs):.2f}x  (range {min(rs):.2f}-"
                f"{max(rs):.2f}, target <= {target}x)"
            )
        return
    with scratch_dir("capture", args.dir) as out:
        res = run(args.steps, out, modes)
    from tdinspect.dumper.writer import default_threaded

    inline = args.clock == "cpu" or not default_threaded()
    print(
        f"module capture, {args.steps} steps, {threads_note()}, writing to {out.parent}, "
        f"{'inline' if inline else 'background'} writer, {args.clock} clock"
    )
    for mode, r in res.items():
        print(report_line(mode, r, TARGETS[mode]))


if __name__ == "__main__":
    main()
