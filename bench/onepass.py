"""Per tensor: statistics, checksum and both of one float32 CPU tensor, with the compiled
one-read loops (:mod:`tdinspect.numerics.onepass`, the loader's way) and with torch's reductions
(``compiled=False``, capture's way: it never loads numba), interleaved round by round; prints per
case the median over rounds of the best of ``--best``.

    python bench/onepass.py [--mb 4] [--rounds 15] [--best 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from tdinspect.numerics.checksum import tensor_checksum
from tdinspect.numerics.stats import stats_and_checksum, tensor_stats

CASES = {"statistics": tensor_stats, "checksum": tensor_checksum, "both": stats_and_checksum}
WAYS = {"one read (loader)": True, "torch's reductions (capture)": False}


def best_ms(fn, x, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--best", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(int(args.mb * (1 << 20)) // 4, generator=torch.Generator().manual_seed(0))
    stats_and_checksum(x)  # loads the compiled loops (numba) outside the timings
    got: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for way, compiled in WAYS.items():
            for case, fn in CASES.items():
                got.setdefault((case, way), []).append(
                    best_ms(functools.partial(fn, compiled=compiled), x, args.best)
                )
    print(
        f"{args.mb:g} MB float32, {args.threads} thread(s), median over {args.rounds} rounds "
        f"of the best of {args.best}:"
    )
    for case in CASES:
        cells = ", ".join(f"{way} {statistics.median(got[case, way]):.2f} ms" for way in WAYS)
        print(f"  {case:10s} {cells}")


if __name__ == "__main__":
    main()
