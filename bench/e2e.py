"""End to end against the read-and-compare floor, with and without sidecars; many small entries.

Run: ``python bench/e2e.py [--passes 8] [--entries 60] [--numel 131072] [--small-entries
100000] [--small-numel 16] [--rounds 5] [--dir D]``. In one run, on files it writes
and removes:

1. **end to end**: ``DumpSet.open(a)``, ``.diff(b)`` (opens ``b``),
   ``first_divergence()`` (the divergence is in the last pass: every pass is
   read) and the metrics cube ``to_xarray()``, against the floor on the same
   files: ``torch.load(mmap=True, weights_only=True)`` of both pass files and
   ``(a - b).abs().max()`` per pair. Two dumps: one written by another tool
   (plain ``torch.save`` of ``{name: tensor}`` in ``rank0_pid1/passNNNNN.pt``,
   no sidecar) and the same tensors written by tdinspect (sidecars);
2. **many small entries**: one pass of ``--small-entries`` entries of
   ``--small-numel`` float32, ``diff().table()`` against the floor: the faster
   of the two loads (``torch.load`` mapped, or the records read as the sidecar
   lays them out) + ``(a - b).abs().max()`` per pair.

3. **the compiled kernel on dask workers**: a ``LocalCluster`` of 2 worker
   processes, each asked for its first comparison of a pair big enough for the
   numba kernel; the time (numba's import included) and whether the kernel came
   from numba's on-disk cache or was compiled;
4. **the CLI on the sample dumps**: ``tdinspect diff`` and
   ``tdinspect first-divergence`` (``sample_dumps/float32`` against
   ``wrong_layer``) against ``python -c "import torch"``, fresh processes.

Rounds alternate floor and ours (drifts of a shared machine hit both alike), each
timed call after a pause for the threads of the one before (``common.settle``);
medians and minima are reported, with the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import settle, synthetic_run  # noqa: E402

from tdinspect import DumpSet  # noqa: E402
from tdinspect.store.rawpass import read_raw  # noqa: E402


def other_tool_run(root: Path, like: Path) -> Path:
    """The tensors of tdinspect dump ``like`` saved as another tool would: one plain
    ``torch.save`` per pass, no sidecar, no manifest."""
    folder = root / "rank0_pid1"
    folder.mkdir(parents=True)
    for f in sorted(like.rglob("pass*.pt")):
        tensors = torch.load(f, weights_only=True)
        torch.save({k: v.clone() for k, v in tensors.items()}, folder / f.name)
    return root


def pass_files(path: Path) -> list[Path]:
    return sorted(path.rglob("pass*.pt"))


def one_thread(fn):
    """``fn`` run with one torch intra-op thread: on a loaded machine torch's thread pool
    waits on busy cores (the floor then took 10x longer), so each floor is measured both
    ways and the faster (the stricter floor) is used."""

    def run(*args):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(before)

    return run


def floor_mmap(a: Path, b: Path) -> float:
    """Seconds to load both sides' pass files (mapped) and take ``(a - b).abs().max()`` per pair."""
    t0 = time.perf_counter()
    for fa, fb in zip(pass_files(a), pass_files(b)):
        ta = torch.load(fa, mmap=True, weights_only=True)
        tb = torch.load(fb, mmap=True, weights_only=True)
        for k, x in ta.items():
            (x - tb[k]).abs().max()
    return time.perf_counter() - t0


def floor_raw(pa, pb) -> float:
    """The same from the records the sidecars lay out (no unpickling), for opened passes."""
    t0 = time.perf_counter()
    ta = read_raw(pa.files.tensors, pa.keys, pa.raw)
    tb = read_raw(pb.files.tensors, pb.keys, pb.raw)
    for k, x in ta.items():
        (x - tb[k]).abs().max()
    return time.perf_counter() - t0


def end_to_end(a: Path, b: Path) -> tuple[float, object]:
    t0 = time.perf_counter()
    diff = DumpSet.open(a).diff(b)
    div = diff.first_divergence()
    diff.to_xarray()
    return time.perf_counter() - t0, div


def small_diff(a: Path, b: Path) -> float:
    A, B = DumpSet.open(a), DumpSet.open(b)
    t0 = time.perf_counter()
    A.diff(B).table(progress=False)
    return time.perf_counter() - t0


def alternate(rounds: int, cases: dict) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():  # warm: page cache, imports, the kernel
        fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            settle()  # torch's OpenMP workers of the call before spin on (common.settle)
            times[name].append(fn())
    return times


def line(name: str, ours: list[float], floor: list[float]) -> str:
    mo, mf = statistics.median(ours), statistics.median(floor)
    return (
        f"  {name:32s} ours {mo:7.3f} s (min {min(ours):.3f})  floor {mf:7.3f} s "
        f"(min {min(floor):.3f})  ratio {mf / mo:.2f} (of minima {min(floor) / min(ours):.2f})"
    )


def first_big_pair() -> tuple[float, int, int]:
    """(seconds, kernels loaded from numba's cache, kernels compiled) of this process's first
    comparison of a pair of 2^17 float32 (run on a worker)."""
    t0 = time.perf_counter()
    from tdinspect.numerics import kernels
    from tdinspect.numerics.metrics import compare_tensors

    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(0))
    compare_tensors(x * 1.001, x)
    seconds = time.perf_counter() - t0
    # the compiled loops (one per codec) that this process made: numba dispatchers
    loops = [d for d in (kernels._NUMBA_KERNELS or {}).values() if hasattr(d, "stats")]
    return (
        seconds,
        sum(sum(d.stats.cache_hits.values()) for d in loops),
        sum(sum(d.stats.cache_misses.values()) for d in loops),
    )


