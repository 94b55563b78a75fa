"""Analysis speed: open time, diff throughput against the least any diff must do, early exit.

Run: ``python bench/diff.py``. In one run, on files it writes and removes:

1. open time of a 100-pass x 1,500-entry dump with sidecars, and of the same
   dump without them (keys, shapes and dtypes from a memory-mapped load);
2. diff throughput (bytes of both runs compared per second, all metrics)
   against the floor: ``torch.load(mmap=True, weights_only=True)`` both pass
   files and compute ``(a - b).abs().max()`` per pair, on the same files
   (medians of ``--rounds`` alternating runs, both warmed first, each timed
   call after a pause for the threads of the one before: ``common.settle``);
3. ``first_divergence`` with the divergence in pass 0 vs a full diff;
4. the same ratio for float32, bfloat16, float16, float8_e4m3fn and
   float8_e5m2 dumps, tensors of ``--dtype-sizes`` bytes each (1 KB to 1 GB;
   2 passes, as many entries as make ~16 MB a pass, at most 1,000). The floor
   for each dtype is the cheapest torch compare of the same bytes: the
   fastest, measured on the pair, of ``(a - b).abs().max()`` in the stored
   dtype (torch has no float8 subtraction), the same a million elements at
   a time into a reused buffer, and ``(a.float() - b.float()).abs().max()``
   a million elements at a time into reused buffers;
5. the same ratio for one pass of ``--small-entries`` small tensors
   (``--small-numel`` elements): the per-entry overhead.

``--loop-only``: the compiled loop alone, in memory, on one thread, against the
same three compares on one torch thread (``--loop-numel`` elements a side, every
dtype of ``--dtypes``, calls interleaved for ``--rounds`` rounds): the
arithmetic, without files, page cache or the scheduler's treatment of torch's
two threads on a busy machine (which swings section 4 by 2x and more).
"""

from __future__ import annotations

import argparse
import functools
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import scratch_dir, settle  # noqa: E402
from common import synthetic_run as write_run

from tdinspect import DumpSet  # noqa: E402
from tdinspect.dumper.recorder import Recorder  # noqa: E402
from tdinspect.numerics import kernels

CHUNK = 1 << 20
_BUFFERS: dict = {}


