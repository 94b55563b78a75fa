"""Judging a diff table with per-entry thresholds: a number, ``"auto"`` (from each entry's
dtypes) and a ``{regex: number}`` dict with ``"auto"`` for the rest, side by side in one run;
``"auto"`` with and without the rows' ``upstream`` column, and the cost of computing that column
(:func:`tdinspect.compare.thresholds.upstream_of`, once per pass frame).

    python bench/thresholds.py [--rows 100000] [--names 500] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pandas as pd

from tdinspect.compare.diff import Diff
from tdinspect.compare.thresholds import threshold_fn, upstream_of
from tdinspect.numerics.metrics import metric


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--names", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n = args.rows
    rows = pd.DataFrame(
        {
            "op": [f"model.layers.{i % args.names}.mlp" for i in range(n)],
            "dtype_a": "torch.float32",
            "dtype_b": ["torch.bfloat16" if i % 3 else "torch.float32" for i in range(n)],
            "rel_diff": np.random.default_rng(0).random(n) * 1e-3,
            "structural": False,
            "reason": "",
        }
    )
    m = metric("rel_diff")
    plain = rows.copy()
    rows["upstream"] = upstream_of(rows["dtype_a"], rows["dtype_b"])
    cases = {
        "number": (1e-3, rows),
        "auto, no upstream": ("auto", plain),
        "auto": ("auto", rows),
        "dict + auto": ({r"layers\.1\.": 1e-3}, rows),
    }
    times: dict[str, list[float]] = {k: [] for k in (*cases, "upstream_of")}
    for _ in range(args.rounds):  # interleaved: the machine's load hits every case alike
        for name, (spec, frame) in cases.items():
            t0 = time.perf_counter()
            Diff._hits(frame, m, threshold_fn(spec, m.name))
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        upstream_of(rows["dtype_a"], rows["dtype_b"])
        times["upstream_of"].append(time.perf_counter() - t0)
    for name, t in times.items():
        print(
            f"{name:18s} median {statistics.median(t) * 1e3:7.1f} ms   min {min(t) * 1e3:7.1f} ms"
            f"   ({statistics.median(t) / n * 1e6:.2f} us a row)"
        )


if __name__ == "__main__":
    main()
