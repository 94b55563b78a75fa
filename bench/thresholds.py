"""Judging a diff table with per-entry thresholds: a number, ``"auto"`` (from each entry's
dtypes) and a ``{regex: number}`` dict with ``"auto"`` for the rest, side by side in one run.

    python bench/thresholds.py [--rows 100000] [--names 500] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pandas as pd

from tdinspect.diff import Diff, threshold_fn
from tdinspect.metrics import metric


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--names", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n = args.rows
    rows = pd.DataFrame({
        "op": [f"model.layers.{i % args.names}.mlp" for i in range(n)],
        "dtype_a": "torch.float32",
        "dtype_b": ["torch.bfloat16" if i % 3 else "torch.float32" for i in range(n)],
        "rel_diff": np.random.default_rng(0).random(n) * 1e-3, "structural": False, "reason": ""})
    m = metric("rel_diff")
    cases = {"number": 1e-3, "auto": "auto", "dict + auto": {r"layers\.1\.": 1e-3}}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):  # interleaved: the machine's load hits every case alike
        for name, spec in cases.items():
            t0 = time.perf_counter()
            Diff._hits(rows, m, threshold_fn(spec, m.name))
            times[name].append(time.perf_counter() - t0)
    for name, t in times.items():
        print(f"{name:12s} median {statistics.median(t) * 1e3:7.1f} ms   min {min(t) * 1e3:7.1f} ms"
              f"   ({statistics.median(t) / n * 1e6:.2f} us a row)")


if __name__ == "__main__":
    main()
