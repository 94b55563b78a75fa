"""Explorer and dashboard responsiveness, measured through the widget callbacks (kernel side).

``python bench/explorer.py [--rounds 3] [--baseline CHECKOUT]``: drives the interactions a
browser would, by assigning widget values (each observer runs as it does in the kernel), and
prints the seconds each took, median of ``--rounds`` fresh processes:

* the dashboard (:func:`tdinspect.dashboard`): its build, threshold moves, the ``auto`` tick,
  metric switches (with the module tree and health table's share: "overview"), an entry picked the first time and again, another pass, a row of its table;
* the DumpSet explorer (``explore(ds)``): its build, op picks, a pass move, and typing an op's
  name into the search box (the kernel's busy time from the first key to the last redraw; in
  a kernel the search redraws once, after typing pauses);

on the bundled sample dumps (float32 against ``wrong_layer`` and against ``bfloat16``, two
passes) and on one pass of a 32-layer Hugging Face Llama (tiny width, random weights, a 1%
error planted in layer 7's MLP; captured here). With ``--baseline`` (a checkout of another
commit, e.g. ``git worktree add --detach ../before main``), each round runs both trees in
turn, alternating which goes first, so both share the machine's load; the table shows both.
The browser test measures interactions end to end (``test-artifacts/browser_timings.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent / "sample_dumps"
LAYERS = 32


def _timed(widget, value) -> float:
    t0 = time.perf_counter()
    widget.value = value
    return time.perf_counter() - t0


def _typing(dx, word: str) -> float:
    """Kernel busy time typing ``word`` into the search box, one key every 50 ms, in a running
    event loop (as in a kernel): each key's callback plus the redraw(s) it causes."""

    async def run() -> float:
        busy = 0.0
        for i in range(1, len(word) + 1):
            t0 = time.perf_counter()
            dx.search.value = word[:i]
            busy += time.perf_counter() - t0
            await asyncio.sleep(0.05)
        pending = getattr(dx, "_pending", None)
        if pending is not None:  # the debounced redraw: its own work, not the wait for it
            pending.cancel()
            t0 = time.perf_counter()
            dx._apply_search(word)
            busy += time.perf_counter() - t0
        return busy

    return asyncio.run(run())


def _timed_overview(ex) -> list[float]:
    """Seconds each refresh of the explorer's module tree and health table takes (appended)."""
    spent: list[float] = []
    real = ex.overview.refresh

    def timed() -> None:
        t0 = time.perf_counter()
        real()
        spent.append(time.perf_counter() - t0)

    ex.on_update[ex.on_update.index(real)] = timed
    return spent


