"""Scale: a dump several times larger than the memory budget, opened and diffed with bounded memory.

Run: ``python bench/scale.py [--gb 4] [--passes 50]``. Builds two runs of
``--gb`` GB each (``--passes`` passes of 4 MB float32 entries; the second run
has small noise everywhere), then reports, in one run:

- peak resident memory (VmHWM, each operation in a fresh process, imports of
  torch, xarray and pandas included: about 260 MB) of open,
  full diff and first_divergence;
- diff throughput single-threaded, on the local thread pool
  (:mod:`tdinspect.util.parallel`) and on a ``dask.distributed.LocalCluster``
  (2 worker processes);
- first_divergence with the divergence at pass 0, in the middle and at the
  last pass, as a fraction of the full diff of the same pair (variants share
  the reference's files through symbolic links, except the perturbed pass).

Everything it writes is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import scratch_dir, synthetic_run  # noqa: E402

from tdinspect import DumpSet  # noqa: E402
from tdinspect.dumper.recorder import Recorder  # noqa: E402

ENTRY = 1 << 20  # float32 elements per entry: 4 MB

PROBE = """
import json, sys, time
from tdinspect import DumpSet
import tdinspect.util.parallel
what, a, b = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
ds = DumpSet.open(a)
if what == "diff":
    ds.diff(b).table(progress=False)
elif what == "first":
    ds.diff(b).first_divergence()
# VmHWM: this process image's peak RSS (ru_maxrss would carry the parent's across exec)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"rss_mb": int(hwm) / 1024, "s": time.perf_counter() - t0}))
"""


def variant(ref: Path, out: Path, perturb_pass: int) -> Path:
    """``ref`` with one pass changed: every other file is a symbolic link."""
    (src,) = [p for p in ref.iterdir() if p.is_dir()]
    dst = out / src.name
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name.startswith(f"pass{perturb_pass:05d}."):
            continue
        os.symlink(f, dst / f.name)
    tensors = torch.load(src / f"pass{perturb_pass:05d}.pt", weights_only=True)
    rec = Recorder(out, level="module")
    if rec.folder != dst:
        shutil.rmtree(rec.folder)  # the recorder's own new run folder (its run.json): unused
    rec.folder, rec.pass_index = dst, perturb_pass
    rec._pass.folder, rec._pass.index = dst, perturb_pass
    for i, (k, t) in enumerate(tensors.items()):
        rec.record(k, t * 1.1 if i == len(tensors) // 2 else t, module_type="Linear")
    rec.step()
    rec.close(write_pending=False)
    return out


def probe(what: str, a: Path, b: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, what, str(a), str(b)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gb", type=float, default=4.0, help="size of each run")
    parser.add_argument("--passes", type=int, default=50)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    entries = max(1, int(args.gb * 1e9 / (args.passes * ENTRY * 4)))
    with scratch_dir("scale", args.dir) as root:
        t0 = time.perf_counter()
        a = synthetic_run(root / "a", args.passes, entries, ENTRY, seed=1)
        b = synthetic_run(root / "b", args.passes, entries, ENTRY, seed=2, noise=1e-4)
        size = sum(f.stat().st_size for f in a.rglob("*.pt"))
        print(
            f"built 2 runs of {size / 1e9:.2f} GB ({args.passes} passes x {entries} entries of "
            f"4 MB) in {time.perf_counter() - t0:.0f} s"
        )
        for what in ("open", "diff", "first"):
            r = probe(what, a, b)
            print(
                f"  peak RSS {what:5s}: {r['rss_mb']:7.0f} MB ({r['s']:.1f} s); the run is "
                f"{size / 1e6:.0f} MB ({size / 1e6 / r['rss_mb']:.1f}x the peak)"
            )
        both = 2 * size
        A = DumpSet.open(a)
        A.diff(b).first_divergence()  # untimed: loads the kernel (once per process) and pass 0
        timings = {}
        # one pass pair at a time runs inline, on this thread; the default wave uses the local pool
        for name, in_flight in (("single thread", 1), ("local threads", None)):
            t0 = time.perf_counter()
            A.diff(b, passes_in_flight=in_flight).table(progress=False)
            timings[name] = time.perf_counter() - t0
        from distributed import Client, LocalCluster

        with (
            LocalCluster(
                n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
            ) as cluster,
            Client(cluster) as client,
        ):
            t0 = time.perf_counter()
            DumpSet.open(a, client=client).diff(b).table(progress=False)
            timings["LocalCluster (2 processes)"] = time.perf_counter() - t0
        for name, s in timings.items():
            print(f"  diff throughput, {name:27s}: {both / s / 1e9:.2f} GB/s ({s:.1f} s)")
        for label, p in (("pass 0", 0), ("middle", args.passes // 2), ("last", args.passes - 1)):
            v = variant(a, root / f"v{p}", p)
            diff = A.diff(v)
            t0 = time.perf_counter()
            div = diff.first_divergence()
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            A.diff(v).table(progress=False)
            t_full = time.perf_counter() - t0
            print(
                f"  first_divergence at {label:6s}: {t_first:.2f} s = {t_first / t_full:.1%} of the "
                f"full diff ({t_full:.2f} s); found pass {div.pass_}, "
                f"{len(diff.passes_read)} passes read"
            )
            shutil.rmtree(v)


if __name__ == "__main__":
    main()
