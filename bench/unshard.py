"""Diff throughput with unsharding and concatenation, as a ratio of the plain diff of the same bytes.

Run: ``python bench/unshard.py``. On files it writes and removes, float32:

- plain: a reference of ``--passes`` x ``--entries`` tensors ``[seq, hidden]`` against a rerun
  with float32-sized noise, ``Diff(...).table()``;
- unshard: the same reference against a 2-way tensor-parallel run of the same values (each
  rank holds half of ``hidden``: dims ``"s h(tp)"``; with ``--mixed``, a quarter of the
  entries are partial sums ``"s h(tp,partial)"`` and a quarter replicated), ``unshard=True``;
- concat: the reference against a decode-like run whose pass holds each entry as ``--calls``
  calls of ``seq / calls`` positions, ``concat="call:0"``.

Throughput is bytes of pass files read (both sides) per second; each configuration is timed
``--rounds`` times, alternating, and the median taken.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tdinspect import DumpSet
from tdinspect.dumper.recorder import Recorder


def _values(p: int, e: int, seq: int, hidden: int, noise: float, gen) -> torch.Tensor:
    base = torch.randn(seq, hidden, generator=torch.Generator().manual_seed(p * 1000 + e))
    return base + noise * torch.randn(seq, hidden, generator=gen) if noise else base


def _kind(e: int, mixed: bool) -> str:
    return ("partial" if e % 4 == 2 else "replicated" if e % 4 == 3 else "tp") if mixed else "tp"


def write(root: Path, a: argparse.Namespace, *, layout: str, noise: float = 0.0) -> Path:
    """``layout``: "full" (one rank), "tp2" (two ranks) or "calls" (one rank, calls)."""
    ranks = 2 if layout == "tp2" else 1
    gen = torch.Generator().manual_seed(7)
    dims = {r"\.tp\d+$": "s h(tp)", r"\.partial\d+$": "s h(tp,partial)"}
    for rank in range(ranks):
        os.environ["RANK"] = str(rank)
        rec = Recorder(root, level="module", parallel={"tp": (rank, ranks)} if ranks > 1 else None,
                       dims=dims, background_write=False)
        for p in range(a.passes):
            for e in range(a.entries):
                kind = _kind(e, a.mixed)
                t = _values(p, e, a.seq, a.hidden, noise, gen)
                key = f"model.layers.{e}.{kind}{e}"
                if layout == "tp2":
                    t = t.chunk(2, 1)[rank] if kind == "tp" else (t / 2 if kind == "partial" else t)
                if layout == "calls":
                    for c, piece in enumerate(t.chunk(a.calls, 0)):
                        rec.record(key + (f"::call{c}" if c else ""), piece, module_type="Linear")
                else:
                    rec.record(key, t, module_type="Linear")
            rec.step()
        rec.close()
    os.environ.pop("RANK", None)
    return root


def pass_bytes(*roots: Path) -> int:
    return sum(f.stat().st_size for r in roots for f in r.rglob("pass*.pt"))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--entries", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mixed", action="store_true")
    parser.add_argument("--dir", default=None)
    a = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tdinspect-bench-unshard-", dir=a.dir))
    try:
        ref = write(root / "ref", a, layout="full")
        rerun = write(root / "rerun", a, layout="full", noise=1e-6)
        tp2 = write(root / "tp2", a, layout="tp2", noise=1e-6)
        calls = write(root / "calls", a, layout="calls", noise=1e-6)
        runs = {
            "plain": (lambda: DumpSet.open(ref).diff(rerun).table(progress=False),
                      pass_bytes(ref, rerun)),
            "unshard": (lambda: DumpSet.open(ref).diff(tp2, unshard=True).table(progress=False),
                        pass_bytes(ref, tp2)),
            "concat": (lambda: DumpSet.open(ref).diff(calls, concat="call:0").table(progress=False),
                       pass_bytes(ref, calls)),
        }
        for fn, _ in runs.values():  # warm the page cache and the kernels
            fn()
        times = {k: [] for k in runs}
        for _ in range(a.rounds):
            for k, (fn, _) in runs.items():
                times[k].append(timed(fn))
        plain = runs["plain"][1] / statistics.median(times["plain"])
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {a.passes} passes x "
              f"{a.entries} entries of [{a.seq}, {a.hidden}] float32"
              + (" (mixed: 1/2 tp, 1/4 partial, 1/4 replicated)" if a.mixed else " (all tp)"))
        for k, (_, nbytes) in runs.items():
            rate = nbytes / statistics.median(times[k])
            print(f"  {k:8s} {nbytes / 1e6:7.1f} MB read  {rate / 1e9:5.2f} GB/s  "
                  f"ratio to plain {rate / plain:.2f} (target >= 0.8)  "
                  f"runs {', '.join(f'{t:.3f}' for t in times[k])} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