def measure(a: str, b: str) -> dict[str, float]:
    """Seconds of each interaction on the pair ``a`` (reference), ``b``; worst of several."""
    import tdinspect

    r: dict[str, float] = {}
    t0 = time.perf_counter()
    board = tdinspect.dashboard(a, b)
    r["dashboard build"] = time.perf_counter() - t0
    ex = board.explorer
    overview = _timed_overview(ex)
    r["threshold move"] = max(_timed(ex.threshold, v) for v in (1e-7, 1e-2, 1e-5, 2e-5, 3e-5))
    r["threshold: overview"] = max(overview)
    overview.clear()
    r["auto tick"] = _timed(ex.auto, True)
    r["metric switch"] = max(_timed(ex.metric, name) for name in ("cosine", "rel_diff"))
    r["metric: overview"] = max(overview)
    keys = [v for _, v in ex.entry.options]
    picked = [keys[i * len(keys) // 5] for i in range(1, 5)]
    r["entry pick (first time)"] = max(_timed(ex.entry, k) for k in picked)
    r["entry pick (again)"] = max(_timed(ex.entry, k) for k in picked)
    passes = list(ex.pass_.options)
    if len(passes) > 1:
        r["pass pick"] = max(_timed(ex.pass_, p) for p in passes[::-1])
    rows = [v for _, v in board.entries.options]
    r["table row pick"] = max(_timed(board.entries, rows[len(rows) * i // 7]) for i in (2, 3, 6))
    ds = tdinspect.DumpSet.open(a)
    t0 = time.perf_counter()
    dx = tdinspect.explore(ds)
    r["ops explorer build"] = time.perf_counter() - t0
    ops = list(ds.ops)
    r["op pick"] = max(_timed(dx.op, ops[len(ops) * i // 5]) for i in (1, 2, 4))
    if len(ds.passes) > 1:
        r["ops pass move"] = max(_timed(dx.pass_, p) for p in ds.passes[::-1])
    word = ops[len(ops) // 2].split(".")[-1][:6]
    dx.op.value = ops[0]
    r["search typed (busy)"] = _typing(dx, word)
    return r


def capture_llama(out: Path) -> tuple[Path, Path]:
    """One pass of a 32-layer tiny-width HF Llama, and the same with layer 7's MLP 1% off."""
    import torch

    import tdinspect
    from tdinspect.examples.port import make_hf_llama, port_tokens

    dirs = []
    for name, scale in (("a", 1.0), ("b", 1.01)):
        model = make_hf_llama(0, num_hidden_layers=LAYERS)
        with torch.no_grad():
            model.model.layers[7].mlp.up_proj.weight.mul_(scale)
            with tdinspect.capture(model, out / name) as cap:
                model(port_tokens(0))
                cap.step()
        dirs.append(out / name)
    return dirs[0], dirs[1]


def worker(pairs: dict[str, list[str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import warnings

    warnings.simplefilter("ignore")  # a run's warnings are not the figures
    print(json.dumps({name: measure(a, b) for name, (a, b) in pairs.items()}))


def run_tree(tree: Path, pairs: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, str(HERE), "--worker", json.dumps(pairs)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per tree (median)")
    parser.add_argument("--baseline", default=None, help="a checkout to measure side by side")
    parser.add_argument("--dir", default=None, help="where the Llama dumps go (default: temporary)")
    parser.add_argument("--json", default=None, help="also write the medians here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE.parent.parent))
    from common import scratch_dir

    trees = {"this": HERE.parent.parent}
    if args.baseline:
        trees["baseline"] = Path(args.baseline).resolve()
    with scratch_dir("explorer", args.dir) as out:
        a, b = capture_llama(out)
        pairs = {
            "wrong_layer": [str(ROOT / "float32"), str(ROOT / "wrong_layer")],
            "bfloat16": [str(ROOT / "float32"), str(ROOT / "bfloat16")],
            f"llama {LAYERS} layers": [str(a), str(b)],
        }
        runs: dict[str, list[dict]] = {t: [] for t in trees}
        for i in range(args.rounds):
            order = list(trees) if i % 2 == 0 else list(trees)[::-1]
            for t in order:
                runs[t].append(run_tree(trees[t], pairs))
    medians = {
        t: {
            pair: {k: statistics.median(run[pair][k] for run in results) for k in results[0][pair]}
            for pair in pairs
        }
        for t, results in runs.items()
    }
    kinds = list(dict.fromkeys(k for pair in pairs for k in medians["this"][pair]))
    cols = [(pair, t) for pair in pairs for t in trees]
    print(f"seconds, median of {args.rounds} rounds" + (" (this / baseline)" if args.baseline else ""))
    print(f"{'interaction':26s}" + "".join(f"{pair[:18]:>20s}" for pair in pairs))
    for k in kinds:
        cells = []
        for pair in pairs:
            vals = [medians[t][pair].get(k) for t in trees]
            cells.append(" / ".join("-" if v is None else f"{v:.3f}" for v in vals))
        print(f"{k:26s}" + "".join(f"{c:>20s}" for c in cells))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rounds": args.rounds, "medians": medians, "cols": cols}, indent=1)
        )


if __name__ == "__main__":
    main()
