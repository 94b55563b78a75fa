"""Capture inside a compiled model: median step of the captured compiled model against the
same model compiled without capture, on the benchmark transformer (CPU inductor).

Run: ``python bench/compile.py [--steps 20] [--rounds 5] [--modes stats_only,full]``.

Two copies of the model (same weights) are compiled: one captured (``compile="graph"``,
the record op in its graph), one not. A capture makes dynamo compile anew when it starts,
so both copies are compiled after the capture opened, then measured side by side, block by
block in turn, so both see the same machine state. Reported per mode: the median over
rounds of (captured block's median step / plain block's median step), with the range.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model, median_step, scratch_dir, settle, threads_note  # noqa: E402

import tdinspect  # noqa: E402

MODES = {"stats_only": {"stats_only": True}, "full": {}}
TARGETS = {"stats_only": 1.3, "full": None}


def measure(mode: str, steps: int, n_rounds: int, out: Path) -> dict:
    plain_model, tokens = bench_model()
    captured_model, _ = bench_model()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = torch.compile(captured_model)
        with tdinspect.capture(captured, out / mode, warn_unfired=False, **MODES[mode]) as dump:
            plain = torch.compile(plain_model)  # compiled after the capture's reset: both stay
            t0 = time.perf_counter()
            plain(tokens)
            captured(tokens)
            compile_s = time.perf_counter() - t0
            dump.step()

            def step():
                captured(tokens)
                dump.step()

            ratios = []
            for r in range(n_rounds):
                blocks = {}
                order = ("plain", "captured") if r % 2 == 0 else ("captured", "plain")
                for name in order:
                    settle()
                    fn = step if name == "captured" else (lambda: plain(tokens))
                    blocks[name], _ = median_step(fn, steps)
                ratios.append(blocks["captured"] / blocks["plain"])
            entries = dump.recorder.total_entries / (1 + n_rounds * steps)
            counts = dict(dump.compile_counts)
    return dict(
        ratio=statistics.median(ratios),
        low=min(ratios),
        high=max(ratios),
        plain_s=blocks["plain"],
        captured_s=blocks["captured"],
        compile_s=compile_s,
        entries=entries,
        counts=counts,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="stats_only")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--dir", default=None, help="folder for the dumps (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"capture inside torch.compile (inductor, {threads_note()})")
    with scratch_dir("compile", args.dir) as out:
        for mode in args.modes.split(","):
            r = measure(mode, args.steps, args.rounds, out)
            target = TARGETS[mode]
            print(
                f"  {mode:10s} captured {r['captured_s'] * 1e3:6.2f} ms vs compiled alone "
                f"{r['plain_s'] * 1e3:6.2f} ms  ratio {r['ratio']:.2f}x "
                f"[{r['low']:.2f}, {r['high']:.2f}] over {args.rounds} rounds"
                + (f" (target <= {target}x)" if target else "")
                + f"  {r['entries']:.0f} entries/pass; compiles {r['compile_s']:.0f} s; "
                f"during capture {r['counts']}"
            )


if __name__ == "__main__":
    main()
