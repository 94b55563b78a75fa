"""Capture inside a compiled model: median step of the captured compiled model against the
same model compiled without capture, on the benchmark transformer (CPU inductor).

Run: ``python bench/compile.py [--steps 20] [--rounds 5] [--modes stats_only,full] [--op-stats]``.

Copies of the model (same weights) are compiled: one captured (``compile="graph"``: the
statistics computed inside the graph, the record op handed them), one not, and with
``--op-stats`` a third captured with the statistics computed by the record op from the
tensors at run time (the way before the graph computed them). A capture makes dynamo
compile anew when it starts, so every copy is compiled after the captures opened, then
measured side by side, block by block in turn (the order rotating each round), so all see
the same machine state. Reported per mode and captured copy: the median over rounds of
(captured block's median step / plain block's median step), with the range.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model, median_step, scratch_dir, settle, threads_note  # noqa: E402

import tdinspect  # noqa: E402
from tdinspect.dumper import compiled as graphs  # noqa: E402

MODES = {"stats_only": {"stats_only": True}, "full": {}}
TARGETS = {"stats_only": 1.3, "full": None}
# the captured copies: statistics inside the graph (the default), or by the record op
VARIANTS = {"graph-stats": True, "op-stats": False}


def _open(model, folder: Path, mode: str, in_graph: bool, stack: ExitStack):
    prior, graphs.STATS_IN_GRAPH = graphs.STATS_IN_GRAPH, in_graph  # read as the hooks go in
    try:
        return stack.enter_context(tdinspect.capture(model, folder, warn_unfired=False, **MODES[mode]))
    finally:
        graphs.STATS_IN_GRAPH = prior


def measure(mode: str, steps: int, n_rounds: int, out: Path, variants: list[str]) -> dict:
    plain_model, tokens = bench_model()
    with torch.no_grad(), warnings.catch_warnings(), ExitStack() as stack:
        warnings.simplefilter("ignore")
        runs = {}
        for name in variants:
            model = torch.compile(bench_model()[0])
            dump = _open(model, out / mode / name, mode, VARIANTS[name], stack)
            runs[name] = (model, dump)
        plain = torch.compile(plain_model)  # compiled after the captures' resets: all stay
        t0 = time.perf_counter()
        plain(tokens)
        for model, dump in runs.values():
            model(tokens)
            dump.step()
        compile_s = time.perf_counter() - t0

        def stepper(model, dump):
            def step():
                model(tokens)
                dump.step()

            return step

        fns = {"plain": lambda: plain(tokens)} | {n: stepper(*runs[n]) for n in variants}
        names = list(fns)
        ratios: dict[str, list[float]] = {n: [] for n in variants}
        for r in range(n_rounds):
            blocks = {}
            for name in names[r % len(names) :] + names[: r % len(names)]:
                settle()
                blocks[name], _ = median_step(fns[name], steps)
            for n in variants:
                ratios[n].append(blocks[n] / blocks["plain"])
        results = {
            n: dict(
                ratio=statistics.median(ratios[n]),
                low=min(ratios[n]),
                high=max(ratios[n]),
                captured_s=blocks[n],
                entries=runs[n][1].recorder.total_entries / (1 + n_rounds * steps),
                counts=dict(runs[n][1].compile_counts),
            )
            for n in variants
        }
    return dict(plain_s=blocks["plain"], compile_s=compile_s, variants=results)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="stats_only")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--op-stats", action="store_true", help="also a copy whose record op computes the statistics"
    )
    parser.add_argument("--dir", default=None, help="folder for the dumps (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"capture inside torch.compile (inductor, {threads_note()})")
    variants = ["graph-stats", "op-stats"] if args.op_stats else ["graph-stats"]
    with scratch_dir("compile", args.dir) as out:
        for mode in args.modes.split(","):
            r = measure(mode, args.steps, args.rounds, out, variants)
            target = TARGETS[mode]
            print(f"  {mode}: compiled alone {r['plain_s'] * 1e3:6.2f} ms; compiles {r['compile_s']:.0f} s")
            for name, v in r["variants"].items():
                print(
                    f"    {name:12s} captured {v['captured_s'] * 1e3:6.2f} ms  ratio {v['ratio']:.2f}x "
                    f"[{v['low']:.2f}, {v['high']:.2f}] over {args.rounds} rounds"
                    + (f" (target <= {target}x)" if target else "")
                    + f"  {v['entries']:.0f} entries/pass; during capture {v['counts']}"
                )


if __name__ == "__main__":
    main()
