"""A tensor-parallel transformer block for the unshard tests, and its worker process.

Column-parallel q/k/v and up (each rank holds a slice of the output features
and the heads that go with it), row-parallel o and down (each rank's output is
a partial sum, all-reduced afterwards). At ``size=1`` it is the plain block.
Every process builds the full weights from one seed and keeps its slices.

Run as a worker: ``python -m tests.tp_block RANK SIZE PORT OUT [FAULT_LAYER]``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, FFN, LAYERS, SEQ = 32, 4, 64, 2, 16

# what each module's output is, across tensor-parallel ranks
DIMS = {
    r"\.(q|k|v|attn)$": "b s h(tp)",
    r"\.up$": "b s f(tp)",
    r"\.act$": "b s f(tp)",
    r"\.(o|down)$": "b s h(tp,partial)",
}


class Attention(nn.Module):
    """Causal attention over the heads this rank holds (no parameters)."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, q, k, v):
        b, s, h = q.shape

        def split(t):
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return out.transpose(1, 2).reshape(b, s, h)


class Block(nn.Module):
    def __init__(self, rank: int, size: int, gen: torch.Generator, group=None):
        super().__init__()
        self.size, self.group = size, group
        h, f = HIDDEN // size, FFN // size

        def column(n_in, n_out, part):  # the rows of the full weight this rank computes
            w = torch.randn(n_out, n_in, generator=gen) / n_in**0.5
            lin = nn.Linear(n_in, n_out // size, bias=False)
            lin.weight.data.copy_(w[rank * part : (rank + 1) * part])
            return lin

        def row(n_in, n_out, part):  # the columns of the full weight this rank holds
            w = torch.randn(n_out, n_in, generator=gen) / n_in**0.5
            lin = nn.Linear(n_in // size, n_out, bias=False)
            lin.weight.data.copy_(w[:, rank * part : (rank + 1) * part])
            return lin

        self.ln1 = nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v = (column(HIDDEN, HIDDEN, h) for _ in range(3))
        self.attn = Attention(HEADS // size)
        self.o = row(HIDDEN, HIDDEN, h)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.up = column(HIDDEN, FFN, f)
        self.act = nn.SiLU()
        self.down = row(FFN, HIDDEN, f)

    def reduce(self, t):
        if self.size > 1:
            torch.distributed.all_reduce(t, group=self.group)
        return t

    def forward(self, x):
        y = self.ln1(x)
        x = x + self.reduce(self.o(self.attn(self.q(y), self.k(y), self.v(y))))
        return x + self.reduce(self.down(self.act(self.up(self.ln2(x)))))


class Model(nn.Module):
    def __init__(self, rank: int = 0, size: int = 1, fault_layer: int | None = None, group=None):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleList(Block(rank, size, gen, group) for _ in range(LAYERS))
        if fault_layer is not None and rank == 1:  # a wrong shard on rank 1 only
            with torch.no_grad():
                self.blocks[fault_layer].up.weight[:4] *= 1.5

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def inputs() -> torch.Tensor:
    return torch.randn(1, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))


def run(out: str, rank: int = 0, size: int = 1, fault_layer: int | None = None) -> None:
    """Capture one forward of the block into ``out`` (``dims`` as above)."""
    import tdinspect

    model = Model(rank, size, fault_layer)
    with torch.no_grad(), tdinspect.capture(model, out, dims=DIMS) as dump:
        model(inputs())
        dump.step()


def main(argv: list[str]) -> None:
    rank, size, port, out = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    fault = int(argv[4]) if len(argv) > 4 else None
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        run(out, rank, size, fault)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
