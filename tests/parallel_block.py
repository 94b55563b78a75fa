"""Data x tensor parallel runs of :mod:`tests.tp_block`'s model, one process per rank.

Rank ``r`` of ``size`` is data-parallel rank ``r // 2`` and tensor-parallel rank ``r % 2``;
each data-parallel rank's pair all-reduces in its own group and is fed the same batch, so
every entry's copies along ``dp`` agree. Every entry has dims, the layer norms' naming no
axis (:data:`REPLICATED`: replicated over ``tp``).

Run as a worker (:func:`tdinspect.examples.gloo.spawn_ranks`):
``python -m tests.parallel_block RANK SIZE STORE OUT FAULT``, ``FAULT`` one of ``none``,
``nan`` (data-parallel rank 1 fed NaN), ``ln`` (tensor-parallel rank 1's copy of
``blocks.1.ln2`` has its bias off by 0.5: a replicated weight out of sync).
"""

from __future__ import annotations

import sys

import torch

from tests.tp_block import DIMS, Model, inputs

TP = 2
REPLICATED = {r"\.ln[12]$": "b s h"}


def run(out: str, rank: int, size: int, fault: str) -> None:
    import tdinspect

    dp, tp = divmod(rank, TP)
    groups = [torch.distributed.new_group([d * TP + t for t in range(TP)]) for d in range(size // TP)]
    model = Model(tp, TP, group=groups[dp])
    x = inputs()
    if fault == "nan" and dp == 1:
        x = torch.full_like(x, float("nan"))
    if fault == "ln" and tp == 1:
        with torch.no_grad():
            model.blocks[1].ln2.bias += 0.5
    coords = {"dp": (dp, size // TP), "tp": (tp, TP)}
    with torch.no_grad(), tdinspect.capture(model, out, dims={**DIMS, **REPLICATED}, parallel=coords) as dump:
        model(x)
        dump.step()


def main(argv: list[str]) -> None:
    from tdinspect.examples.gloo import joined

    rank, size, store, out, fault = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    with joined(rank, size, store):
        run(out, rank, size, fault)


if __name__ == "__main__":
    main(sys.argv[1:])
