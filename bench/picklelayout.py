"""Reading a pass pickle's layout: the template reader (one compiled pattern an entry) against
the opcode reader, on the same ``data.pkl`` of a plain ``torch.save`` of ``{name: tensor}``.

    python bench/picklelayout.py [--entries 60 1500 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import time
import zipfile

import torch

from tdinspect.store import picklelayout


def data_pkl(entries: int) -> bytes:
    """The ``data.pkl`` record of ``torch.save`` of ``entries`` small float32 tensors."""
    buf = io.BytesIO()
    torch.save({f"model.layers.{i}.mlp.out": torch.zeros(4, 8) for i in range(entries)}, buf)
    with zipfile.ZipFile(buf) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def per_entry_us(read, pickled: bytes, entries: int, rounds: int) -> float:
    """Minimum over ``rounds`` of one read's time, in microseconds an entry."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        assert read(pickled) is not None
        best = min(best, time.perf_counter() - start)
    return best / entries * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entries", type=int, nargs="+", default=[60, 1500, 20_000])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for n in args.entries:
        pickled = data_pkl(n)
        fast = per_entry_us(picklelayout._template_layout, pickled, n, args.rounds)
        exact = per_entry_us(picklelayout._exact_layout, pickled, n, args.rounds)
        print(
            f"{n:>6} entries: template {fast:5.1f} us an entry, opcode reader {exact:5.1f} us "
            f"({exact / fast:.1f}x, minima of {args.rounds})"
        )


if __name__ == "__main__":
    main()