def workers_first_diff() -> list[tuple[float, int, int]]:
    from dask.distributed import Client, LocalCluster

    first_big_pair()  # the client first: the kernel is then in numba's on-disk cache
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        workers = list(client.scheduler_info()["workers"])
        futures = [client.submit(first_big_pair, pure=False, workers=[w]) for w in workers]
        return client.gather(futures)


def cli_rounds(rounds: int) -> dict[str, list[float]]:
    root = Path(__file__).resolve().parent.parent / "sample_dumps"
    a, b = str(root / "float32"), str(root / "wrong_layer")
    py = sys.executable
    cases = {
        "import torch": [py, "-c", "import torch"],
        "tdinspect diff": [py, "-m", "tdinspect", "diff", a, b],
        "tdinspect first-divergence": [py, "-m", "tdinspect", "first-divergence", a, b],
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, cmd in cases.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, check=False)
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--entries", type=int, default=60)
    ap.add_argument("--numel", type=int, default=128 * 1024)
    ap.add_argument("--small-entries", type=int, default=100_000)
    ap.add_argument("--small-numel", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--skip", default="", help="comma-separated: e2e, small, cluster, cli")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    root = Path(tempfile.mkdtemp(prefix="tdinspect-bench-e2e-", dir=args.dir))
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    try:
        if "e2e" not in skip:
            shape = (args.passes, args.entries, args.numel)
            a = synthetic_run(root / "a", *shape, seed=1)
            b = synthetic_run(
                root / "b", *shape, seed=2, noise=1e-4, perturb=(args.passes - 1, args.entries // 2)
            )
            a0, b0 = other_tool_run(root / "a0", a), other_tool_run(root / "b0", b)
            divs = {}

            def ours(x, y, name):
                def run():
                    t, divs[name] = end_to_end(x, y)
                    return t

                return run

            times = alternate(
                args.rounds,
                {
                    "floor (no sidecars)": lambda: floor_mmap(a0, b0),
                    "floor1 (no sidecars)": lambda: one_thread(floor_mmap)(a0, b0),
                    "ours (no sidecars)": ours(a0, b0, "bare"),
                    "floor (sidecars)": lambda: floor_mmap(a, b),
                    "floor1 (sidecars)": lambda: one_thread(floor_mmap)(a, b),
                    "ours (sidecars)": ours(a, b, "sidecars"),
                },
            )
            for kind in ("no sidecars", "sidecars"):
                print(
                    f"  floor {kind}: {statistics.median(times[f'floor ({kind})']):.3f} s with "
                    f"{torch.get_num_threads()} torch threads, "
                    f"{statistics.median(times[f'floor1 ({kind})']):.3f} s with one"
                )
                times[f"floor ({kind})"] = [
                    min(p, q) for p, q in zip(times[f"floor ({kind})"], times[f"floor1 ({kind})"])
                ]
            gb = 2 * args.passes * args.entries * args.numel * 4 / 1e9
            print(
                f"end to end, {args.passes} passes x {args.entries} entries of {args.numel} "
                f"float32 ({gb:.2f} GB compared), medians of {args.rounds} rounds; "
                f"first divergence {divs['bare'].key} pass {divs['bare'].pass_}:"
            )
            assert divs["bare"].key == divs["sidecars"].key
            print(
                line(
                    "without sidecars (other tool)", times["ours (no sidecars)"], times["floor (no sidecars)"]
                )
            )
            print(line("with sidecars (tdinspect)", times["ours (sidecars)"], times["floor (sidecars)"]))
        if "small" not in skip:
            n, numel = args.small_entries, args.small_numel
            x = synthetic_run(root / "small_a", 1, n, numel, seed=1)
            y = synthetic_run(root / "small_b", 1, n, numel, seed=2, noise=1e-3)
            pa, pb = DumpSet.open(x).get_pass(0), DumpSet.open(y).get_pass(0)
            times = alternate(
                args.rounds,
                {
                    "floor mmap": lambda: floor_mmap(x, y),
                    "floor raw": lambda: floor_raw(pa, pb),
                    "floor raw, one thread": lambda: one_thread(floor_raw)(pa, pb),
                    "ours": lambda: small_diff(x, y),
                },
            )
            floor = [
                min(m, r, r1)
                for m, r, r1 in zip(times["floor mmap"], times["floor raw"], times["floor raw, one thread"])
            ]
            print(
                f"one pass of {n} entries of {numel} float32 (diff().table(), open excluded), "
                f"medians of {args.rounds} rounds; floor mapped "
                f"{statistics.median(times['floor mmap']):.3f} s, raw "
                f"{statistics.median(times['floor raw']):.3f} s, raw with one torch thread "
                f"{statistics.median(times['floor raw, one thread']):.3f} s:"
            )
            print(line("many small entries", times["ours"], floor))
            per = statistics.median(times["ours"]) / n * 1e6
            print(f"  ours {per:.1f} us an entry, floor {statistics.median(floor) / n * 1e6:.1f} us an entry")
        if "cluster" not in skip:
            for i, (t, hits, compiled) in enumerate(workers_first_diff()):
                print(
                    f"LocalCluster worker {i}: first big pair {t:.2f} s (numba import included), "
                    f"kernels from the on-disk cache {hits}, compiled {compiled}"
                )
        if "cli" not in skip:
            times = cli_rounds(args.rounds)
            base = statistics.median(times["import torch"])
            print(f"CLI on the sample dumps, medians of {args.rounds} rounds:")
            for name, v in times.items():
                print(
                    f"  {name:28s} {statistics.median(v):.2f} s (min {min(v):.2f}), "
                    f"{statistics.median(v) / base:.2f}x import torch"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
