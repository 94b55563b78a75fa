"""Per tensor: statistics of one float32 CPU tensor, with the compiled one-read loop
(:mod:`tdinspect.numerics.onepass`, the loader's way) and with torch's reductions
(``compiled=False``, capture's way: it never loads numba), interleaved round by round; prints per
way the median over rounds of the best of ``--best``. (Checksums are capture's alone: torch's
reductions, no compiled way to compare.)

    python bench/onepass.py [--mb 4] [--rounds 15] [--best 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from tdinspect.numerics.stats import tensor_stats

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
    tensor_stats(x)  # loads the compiled loops (numba) outside the timings
    got: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for way, compiled in WAYS.items():
            got.setdefault(way, []).append(
                best_ms(functools.partial(tensor_stats, compiled=compiled), x, args.best)
            )
    print(
        f"{args.mb:g} MB float32, {args.threads} thread(s), median over {args.rounds} rounds "
        f"of the best of {args.best}:"
    )
    cells = ", ".join(f"{way} {statistics.median(got[way]):.2f} ms" for way in WAYS)
    print(f"  statistics {cells}")


if __name__ == "__main__":
    main()
