"""The serving-engine case in full: packed tokens, continuous batching and fused TP shards.

:class:`TPPackedLlama` is one rank of :class:`~tdinspect.examples.port_tp.TPLlamaPort`
(fused ``qkv`` ``[q_r | k_r | v_r]`` and ``gate_up`` ``[gate_r | up_r]`` per rank,
row-parallel ``o`` and ``down`` all-reduced over the group) served the way
:class:`~tdinspect.examples.engine.PackedLlama` serves the Hugging Face model: every
request's tokens of a step packed into one ``[1, T, hidden]`` row, requests joining and
leaving (continuous batching), attention through a block-diagonal causal mask over a
flat key/value cache (each rank caching its own key/value heads). The step's positions
and mask reach the attention as an engine's attention metadata does (set on the module
before the forward, as vLLM's forward context).

:func:`capture_tp_engine` serves :func:`~tdinspect.examples.engine.engine_prompts` by a
schedule on ``size`` processes in a real ``gloo`` group, each rank recording every step
with its token layout, its rank (``parallel={"tp": (rank, size)}``) and the fused dims
(:func:`~tdinspect.examples.port_tp.tp_port_dims`). Against the Hugging Face model run
one request at a time it compares with ``tokens=True, unshard=True`` and
:func:`~tdinspect.examples.port_tp.hf_port_mapping`.

Examples
--------
>>> hf = make_hf_llama(seed=0)                                          # doctest: +SKIP
>>> ref = capture_reference(hf, engine_prompts(), "dumps/hf")           # doctest: +SKIP
>>> tp = capture_tp_engine("dumps/tp_engine", bug=(1, 1, 6))             # doctest: +SKIP
>>> d = DumpSet.open(ref).diff(tp, tokens=True, unshard=True, mapping=hf_port_mapping(hf.config))  # doctest: +SKIP
>>> d.verdict(structural="report", allow_uncompared="rotary_emb|act_fn|self_attn$|mlp$").text  # doctest: +SKIP
'diverges: model.model.layers.0.self_attn.k_proj (request 1, position 6): ...'
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tdinspect.examples.engine import CONTINUOUS, engine_prompts, engine_steps, step_mask
from tdinspect.examples.gloo import joined, spawn_ranks
from tdinspect.examples.port import PortConfig, make_hf_llama, rotate
from tdinspect.examples.port_tp import ShardAttention, TPLlamaPort, all_reduce, tp_port_dims


class FusedQKV(nn.Linear):
    """A rank's fused ``qkv`` projection; ``late`` (token rows, set per step) gets its k
    segment ``keys`` (a slice of the output features) scaled by 1.5: a planted bug."""

    def __init__(self, dim: int, out: int, keys: slice):
        super().__init__(dim, out, bias=False)
        self.keys = keys
        self.late: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.late is not None and bool(self.late.any()):
            y[:, self.late, self.keys] *= 1.5
        return y


class PackedShardAttention(ShardAttention):
    """:class:`ShardAttention` on packed tokens: each token rotated at its own position,
    attending through the step's mask to this rank's flat key/value cache."""

    def __init__(self, cfg: PortConfig, size: int):
        super().__init__(cfg, size)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv = FusedQKV(cfg.dim, q + 2 * kv, slice(q, q + kv))
        self.meta: tuple[torch.Tensor, torch.Tensor] | None = None  # (positions [T], mask [T, K])
        self.reset()

    def reset(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.meta is None:
            raise RuntimeError("PackedShardAttention runs inside TPPackedLlama, which sets its step's meta")
        position, mask = self.meta
        b, s, _ = x.shape
        hd = self.head_dim
        q, k, v = self.qkv(x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))
        q, k = rotate(q, position, self.cfg.theta, "half"), rotate(k, position, self.cfg.theta, "half")
        if self.keys is not None:
            k, v = torch.cat([self.keys, k], 2), torch.cat([self.values, v], 2)
        self.keys, self.values = k, v
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)
        return all_reduce(self.o(out.transpose(1, 2).reshape(b, s, -1)), self.size)


class TPPackedLlama(TPLlamaPort):
    """Rank ``rank`` of ``size`` of the port, served packed with continuous batching.

    ``forward(ids, request, position)`` (each ``[T]``, one engine step) -> logits
    ``[1, T, vocab]``. Module names are :class:`TPLlamaPort`'s.

    Parameters
    ----------
    cfg : PortConfig
    rank, size : int
        This rank and the tensor-parallel size (all-reducing over the default group when
        ``size > 1``).
    """

    def __init__(self, cfg: PortConfig, rank: int = 0, size: int = 1):
        super().__init__(cfg, rank, size)
        for block in self.blocks:
            block.attn = PackedShardAttention(cfg, size)
        self.bug: tuple[int, int] | None = None
        self.reset()

    @classmethod
    def from_hf(  # type: ignore[override]
        cls, hf_model: nn.Module, rank: int = 0, size: int = 1, bug: tuple[int, int] | None = None
    ) -> TPPackedLlama:
        """Rank ``rank``'s shard of a ``LlamaForCausalLM``'s weights.

        ``bug=(request, k)`` plants a bug on this rank: layer 0's fused ``qkv`` gives a wrong
        k segment (x1.5) for that request's tokens at positions ``>= k``.
        """
        engine = super().from_hf(hf_model, rank, size)
        engine.bug = bug
        return engine

    def reset(self) -> None:
        """Forget every request (empty key/value caches)."""
        self.kv_request = torch.empty(0, dtype=torch.long)
        self.kv_position = torch.empty(0, dtype=torch.long)
        for block in self.blocks:
            block.attn.reset()

    def forward(self, ids: torch.Tensor, request: torch.Tensor, position: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        keys_r = torch.cat([self.kv_request, request])
        keys_p = torch.cat([self.kv_position, position])
        mask = step_mask(keys_r, keys_p, request, position)
        for block in self.blocks:
            block.attn.meta = (position, mask)
        if self.bug is not None:
            r, k = self.bug
            self.blocks[0].attn.qkv.late = (request == r) & (position >= k)
        logits = super().forward(ids[None])
        self.kv_request, self.kv_position = keys_r, keys_p
        return logits


def _capture_rank(out: Path, rank: int, size: int, seed: int, schedule, bug) -> None:
    import tdinspect

    hf = make_hf_llama(seed)
    engine = TPPackedLlama.from_hf(hf, rank, size, bug)
    dims = tp_port_dims(hf.config)
    with (
        torch.no_grad(),
        tdinspect.capture(engine, out, dims=dims, parallel={"tp": (rank, size)}) as dump,
    ):
        for ids, req, pos, layout in engine_steps(engine_prompts(seed), schedule):
            engine(ids, req, pos)
            dump.step(tokens=layout)


def capture_tp_engine(
    root: str | os.PathLike,
    schedule=CONTINUOUS,
    size: int = 2,
    seed: int = 0,
    bug: tuple[int, int, int] | None = None,
    timeout: float = 300.0,
) -> Path:
    """Serve :func:`engine_prompts` by ``schedule`` at tensor-parallel ``size``, one process
    per rank in a real ``gloo`` group (``size=1``: here), each rank captured into ``root``.

    Parameters
    ----------
    root : path
        The dump folder (the ranks' folders go under it).
    schedule : list
        ``[(request, tokens fed), ...]`` per step (default
        :data:`~tdinspect.examples.engine.CONTINUOUS`).
    size : int
        Tensor-parallel size (1 or 2 for the tiny Llama's 2 key/value heads).
    seed : int
        The weights' (:func:`make_hf_llama`) and the prompts' seed.
    bug : (rank, request, k), optional
        Plant a bug on one rank (:meth:`TPPackedLlama.from_hf`).
    timeout : float
        Seconds a rank may run before every rank is stopped.

    Returns
    -------
    Path
        ``root``.

    Examples
    --------
    >>> capture_tp_engine("dumps/tp_engine_bad", bug=(1, 1, 6))   # doctest: +SKIP
    PosixPath('dumps/tp_engine_bad')
    """
    root = Path(root)
    if size == 1:
        _capture_rank(root, 0, 1, seed, schedule, bug[1:] if bug and bug[0] == 0 else None)
        return root
    root.mkdir(parents=True, exist_ok=True)
    spawn_ranks(
        "tdinspect.examples.engine_tp",
        size,
        root.parent / f".{root.name}.store",
        lambda r: [
            str(root),
            str(seed),
            json.dumps(schedule),
            json.dumps(bug[1:] if bug and bug[0] == r else None),
        ],
        timeout,
    )
    return root


def main(argv: list[str]) -> None:
    """Worker: ``RANK SIZE STORE OUT SEED SCHEDULE BUG`` (the last two JSON; see :func:`capture_tp_engine`)."""
    rank, size, store, out, seed = int(argv[0]), int(argv[1]), argv[2], Path(argv[3]), int(argv[4])
    schedule, bug = json.loads(argv[5]), json.loads(argv[6])
    with joined(rank, size, store):
        _capture_rank(out, rank, size, seed, schedule, tuple(bug) if bug else None)


if __name__ == "__main__":
    main(sys.argv[1:])
