"""Diff throughput with unsharding and concatenation, as a ratio of the plain diff of the same bytes.

Run: ``python bench/unshard.py [--mixed] [--checksum] [--clock cpu] [--calls-plain]``. On files
it writes and removes, float32, two runs that differ by float32-sized noise, each ``--passes`` x
``--entries`` tensors ``[seq, hidden]``:

- unshard: both runs 2-way tensor parallel (each rank holds half of ``hidden``: dims
  ``"s h(tp)"``; with ``--mixed``, a quarter of the entries are partial sums
  ``"s h(tp,partial)"`` and a quarter replicated, the same bits on both ranks; with
  ``--checksum`` the replicas are settled from capture's checksums instead of a bitwise
  comparison when read); ``diff(unshard=True)`` against the plain diff of the same files
  (rank by rank: it reads every byte the unsharded diff reads);
- unshard fused: the same files opened with the ``s h(tp)`` entries' dims given as a fused
  qkv, ``s h(tp,fused=q:H/2,k:H/4,v:H/4)`` (each rank's half cut into three segments, put back
  segment by segment); ``diff(unshard=True)`` against the plain unshard of the same bytes;
- concat: both runs decode-like, each entry ``--calls`` calls of ``seq / calls`` positions;
  ``diff(concat="call:0")`` against the plain diff of the same values stored as whole entries
  (one call each: what the concatenated diff compares). That baseline stores 1/calls as many
  records, so it also spares the per-record cost of opening and indexing the files, which
  concat cannot avoid: the bench measures that cost (``calls read`` / ``whole read``: open
  every pass and index its records, no tensor compared) and also gives the ratio with it
  added to the baseline (``layout-corrected``). ``--calls-plain`` adds the plain diff of
  the per-call files (call by call); each small pair costs a full comparison, so that row
  is slow.

Throughput is bytes of pass files read (both sides) per second; each configuration is timed
``--rounds`` times, interleaved, after one warm-up run each, and the median taken. ``--clock
cpu`` times by this process's CPU time (all its threads), which other jobs on a shared
machine disturb far less than the wall clock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import scratch_dir  # noqa: E402

from tdinspect import DumpSet  # noqa: E402
from tdinspect.dumper.recorder import Recorder  # noqa: E402


def _values(p: int, e: int, seq: int, hidden: int, noise: float) -> torch.Tensor:
    """Entry ``e`` of pass ``p``: the same on every rank (a replica is one), noise included."""
    base = torch.randn(seq, hidden, generator=torch.Generator().manual_seed(p * 1000 + e))
    gen = torch.Generator().manual_seed(10**6 + p * 1000 + e)
    return base + noise * torch.randn(seq, hidden, generator=gen) if noise else base


def _kind(e: int, mixed: bool) -> str:
    return ("partial" if e % 4 == 2 else "replicated" if e % 4 == 3 else "tp") if mixed else "tp"


def write(root: Path, a: argparse.Namespace, *, layout: str, noise: float = 0.0) -> Path:
    """``layout``: "full" (one rank), "tp2" (two ranks) or "calls" (one rank, calls)."""
    ranks = 2 if layout == "tp2" else 1
    dims = {r"\.tp\d+$": "s h(tp)", r"\.partial\d+$": "s h(tp,partial)"}
    for rank in range(ranks):
        os.environ["RANK"] = str(rank)
        rec = Recorder(
            root,
            level="module",
            parallel={"tp": (rank, ranks)} if ranks > 1 else None,
            dims=dims,
            background_write=False,
            checksum=a.checksum,
        )
        for p in range(a.passes):
            for e in range(a.entries):
                kind = _kind(e, a.mixed)
                t = _values(p, e, a.seq, a.hidden, noise)
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


def read_only(root: Path):
    """Open every pass of a dump and index its records: the per-record cost, nothing compared."""

    def run():
        for pi in DumpSet.open(root)._passes.values():
            pi.load()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--entries", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mixed", action="store_true")
    parser.add_argument(
        "--checksum", action="store_true", help="capture checksums: replicated entries are settled from them"
    )
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument(
        "--calls-plain", action="store_true", help="also time the plain diff of the per-call files (slow)"
    )
    parser.add_argument("--dir", default=None)
    a = parser.parse_args()
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    with scratch_dir("unshard", a.dir) as root:
        h = a.hidden
        fused = {r"\.tp\d+$": f"s h(tp,fused=q:{h // 2},k:{h // 4},v:{h // 4})"}
        tp2a, tp2b = (write(root / f"tp2{s}", a, layout="tp2", noise=n) for s, n in (("a", 0.0), ("b", 1e-6)))
        ca, cb = (write(root / f"calls{s}", a, layout="calls", noise=n) for s, n in (("a", 0.0), ("b", 1e-6)))
        fa, fb = (write(root / f"full{s}", a, layout="full", noise=n) for s, n in (("a", 0.0), ("b", 1e-6)))

        def diff(x, y, dims=None, **kw):
            return lambda: (
                DumpSet.open(x, dims=dims).diff(DumpSet.open(y, dims=dims), **kw).table(progress=False)
            )

        def both(f, g):
            return lambda: (f(), g())

        runs = {
            "tp2 plain": (diff(tp2a, tp2b), pass_bytes(tp2a, tp2b)),
            "unshard": (diff(tp2a, tp2b, unshard=True), pass_bytes(tp2a, tp2b)),
            "unshard fused": (diff(tp2a, tp2b, fused, unshard=True), pass_bytes(tp2a, tp2b)),
            "whole plain": (diff(fa, fb), pass_bytes(fa, fb)),
            "concat": (diff(ca, cb, concat="call:0"), pass_bytes(ca, cb)),
            "whole read": (both(read_only(fa), read_only(fb)), pass_bytes(fa, fb)),
            "calls read": (both(read_only(ca), read_only(cb)), pass_bytes(ca, cb)),
        }
        if a.calls_plain:
            runs["calls plain"] = (diff(ca, cb), pass_bytes(ca, cb))
        for k, (fn, _) in runs.items():  # warm the page cache and the kernels
            out = fn()
            if " read" not in k and out["structural"].any():  # a bench that compares nothing
                raise SystemExit(f"{k}: structural rows; the dumps are not what the bench means")
        times = {k: [] for k in runs}
        for _ in range(a.rounds):
            for k, (fn, _) in runs.items():
                t0 = clock()
                fn()
                times[k].append(clock() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        rate = {k: nbytes / med[k] for k, (_, nbytes) in runs.items()}
        base = {"unshard": rate["tp2 plain"], "unshard fused": rate["unshard"], "concat": rate["whole plain"]}
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.clock} clock; "
            f"{a.passes} passes x {a.entries} entries of [{a.seq}, {a.hidden}] float32"
            + (" (mixed: 1/2 tp, 1/4 partial, 1/4 replicated)" if a.mixed else " (all tp)")
            + (", checksums" if a.checksum else "")
            + f"; load {os.getloadavg()[0]:.1f}"
        )
        for k, (_, nbytes) in runs.items():
            ratio = (
                f"ratio to {'unshard' if k == 'unshard fused' else 'plain'} {rate[k] / base[k]:.2f} (target >= 0.8)"
                if k in base
                else ""
            )
            print(
                f"  {k:13s} {nbytes / 1e6:7.1f} MB read  {rate[k] / 1e9:6.2f} GB/s  {ratio:34s}"
                f"runs {', '.join(f'{t:.3f}' for t in times[k])} s"
            )
        layout = med["calls read"] - med["whole read"]
        print(
            f"  per-record cost of the per-call layout: {layout * 1e3:.1f} ms a diff "
            f"({med['calls read'] * 1e3:.1f} vs {med['whole read'] * 1e3:.1f} ms to open and "
            f"index); concat layout-corrected ratio "
            f"{(med['whole plain'] + layout) / med['concat']:.2f}"
        )


if __name__ == "__main__":
    main()