def _buffer(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A scratch tensor reused across calls (no fresh pages for every compare)."""
    buf = _BUFFERS.get((name, dtype))  # by dtype too: --loop-only interleaves dtypes
    if buf is None or buf.numel() < numel:
        buf = _BUFFERS[name, dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def native_abs_max(x: torch.Tensor, y: torch.Tensor) -> None:
    """The floor's compare in the stored dtype, whole tensors."""
    (x - y).abs().max()


def native_chunked(x: torch.Tensor, y: torch.Tensor) -> None:
    """The same a million elements at a time into one reused buffer."""
    for i in range(0, x.numel(), CHUNK):
        d = _buffer("d", min(CHUNK, x.numel() - i), x.dtype)
        torch.sub(x[i : i + CHUNK], y[i : i + CHUNK], out=d)
        d.abs_().max()


def widened_chunked(x: torch.Tensor, y: torch.Tensor) -> None:
    """Widened to float32 a million elements at a time into reused buffers (all torch can
    do for float8, which has no subtraction)."""
    for i in range(0, x.numel(), CHUNK):
        k = min(CHUNK, x.numel() - i)
        a, b = _buffer("a", k, torch.float32), _buffer("b", k, torch.float32)
        a.copy_(x[i : i + k])
        b.copy_(y[i : i + k])
        a.sub_(b).abs_().max()


COMPARES = (native_abs_max, native_chunked, widened_chunked)


def _abs_max_diff(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.element_size() == 1 and x.is_floating_point():  # no float8 arithmetic in torch
        x, y = x.float(), y.float()
    (x - y).abs().max()


def cheapest_compare(a: DumpSet, b: DumpSet):
    """The fastest of :data:`COMPARES` on these dumps (best of two runs each): the floor of a
    narrow dtype is the least torch does to compare its bytes. Returns it and each one's
    throughput (bytes/s)."""
    speeds = {}
    for compare in COMPARES:
        try:
            speeds[compare] = max(floor_throughput(a, b, compare, settled=True) for _ in range(2))
        except (RuntimeError, NotImplementedError):  # float8 has no subtraction
            continue
    return max(speeds, key=speeds.get), speeds


def ratio(a: DumpSet, b: DumpSet, rounds: int, compare=_abs_max_diff) -> tuple[float, float, float]:
    """``(ours, floor, seconds of one diff)`` in bytes/s, medians of alternating rounds."""
    floors, times, total, _ = alternate(a, b, rounds, compare)
    t = statistics.median(times)
    return total / t, statistics.median(floors), t


def alternate(a: DumpSet, b: DumpSet, rounds: int, compare=_abs_max_diff) -> tuple[list, list, int, float]:
    """Floor throughputs and diff times of ``rounds`` alternating rounds (drifts hit both
    alike) after one untimed warm-up of each, the bytes a diff compares, and the seconds of
    the warm-up diff (the first of the process pays the kernel's load)."""
    floor_throughput(a, b, compare)
    t0 = time.perf_counter()
    a.diff(b).table(progress=False)
    first = time.perf_counter() - t0
    floors, times = [], []
    for _ in range(rounds):
        floors.append(floor_throughput(a, b, compare, settled=True))
        settle()
        t0 = time.perf_counter()
        a.diff(b).table(progress=False)
        times.append(time.perf_counter() - t0)
    total = sum(
        2 * math.prod(s) * getattr(torch, str(d).removeprefix("torch.")).itemsize
        for pa in a.pass_indexes()
        for s, d in zip(pa.shape, pa.dtype)
    )
    return floors, times, total, first


def floor_throughput(a: DumpSet, b: DumpSet, compare=_abs_max_diff, settled: bool = False) -> float:
    """Bytes per second of the floor: both pass files mapped by ``torch.load``, ``compare``
    on each pair (``settled``: after :func:`common.settle`, as a side-by-side round times
    each call)."""
    if settled:
        settle()
    t0 = time.perf_counter()
    total = 0
    for pa in a.pass_indexes():
        pb = b.get_pass(pa.index, pa.rank)
        ta = torch.load(pa.files.tensors, mmap=True, weights_only=True)
        tb = torch.load(pb.files.tensors, mmap=True, weights_only=True)
        for k, x in ta.items():
            compare(x, tb[k])
            total += 2 * x.numel() * x.element_size()
    return total / (time.perf_counter() - t0)


def narrow_run(
    root: Path, passes: int, entries: int, numel: int, dtype: torch.dtype, *, noise: float = 0.0
) -> Path:
    """A dump of ``passes`` x ``entries`` tensors of ``numel`` elements of ``dtype``, filled a
    million elements at a time from one random block (scaled per block, plus ``noise``), so
    that 1 GB tensors need no 4 GB float32 source."""
    block = min(numel, CHUNK)
    base = torch.randn(block, generator=torch.Generator().manual_seed(0))
    jitter = noise * torch.randn(block, generator=torch.Generator().manual_seed(1))
    rec = Recorder(root, level="module", max_pending_bytes=64 << 20)
    for p in range(passes):
        for e in range(entries):
            t = torch.empty(numel, dtype=dtype)
            for j, i in enumerate(range(0, numel, block)):
                k = min(block, numel - i)
                v = base[:k] * (1 + ((p * 7 + e + j) % 13) / 13)
                t[i : i + k] = (v + jitter[:k]).to(dtype) if noise else v.to(dtype)
            rec.record(f"model.layers.{e // 10}.op{e % 10}", t, module_type="Linear")
        rec.step()
    rec.close()
    return root


def parse_size(text: str) -> int:
    """``"1K"`` -> 1024, ``"16M"``, ``"1G"``."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def narrow_floats(root: Path, args) -> None:
    """4. float32, bfloat16, float16 and float8 dumps by tensor size (decoded in the kernel's
    loop), each against the cheapest torch compare of its bytes."""
    for size in (parse_size(v) for v in args.dtype_sizes.split(",")):
        entries = max(1, min(1000, (16 << 20) // size))
        for name in args.dtypes.split(","):
            dt = getattr(torch, name)
            numel = size // dt.itemsize
            x = narrow_run(root / f"{name}_a", 2, entries, numel, dt)
            y = narrow_run(root / f"{name}_b", 2, entries, numel, dt, noise=1e-2)
            a, b = DumpSet.open(x), DumpSet.open(y)
            compare, speeds = cheapest_compare(a, b)
            floors, times, total, _ = alternate(a, b, args.rounds, compare)
            ours, floor = total / statistics.median(times), statistics.median(floors)
            best, best_floor = total / min(times), max(floors)
            print(
                f"{name:14s} {size:>13,} B a tensor x {entries:4d} x 2 passes: {ours / 1e9:6.2f} "
                f"GB/s, floor {floor / 1e9:6.2f} GB/s ({compare.__name__}), ratio "
                f"{ours / floor:4.0%} (medians); best rounds {best / 1e9:6.2f} vs "
                f"{best_floor / 1e9:6.2f} GB/s, {best / best_floor:4.0%}; the floor's compares "
                + ", ".join(f"{c.__name__} {v / 1e9:.2f}" for c, v in speeds.items()),
                flush=True,
            )
            shutil.rmtree(x)
            shutil.rmtree(y)


def loop_only(args) -> None:
    """The fused loop alone against the cheapest torch compare, one thread each, in memory."""
    torch.set_num_threads(1)
    base = torch.randn(args.loop_numel, generator=torch.Generator().manual_seed(0))
    other = base + 1e-2 * torch.randn(args.loop_numel, generator=torch.Generator().manual_seed(1))
    cases = {}
    for name in args.dtypes.split(","):
        dt = getattr(torch, name)
        x, y = base.to(dt), other.to(dt)
        bits = {1: torch.uint8, 2: torch.uint16}.get(dt.itemsize)
        xa, ya = (t.numpy() if bits is None else t.view(bits).numpy() for t in (x, y))
        codes = None if bits is None else name

        def ours(xa=xa, ya=ya, codes=codes):
            kernels.pair_sums(xa, ya, rtol=1e-3, atol=1e-5, backend="numba", codes=codes)

        ours()  # compiled, or loaded from numba's cache
        floors = {}
        for compare in COMPARES:
            try:
                compare(x, y)
            except (RuntimeError, NotImplementedError):  # float8 has no subtraction
                continue
            floors[compare] = functools.partial(compare, x, y)
        cases[name] = (ours, floors)
    times: dict = {}
    for _ in range(args.rounds):
        for name, (ours, floors) in cases.items():
            for key, fn in ((name, ours), *(((name, c), f) for c, f in floors.items())):
                t0 = time.perf_counter()
                fn()
                times.setdefault(key, []).append(time.perf_counter() - t0)
    n = args.loop_numel
    for name, (_, floors) in cases.items():
        best = min(floors, key=lambda c: min(times[(name, c)]))
        ours, floor = min(times[name]), min(times[(name, best)])
        med, fmed = statistics.median(times[name]), statistics.median(times[(name, best)])
        print(
            f"{name:14s} loop {n / ours / 1e9:5.2f} G elements/s, floor {n / floor / 1e9:5.2f} "
            f"({best.__name__}): {floor / ours:4.0%} (fastest calls), {fmed / med:4.0%} (medians)",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--entries", type=int, default=20)
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--dtype-sizes",
        default="1K,64K,1M,16M,256M",
        help="bytes a tensor in section 4 (K, M, G suffixes; 1G needs ~5 GB free)",
    )
    parser.add_argument("--dtypes", default="float32,bfloat16,float16,float8_e4m3fn,float8_e5m2")
    parser.add_argument("--dtypes-only", action="store_true", help="run section 4 alone")
    parser.add_argument(
        "--loop-only", action="store_true", help="the compiled loop alone, one thread, in memory (see above)"
    )
    parser.add_argument("--loop-numel", type=int, default=1 << 22)
    parser.add_argument("--small-entries", type=int, default=10_000)
    parser.add_argument("--small-numel", type=int, default=256)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    if args.loop_only:
        loop_only(args)
        return
    with scratch_dir("diff", args.dir) as root:
        if args.dtypes_only:
            narrow_floats(root, args)
            return
        # 1. open time, 100 passes x 1,500 small entries
        meta = write_run(root / "meta", 100, 1500, 16, seed=0)
        t0 = time.perf_counter()
        ds = DumpSet.open(meta)
        t_open = time.perf_counter() - t0
        for f in meta.rglob("*.json"):
            f.unlink()
        t0 = time.perf_counter()
        DumpSet.open(meta)
        t_open_bare = time.perf_counter() - t0
        print(
            f"open 100 passes x 1500 entries: {t_open:.2f} s with sidecars (target < 1 s), "
            f"{t_open_bare:.2f} s without ({ds.n_entries()} entries)"
        )
        shutil.rmtree(meta)

        # 2. throughput on big tensors; 3. early exit
        shape = (args.passes, args.entries, args.numel)
        a = write_run(root / "a", *shape, seed=1)
        b = write_run(root / "b", *shape, seed=2, noise=1e-4, perturb=(args.passes - 1, args.entries // 2))
        c = write_run(root / "c", *shape, seed=3, noise=1e-4, perturb=(0, args.entries // 2))
        A, B, C = DumpSet.open(a), DumpSet.open(b), DumpSet.open(c)
        # the warm-up of both sides (page cache, the kernel's numba import and compilation or
        # its on-disk cache) is a once-per-process cost, reported on its own
        floors, times, run_bytes, t_first = alternate(A, B, args.rounds)
        floor, t_full = statistics.median(floors), statistics.median(times)
        ours = run_bytes / t_full
        print(
            f"diff throughput, all metrics ({kernels.default_backend()} kernel): "
            f"{ours / 1e9:.2f} GB/s; floor (mmap load + (a-b).abs().max()): {floor / 1e9:.2f} GB/s; "
            f"ratio {ours / floor:.0%} (target >= 50%); medians of {args.rounds} rounds, "
            f"{run_bytes / 1e9:.2f} GB compared, {args.passes * args.entries} entries; first "
            f"diff in this process (kernel load included) {t_first:.2f} s"
        )
        t0 = time.perf_counter()
        div = A.diff(C).first_divergence()
        t_first = time.perf_counter() - t0
        print(
            f"first_divergence at pass 0: {t_first:.3f} s vs full diff {t_full:.2f} s "
            f"({t_first / t_full:.1%}); found {div.key} pass {div.pass_}"
        )
        for d in (a, b, c):
            shutil.rmtree(d)

        narrow_floats(root, args)  # 4.

        # 5. one pass of many small entries: the per-entry overhead
        x = write_run(root / "small_a", 1, args.small_entries, args.small_numel, seed=1)
        y = write_run(root / "small_b", 1, args.small_entries, args.small_numel, seed=2, noise=1e-3)
        ours, floor, t = ratio(DumpSet.open(x), DumpSet.open(y), args.rounds)
        print(
            f"{args.small_entries} entries of {args.small_numel} float32: diff {t:.2f} s "
            f"({t / args.small_entries * 1e6:.0f} us an entry), ratio to the floor {ours / floor:.0%}"
        )


if __name__ == "__main__":
    main()
