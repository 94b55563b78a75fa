"""Reading a pass of many small entries: from the archive's records (the sidecar's layout)
against torch.load(weights_only=True, mmap=True), side by side in one run.

    python bench/read.py [--entries 20000] [--numel 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import synthetic_run

from tdinspect.dumpset import DumpSet
from tdinspect.store.format import load_pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entries", type=int, default=20_000)
    ap.add_argument("--numel", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = synthetic_run(Path(tmp) / "run", 1, args.entries, args.numel, seed=0)
        pi = DumpSet.open(root).get_pass(0)
        assert pi.raw is not None
        records, unpickled = [], []
        for _ in range(args.rounds):  # alternating rounds: the machine's drift hits both alike
            t0 = time.perf_counter()
            fast = pi._read_records()
            s = sum(float(t[0]) for t in fast.values())
            records.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            slow = load_pass(pi.files.tensors, mmap=True)
            s2 = sum(float(t[0]) for t in slow.values())
            unpickled.append(time.perf_counter() - t0)
            assert s == s2
        r, u = statistics.median(records), statistics.median(unpickled)
        print(
            f"{args.entries} entries x {args.numel} float32, medians of {args.rounds}: "
            f"records {r * 1e3:.0f} ms ({args.entries / r:,.0f} entries/s), "
            f"torch.load {u * 1e3:.0f} ms ({args.entries / u:,.0f} entries/s): {u / r:.1f}x faster"
        )


if __name__ == "__main__":
    main()
