"""What a diff costs per pass: a diff of N passes should take about N times one pass's work.

Run: ``python bench/passes.py``. Writes two identical runs of ``--passes`` passes (and of one
tenth as many) of ``--entries`` small float32 entries each, then times
``DumpSet.open(a).diff(b).verdict()`` (open included) on both: the ratio of the two times is
what growing the number of passes tenfold costs (target: under 10x; it was quadratic, the
ranks of both sides rebuilt for every pass job: 1,000 passes 2.5 s, 8,000 33 s). With
``--tokens`` the runs hold one one-token request a pass and the diff is token-aligned.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tdinspect  # noqa: E402
from tdinspect import DumpSet  # noqa: E402
from tdinspect.dumper.recorder import Recorder  # noqa: E402


def write_run(root: Path, passes: int, entries: int, tokens: bool) -> Path:
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(1, 1, 8, generator=gen) for _ in range(entries)]
    rec = Recorder(root, level="module", max_pending_bytes=1 << 30)
    for p in range(passes):
        for e in range(entries):
            rec.record(f"model.layers.{e}.out", values[e], module_type="Linear")
        layout = tdinspect.tokens(request_ids=[p], seq_lens=[1], shape=(1, 1)) if tokens else None
        rec.step(tokens=layout)
    rec.close()
    return root


def timed(a: Path, b: Path, tokens: bool) -> tuple[float, float, str]:
    """Wall and CPU seconds (this process, all its threads: a machine shared with other jobs
    disturbs it less) of opening both runs and answering the verdict."""
    wall, cpu = time.perf_counter(), time.process_time()
    diff = DumpSet.open(a).diff(DumpSet.open(b), tokens=tokens) if tokens else DumpSet.open(a).diff(b)
    outcome = diff.verdict().outcome
    return time.perf_counter() - wall, time.process_time() - cpu, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=10_000)
    parser.add_argument("--entries", type=int, default=4)
    parser.add_argument("--tokens", action="store_true", help="one-token requests, token-aligned diff")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tdinspect-bench-passes-"))
    try:
        times = {}
        for n in (args.passes // 10, args.passes):
            a = write_run(root / f"a{n}", n, args.entries, args.tokens)
            b = write_run(root / f"b{n}", n, args.entries, args.tokens)
            wall, cpu, outcome = times[n] = timed(a, b, args.tokens)
            print(
                f"{n:>6} passes x {args.entries} entries: {wall:.2f} s wall, {cpu:.2f} s CPU ({outcome})",
                flush=True,
            )
        small, large = args.passes // 10, args.passes
        print(
            f"ratio {large}/{small} passes: {times[large][0] / times[small][0]:.1f}x wall, "
            f"{times[large][1] / times[small][1]:.1f}x CPU (target < 10x)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
