"""Live checks overhead: compare_to and on_nonfinite against eager and full capture, side by side.

Run: ``python bench/live.py [--steps 8] [--threads 2]``. A reference dump of
the benchmark transformer is written first; then eager steps, full capture
(inline writer), live comparison against the reference (module level, nothing
written) and the NaN/Inf check alone are measured in the same run, one step
of each per round (see :func:`run`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model, scratch_dir, threads_note  # noqa: E402

import tdinspect  # noqa: E402

TARGETS = {"full": 1.6, "compare_to": 1.5, "on_nonfinite": 1.1}


def run(steps: int, out: Path) -> dict:
    """Median step time of each mode over ``steps`` rounds; one step of every mode per round,
    in a rotating order, each mode on its own copy of the model (so every capture stays
    open): on a shared machine, the modes of one round see the same load."""
    model, tokens = bench_model()
    ref = out / "reference"
    with torch.no_grad():
        with tdinspect.capture(model, ref, warn_unfired=False) as dump:
            for _ in range(steps + 1):
                model(tokens)
                dump.step()
        models = {mode: copy.deepcopy(model) for mode in ("eager", *TARGETS)}
        caps = {
            "eager": None,
            "full": tdinspect.capture(models["full"], out / "full", warn_unfired=False),
            "compare_to": tdinspect.capture(models["compare_to"], compare_to=ref, warn_unfired=False),
            "on_nonfinite": tdinspect.capture(
                models["on_nonfinite"], on_nonfinite="raise", warn_unfired=False
            ),
        }
        order = list(caps)
        times: dict[str, list[float]] = {mode: [] for mode in order}
        for r in range(steps + 1):  # round 0 warms up (numba compiles its kernel there)
            for mode in order[r % len(order) :] + order[: r % len(order)]:
                t0 = time.perf_counter()
                models[mode](tokens)
                if caps[mode] is not None:
                    caps[mode].step()
                if r:
                    times[mode].append(time.perf_counter() - t0)
        for cap in caps.values():
            if cap is not None:
                cap.close()
    out = {}
    for mode, ts in times.items():  # ratios within a round, where the load was the same
        ratios = sorted(t / e for t, e in zip(ts, times["eager"]))
        q = len(ratios) // 4
        out[mode] = (statistics.median(ts), statistics.median(ratios), ratios[q], ratios[-1 - q])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the reference goes (default: temporary)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with scratch_dir("live", args.dir) as out:
        res = run(args.steps, out)
    print(f"live checks, module level, {args.steps} rounds, {threads_note()}")
    for mode, (median, ratio, lo, hi) in res.items():
        target = f"(target <= {TARGETS[mode]}x)" if mode in TARGETS else ""
        print(
            f"  {mode:12s} median step {median * 1e3:7.1f} ms  ratio to eager in the same round: "
            f"median {ratio:.2f}x, quartiles {lo:.2f}-{hi:.2f} {target}"
        )


if __name__ == "__main__":
    main()
