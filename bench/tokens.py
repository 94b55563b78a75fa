"""What lining two runs up token by token costs a diff (``DumpSet.diff(other, tokens=True)``).

Run: ``python bench/tokens.py``. In one run, on files it writes and removes:

- A, the reference: one pass per request, each entry ``[1, L, hidden]`` float32
  (``--requests`` requests of lengths 64 to 512, ``--entries`` entries a pass);
- C: A's layout, with noise: the plain diff A vs C (by pass and name) is the baseline;
- B: C's values served as an engine would, packed ``[1, T, hidden]`` into passes of
  ``--pack`` tokens, a request cut across passes where it does not fit (chunked
  prefill); ``--decode`` more tokens per request then come one per pass beside the
  other requests' (continuous batching; A and C hold them too).

A vs B with ``tokens=True`` compares exactly the bytes A vs C compares. Medians of
``--rounds`` alternating rounds, both warmed first; the ratio is token-aligned time over
plain time (target <= 1.25). ``--clock cpu`` times this process's CPU (all its threads) instead
of the wall clock: a machine shared with other jobs disturbs it far less.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import scratch_dir, settle  # noqa: E402

import tdinspect  # noqa: E402
from tdinspect import DumpSet  # noqa: E402
from tdinspect.dumper.recorder import Recorder  # noqa: E402


def write_runs(root: Path, requests: int, entries: int, hidden: int, pack: int, decode: int):
    """A (a pass per request), C (A's layout, noisy) and B (C's values packed): their paths."""
    gen = torch.Generator().manual_seed(0)
    lengths = [64 + (448 * i) // max(1, requests - 1) for i in range(requests)]
    total = [n + decode for n in lengths]
    values = [[torch.randn(1, n, hidden, generator=gen) for _ in range(entries)] for n in total]
    noisy = [[t + 1e-4 * torch.randn(t.shape, generator=gen) for t in req] for req in values]
    recs = {k: Recorder(root / k, level="module", max_pending_bytes=1 << 30) for k in "acb"}
    for side, vals in (("a", values), ("c", noisy)):
        for r, n in enumerate(total):
            for e in range(entries):
                recs[side].record(f"model.layers.{e}.out", vals[r][e], module_type="Linear")
            recs[side].step(tokens=tdinspect.tokens(request_ids=[r], seq_lens=[n], shape=(1, n)))
    # B: prefill packed by `pack` tokens (requests cut across passes), then decode steps
    steps: list[list[tuple[int, int, int]]] = [[]]  # (request, first position, count)
    room = pack
    for r, n in enumerate(lengths):
        pos = 0
        while pos < n:
            take = min(room, n - pos)
            steps[-1].append((r, pos, take))
            pos, room = pos + take, room - take
            if room == 0:
                steps.append([])
                room = pack
    steps = [s for s in steps if s]
    for d in range(decode):
        steps.append([(r, lengths[r] + d, 1) for r in range(requests)])
    for step in steps:
        for e in range(entries):
            rows = torch.cat([noisy[r][e][:, p : p + k] for r, p, k in step], 1)
            recs["b"].record(f"model.layers.{e}.out", rows, module_type="Linear")
        layout = tdinspect.tokens(
            request_ids=[r for r, _, _ in step],
            positions=torch.cat([torch.arange(p, p + k) for _, p, k in step]),
            seq_lens=[k for _, _, k in step],
            shape=(1, sum(k for _, _, k in step)),
        )
        recs["b"].step(tokens=layout)
    for rec in recs.values():
        rec.close()
    nbytes = 2 * sum(total) * entries * hidden * 4
    return root / "a", root / "c", root / "b", nbytes, len(steps)


def timed(a, b, tokens: bool) -> float:
    settle()
    t0 = common.clock()
    d = DumpSet.open(a).diff(b, tokens=True) if tokens else DumpSet.open(a).diff(b)
    df = d.table(progress=False)
    elapsed = common.clock() - t0
    assert not df["structural"].any(), df[df["structural"]].head()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--entries", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--pack", type=int, default=2048, help="prefill tokens a pass")
    parser.add_argument("--decode", type=int, default=0, help="decode steps after the prefill")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--clock", choices=sorted(common.CLOCK), default="wall")
    args = parser.parse_args()
    common.clock = common.CLOCK[args.clock]
    with scratch_dir("tokens", args.dir) as root:
        a, c, b, nbytes, passes = write_runs(
            root, args.requests, args.entries, args.hidden, args.pack, args.decode
        )
        timed(a, c, False), timed(a, b, True)  # warm-up
        plain, aligned = [], []
        for _ in range(args.rounds):
            plain.append(timed(a, c, False))
            aligned.append(timed(a, b, True))
        p, t = statistics.median(plain), statistics.median(aligned)
        print(
            f"diff of {nbytes / 1e9:.2f} GB ({args.requests} requests x {args.entries} entries of "
            f"[L, {args.hidden}] float32 a side; B packed into {passes} passes of <= {args.pack} "
            f"prefill tokens, {args.decode} decode steps), {args.clock} clock: plain {p:.3f} s ({nbytes / p / 1e9:.2f} GB/s), "
            f"tokens=True {t:.3f} s ({nbytes / t / 1e9:.2f} GB/s): ratio {t / p:.2f} (target <= 1.25); "
            f"rounds plain {[round(x, 3) for x in plain]}, tokens {[round(x, 3) for x in aligned]}"
        )


if __name__ == "__main__":
    main()
