"""Aligning differently written runs: suggest_mapping's time, and what a mapping costs a diff.

Run: ``python bench/align.py``. In one run, on files it writes and removes:

1. ``suggest_mapping`` on a 1,500-entry pair: A is 100 layers x 15 entries
   (``model.layers.N.q``, ``k``, ``v``, ...), B the same values under other
   names with ``qkv`` and ``gate_up`` fused (1,200 entries); time, rules,
   unmatched entries.
2. Diff throughput with a mapping whose transforms slice the fused ``qkv``
   (``chunk(3, -1)[i]``), as a ratio of the plain diff (identical names) of the
   same bytes; also a mapping that only renames. Medians of ``--rounds``
   alternating runs, all warmed first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import scratch_dir  # noqa: E402

from tdinspect import DumpSet, suggest_mapping  # noqa: E402
from tdinspect.dumper.recorder import Recorder  # noqa: E402

LEAVES = ["norm1", "q", "k", "v", "o", "norm2", "gate", "up", "down"] + [f"e{i}" for i in range(6)]
B_NAME = {
    "norm1": "attn_norm",
    "o": "attn.o",
    "norm2": "mlp_norm",
    "down": "ffn.down",
    **{f"e{i}": f"extra.x{i}" for i in range(6)},
}


def write_pair(root: Path, layers: int, shape: tuple, passes: int = 1, noise: float = 0.0):
    """A (separate q/k/v, gate/up) and B (fused, renamed): the same values, B with ``noise``."""
    gen = torch.Generator().manual_seed(0)
    ra = Recorder(root / "a", level="module", max_pending_bytes=512 << 20)
    rb = Recorder(root / "b", level="module", max_pending_bytes=512 << 20)
    rc = Recorder(root / "c", level="module", max_pending_bytes=512 << 20)  # A's names, B's values
    for _ in range(passes):
        for n in range(layers):
            t = {leaf: torch.randn(shape, generator=gen) for leaf in LEAVES}
            tb = {k: v + noise * torch.randn(shape, generator=gen) if noise else v for k, v in t.items()}
            for leaf in LEAVES:
                ra.record(f"model.layers.{n}.{leaf}", t[leaf], module_type="Linear")
                rc.record(f"model.layers.{n}.{leaf}", tb[leaf], module_type="Linear")
                if leaf == "q":
                    rb.record(
                        f"model.blocks.{n}.attn.qkv",
                        torch.cat([tb["q"], tb["k"], tb["v"]], -1),
                        module_type="Linear",
                    )
                elif leaf == "gate":
                    rb.record(
                        f"model.blocks.{n}.ffn.gate_up",
                        torch.cat([tb["gate"], tb["up"]], -1),
                        module_type="Linear",
                    )
                elif leaf in B_NAME:
                    rb.record(f"model.blocks.{n}.{B_NAME[leaf]}", tb[leaf], module_type="Linear")
        for r in (ra, rb, rc):
            r.step()
    for r in (ra, rb, rc):
        r.close()
    return root / "a", root / "b", root / "c"


def throughput(a, b, mapping, nbytes: int) -> float:
    t0 = time.perf_counter()
    d = DumpSet.open(a).diff(b, mapping=mapping)
    df = d.table(progress=False)
    assert not df["structural"].any(), df[df["structural"]].head()
    return nbytes / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--rows", type=int, default=256, help="rows of each big tensor (x 1024)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with scratch_dir("align", args.dir) as root:
        # 1. suggest_mapping, 1,500 small entries
        a, b, _ = write_pair(root / "small", args.layers, (4, 64))
        A, B = DumpSet.open(a), DumpSet.open(b)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            s = suggest_mapping(A, B)
            times.append(time.perf_counter() - t0)
        print(
            f"suggest_mapping {A.n_entries()} A x {B.n_entries()} B entries: "
            f"{statistics.median(times):.2f} s (median of 3: {', '.join(f'{t:.2f}' for t in times)}); "
            f"{len(s.rules)} rules from {int(s.pairs['used'].sum())} pairs, "
            f"{len(s.unmatched_a)} A / {len(s.unmatched_b)} B unmatched"
        )
        assert len(s.unmatched_a) == 0 and len(s.unmatched_b) == 0

        # 2. throughput: plain (A vs C, same names) against mapped (A vs B, fused + renamed)
        a, b, c = write_pair(root / "big", 4, (args.rows, 1024), passes=args.passes, noise=1e-4)
        per_layer = {leaf: (B_NAME.get(leaf)) for leaf in LEAVES}
        renames = {
            rf"model\.layers\.(\d+)\.{leaf}": rf"model.blocks.\1.{name}"
            for leaf, name in per_layer.items()
            if name
        }
        fused = {
            rf"model\.layers\.(\d+)\.{leaf}": [r"model.blocks.\1.attn.qkv", f"chunk(3, -1)[{i}]"]
            for i, leaf in enumerate("qkv")
        }
        fused.update(
            {
                rf"model\.layers\.(\d+)\.{leaf}": [r"model.blocks.\1.ffn.gate_up", f"chunk(2, -1)[{i}]"]
                for i, leaf in enumerate(["gate", "up"])
            }
        )
        mapping = {**renames, **fused}
        nbytes = 2 * args.passes * 4 * len(LEAVES) * args.rows * 1024 * 4
        throughput(a, c, None, nbytes), throughput(a, b, mapping, nbytes)  # warm-up
        plain, mapped = [], []
        for _ in range(args.rounds):
            plain.append(throughput(a, c, None, nbytes))
            mapped.append(throughput(a, b, mapping, nbytes))
        p, m = statistics.median(plain), statistics.median(mapped)
        print(
            f"diff of {nbytes / 1e9:.2f} GB ({args.passes} passes x {4 * len(LEAVES)} entries of "
            f"{args.rows}x1024 float32 a side): plain {p / 1e9:.2f} GB/s, with mapping "
            f"(rename + chunk of fused qkv/gate_up) {m / 1e9:.2f} GB/s: ratio {m / p:.2f} "
            f"(target >= 0.8); rounds plain {[round(x / 1e9, 2) for x in plain]}, "
            f"mapped {[round(x / 1e9, 2) for x in mapped]}"
        )


if __name__ == "__main__":
    main()
