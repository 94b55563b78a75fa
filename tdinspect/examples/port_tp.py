"""A tensor-parallel port of a tiny Hugging Face Llama, with fused shards: the engine case.

:class:`TPLlamaPort` is one rank's shard of :class:`~tdinspect.examples.port.LlamaPort`
as a serving engine shards it: the fused ``qkv`` of each rank holds that rank's
query heads, then its key/value heads (``[q_r | k_r | v_r]``), the fused
``gate_up`` holds ``[gate_r | up_r]``; ``o`` and ``down`` are row-parallel (each
rank's output a partial sum, all-reduced after the module); norms, embedding and
head are replicated. Module names are :class:`LlamaPort`'s, so a TP run meets the
one-process port entry for entry once unsharded with :func:`tp_port_dims`.

:func:`capture_tp_port` runs ``size`` processes in a real ``gloo`` group and
captures each rank into one dump folder. The port imports torch only;
:func:`capture_tp_port` also imports ``transformers`` (random weights from a
tiny config, nothing downloaded).

Examples
--------
>>> tp2 = capture_tp_port("dumps/tp2", size=2)                       # doctest: +SKIP
>>> ref = capture_hf("dumps/hf")                                      # doctest: +SKIP
>>> d = DumpSet.open(ref).diff(tp2, unshard=True, mapping=hf_port_mapping(make_hf_llama().config))  # doctest: +SKIP
>>> d.first_divergence(structural="report") is None                  # doctest: +SKIP
True
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tdinspect.examples.gloo import joined, spawn_ranks
from tdinspect.examples.port import Block, LlamaPort, PortConfig, make_hf_llama, port_tokens, rotate

FAULTS = ("k",)  # what ``fault=`` can plant: a wrong k segment of layer 0's qkv on this rank


def all_reduce(t: torch.Tensor, size: int) -> torch.Tensor:
    if size > 1:
        torch.distributed.all_reduce(t)
    return t


class ShardAttention(nn.Module):
    """This rank's query heads and key/value heads, one fused ``qkv``, a row-parallel ``o``."""

    def __init__(self, cfg: PortConfig, size: int):
        super().__init__()
        self.cfg, self.size = cfg, size
        self.head_dim = cfg.dim // cfg.heads
        self.heads, self.kv_heads = cfg.heads // size, cfg.kv_heads // size
        self.qkv = nn.Linear(cfg.dim, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.o = nn.Linear(self.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.head_dim
        q, k, v = self.qkv(x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))
        pos = torch.arange(s)
        q, k = rotate(q, pos, self.cfg.theta, "half"), rotate(k, pos, self.cfg.theta, "half")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return all_reduce(self.o(out.transpose(1, 2).reshape(b, s, -1)), self.size)


class ShardFeedForward(nn.Module):
    """SwiGLU over this rank's share of the hidden features: fused ``gate_up``, row-parallel ``down``."""

    def __init__(self, cfg: PortConfig, size: int):
        super().__init__()
        self.size = size
        self.gate_up = nn.Linear(cfg.dim, 2 * (cfg.hidden // size), bias=False)
        self.down = nn.Linear(cfg.hidden // size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return all_reduce(self.down(F.silu(gate) * up), self.size)


class TPLlamaPort(LlamaPort):
    """Rank ``rank`` of ``size`` of the port: token ids ``b s`` -> logits ``b s vocab``.

    At ``size=1`` it computes what :class:`~tdinspect.examples.port.LlamaPort` does.
    With ``size > 1`` it all-reduces over the default ``torch.distributed`` group.
    """

    def __init__(self, cfg: PortConfig, rank: int = 0, size: int = 1):
        if not 0 <= rank < size or cfg.heads % size or cfg.kv_heads % size or cfg.hidden % size:
            raise ValueError(
                f"rank {rank} of {size}: need 0 <= rank < size, and size dividing the heads "
                f"({cfg.heads}), key/value heads ({cfg.kv_heads}) and hidden features ({cfg.hidden})"
            )
        shards = [
            Block(cfg, "half", ShardAttention(cfg, size), ShardFeedForward(cfg, size))
            for _ in range(cfg.layers)
        ]
        super().__init__(cfg, blocks=shards)
        self.rank, self.size = rank, size

    @classmethod
    def from_hf(  # type: ignore[override]
        cls, hf_model: nn.Module, rank: int = 0, size: int = 1, fault: str | None = None
    ) -> TPLlamaPort:
        """Rank ``rank``'s shard of a ``LlamaForCausalLM``'s weights.

        Parameters
        ----------
        hf_model : transformers.LlamaForCausalLM
        rank, size : int
            This rank and the tensor-parallel size.
        fault : {"k"}, optional
            A planted bug: this rank's k segment of layer 0's fused ``qkv`` gets
            its weights scaled by 1.5 (the other ranks stay correct).
        """
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault={fault!r}: expected one of {FAULTS}")
        cfg = PortConfig.from_hf(hf_model.config)
        port = cls(cfg, rank, size)
        sd = hf_model.state_dict()

        def rows(w, n):  # this rank's n output features of a column-parallel weight
            return w[rank * n : (rank + 1) * n]

        hd = cfg.dim // cfg.heads
        q, kv, f = cfg.heads // size * hd, cfg.kv_heads // size * hd, cfg.hidden // size
        new = {
            "embed.weight": sd["model.embed_tokens.weight"],
            "final_norm.scale": sd["model.norm.weight"],
            "head.weight": sd["lm_head.weight"],
        }
        for i in range(cfg.layers):
            p, b = f"model.layers.{i}.", f"blocks.{i}."
            k_rows = rows(sd[p + "self_attn.k_proj.weight"], kv)
            if fault == "k" and i == 0:
                k_rows = k_rows * 1.5
            new[b + "attn_norm.scale"] = sd[p + "input_layernorm.weight"]
            new[b + "mlp_norm.scale"] = sd[p + "post_attention_layernorm.weight"]
            new[b + "attn.qkv.weight"] = torch.cat(
                [
                    rows(sd[p + "self_attn.q_proj.weight"], q),
                    k_rows,
                    rows(sd[p + "self_attn.v_proj.weight"], kv),
                ]
            )
            new[b + "attn.o.weight"] = sd[p + "self_attn.o_proj.weight"][:, rank * q : (rank + 1) * q]
            new[b + "ffn.gate_up.weight"] = torch.cat(
                [rows(sd[p + "mlp.gate_proj.weight"], f), rows(sd[p + "mlp.up_proj.weight"], f)]
            )
            new[b + "ffn.down.weight"] = sd[p + "mlp.down_proj.weight"][:, rank * f : (rank + 1) * f]
        port.load_state_dict(new)
        return port.eval()


def tp_port_dims(config, fused: bool = True) -> dict[str, str]:
    """The ``dims=`` of the port's sharded entries, from a ``LlamaConfig`` (full-model widths).

    ``qkv`` is fused from q, k and v and ``gate_up`` from gate and up, each segment
    split over tp on its own; ``o`` and ``down`` return partial sums. ``fused=False``
    writes what a user unaware of the layout would (``h(tp)``: rank after rank).

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> cfg = SimpleNamespace(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    ...                       intermediate_size=64)
    >>> tp_port_dims(cfg)[r"\\.attn\\.qkv$"]
    'b s h(tp,fused=q:32,k:16,v:16)'
    """
    hd = config.hidden_size // config.num_attention_heads
    q, kv, f = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    return {
        r"\.attn\.qkv$": f"b s h(tp,fused=q:{q},k:{kv},v:{kv})" if fused else "b s h(tp)",
        r"\.ffn\.gate_up$": f"b s f(tp,fused=gate:{f},up:{f})" if fused else "b s f(tp)",
        r"\.(attn\.o|ffn\.down)$": "b s h(tp,partial)",
    }


def hf_port_mapping(config) -> dict[str, object]:
    """Mapping rules from the Hugging Face model's entries to the port's (unsharded) ones.

    q, k and v are cut out of the fused ``qkv``, gate and up out of ``gate_up``,
    by their full-model widths from ``config``.
    """
    hd = config.hidden_size // config.num_attention_heads
    q, kv, f = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    a, b = r"model\.model\.layers\.(\d+)\.", r"model.blocks.\1."
    return {
        r"model\.model\.embed_tokens": "model.embed",
        r"model\.model\.norm": "model.final_norm",
        r"model\.lm_head": "model.head",
        a + r"input_layernorm": b + "attn_norm",
        a + r"post_attention_layernorm": b + "mlp_norm",
        a + r"self_attn\.q_proj": [b + "attn.qkv", f"narrow(-1, 0, {q})"],
        a + r"self_attn\.k_proj": [b + "attn.qkv", f"narrow(-1, {q}, {kv})"],
        a + r"self_attn\.v_proj": [b + "attn.qkv", f"narrow(-1, {q + kv}, {kv})"],
        a + r"self_attn\.o_proj": b + "attn.o",
        a + r"mlp\.gate_proj": [b + "ffn.gate_up", f"narrow(-1, 0, {f})"],
        a + r"mlp\.up_proj": [b + "ffn.gate_up", f"narrow(-1, {f}, {f})"],
        a + r"mlp\.down_proj": b + "ffn.down",
    }


def _capture_rank(
    out: Path, rank: int, size: int, seed: int, steps: int, fault: str | None, fused: bool = True
) -> None:
    import tdinspect

    hf = make_hf_llama(seed)
    port = TPLlamaPort.from_hf(hf, rank, size, fault)
    with (
        torch.no_grad(),
        tdinspect.capture(
            port, out, dims=tp_port_dims(hf.config, fused), parallel={"tp": (rank, size)}
        ) as dump,
    ):
        for step in range(steps):
            port(port_tokens(seed + step))
            dump.step()


def capture_hf(root: str | os.PathLike, seed: int = 0, steps: int = 1) -> Path:
    """Capture the Hugging Face reference (:func:`make_hf_llama`) on :func:`port_tokens` into ``root``."""
    import tdinspect

    hf = make_hf_llama(seed)
    with torch.no_grad(), tdinspect.capture(hf, root) as dump:
        for step in range(steps):
            hf(port_tokens(seed + step))
            dump.step()
    return Path(root)


def capture_tp_port(
    root: str | os.PathLike,
    size: int = 2,
    seed: int = 0,
    steps: int = 1,
    fault: tuple[int, str] | None = None,
    fused: bool = True,
    timeout: float = 300.0,
) -> Path:
    """Capture the port at tensor-parallel ``size`` into ``root``, one process per rank.

    With ``size > 1`` the ranks are separate processes in a real ``gloo`` group
    (``python -m tdinspect.examples.port_tp``); ``size=1`` runs here. Every rank
    records ``parallel={"tp": (rank, size)}`` and :func:`tp_port_dims`.

    Parameters
    ----------
    root : path
        The dump folder (the ranks' folders go under it).
    size : int
        Tensor-parallel size (dividing the key/value heads: 1 or 2 for the tiny Llama).
    seed, steps : int
        The weights' seed (:func:`make_hf_llama`) and how many forwards (one pass each,
        on ``port_tokens(seed + step)``).
    fault : (rank, "k"), optional
        Plant a bug on one rank (:meth:`TPLlamaPort.from_hf`).
    fused : bool
        Record the fused dims (``False``: plain ``h(tp)``, see :func:`tp_port_dims`).
    timeout : float
        Seconds each rank may take.

    Returns
    -------
    Path
        ``root``.

    Examples
    --------
    >>> capture_tp_port("dumps/tp2_bad", size=2, fault=(1, "k"))   # doctest: +SKIP
    PosixPath('dumps/tp2_bad')
    """
    root = Path(root)
    if size == 1:
        _capture_rank(root, 0, 1, seed, steps, fault[1] if fault and fault[0] == 0 else None, fused)
        return root
    root.mkdir(parents=True, exist_ok=True)
    spawn_ranks(
        "tdinspect.examples.port_tp",
        size,
        root.parent / f".{root.name}.store",  # the gloo rendezvous (a fresh file per run)
        lambda r: [
            str(root),
            str(seed),
            str(steps),
            str(int(fused)),
            fault[1] if fault and fault[0] == r else "",
        ],
        timeout,
    )
    return root


def main(argv: list[str]) -> None:
    """Worker: ``RANK SIZE STORE OUT SEED STEPS FUSED [FAULT]`` (see :func:`capture_tp_port`)."""
    rank, size, store, out, seed, steps = (
        int(argv[0]),
        int(argv[1]),
        argv[2],
        argv[3],
        int(argv[4]),
        int(argv[5]),
    )
    fused, fault = argv[6] == "1", (argv[7] if len(argv) > 7 and argv[7] else None)
    with joined(rank, size, store):
        _capture_rank(Path(out), rank, size, seed, steps, fault, fused)


if __name__ == "__main__":
    main(sys.argv[1:])
