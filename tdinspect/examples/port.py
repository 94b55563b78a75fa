"""A hand-written port of a tiny Hugging Face Llama: the "compare a port" example.

:class:`LlamaPort` computes what ``transformers``' ``LlamaForCausalLM`` computes,
written as an engine might write it: other attribute names (``blocks.N.attn``,
``ffn``, ``head``), fused ``qkv`` and ``gate_up`` projections, its own
:class:`RMSNorm` class, rotary embeddings computed inline. Loaded with the
weights of a Hugging Face model (:meth:`LlamaPort.from_hf`) its outputs match
the reference's to float32 noise; ``rope="interleaved"`` is a classic porting
bug (pairs ``(x0, x1), (x2, x3)...`` rotated instead of the two halves).

The port imports torch only; :func:`make_hf_llama` imports ``transformers``
(random weights from a config: nothing is downloaded).

Examples
--------
>>> hf = make_hf_llama(seed=0)                                      # doctest: +SKIP
>>> port = LlamaPort.from_hf(hf)                                    # doctest: +SKIP
>>> ids = port_tokens()                                             # doctest: +SKIP
>>> (port(ids) - hf(ids).logits).abs().max() < 1e-5                 # doctest: +SKIP
tensor(True)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
    max_position_embeddings=64,
)


@dataclass
class PortConfig:
    """The port's own settings (read from a ``LlamaConfig`` by :meth:`from_hf`)."""

    dim: int = 32
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 100
    eps: float = 1e-6
    theta: float = 10000.0

    @classmethod
    def from_hf(cls, config) -> PortConfig:
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.vocab_size,
            config.rms_norm_eps,
            float(theta),
        )


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learnt ``scale`` (the port's own class)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.scale * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, style: str) -> torch.Tensor:
    """Rotary position embedding of ``x`` (``b h s d``): ``"half"`` (Llama's) or ``"interleaved"``."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = positions[:, None].float() * inv_freq  # s x d/2
    if style == "half":  # cos and sin in x's dtype, as Llama's (a bfloat16 port stays bfloat16)
        cos = torch.cat([freqs, freqs], -1).cos().to(x.dtype)
        sin = torch.cat([freqs, freqs], -1).sin().to(x.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin
    if style == "interleaved":
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)
    raise ValueError(f"rope={style!r}: expected 'half' or 'interleaved'")


class Attention(nn.Module):
    """Grouped-query attention with one fused ``qkv`` projection."""

    def __init__(self, cfg: PortConfig, rope: str):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        self.head_dim = cfg.dim // cfg.heads
        self.qkv = nn.Linear(cfg.dim, (cfg.heads + 2 * cfg.kv_heads) * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c, hd = self.cfg, self.head_dim
        q, k, v = self.qkv(x).split([c.heads * hd, c.kv_heads * hd, c.kv_heads * hd], -1)
        q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))
        pos = torch.arange(s)
        q, k = rotate(q, pos, c.theta, self.rope), rotate(k, pos, c.theta, self.rope)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU with one fused ``gate_up`` projection."""

    def __init__(self, cfg: PortConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm attention then feed-forward (``attn`` / ``ffn`` given: a sharded port's own)."""

    def __init__(
        self, cfg: PortConfig, rope: str, attn: nn.Module | None = None, ffn: nn.Module | None = None
    ):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg, rope) if attn is None else attn
        self.mlp_norm = RMSNorm(cfg.dim, cfg.eps)
        self.ffn = FeedForward(cfg) if ffn is None else ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.mlp_norm(x))


class LlamaPort(nn.Module):
    """The port: token ids ``b s`` -> logits ``b s vocab``.

    Parameters
    ----------
    cfg : PortConfig
    rope : {"half", "interleaved"}
        ``"half"`` is Llama's rotary embedding; ``"interleaved"`` the porting bug.
    blocks : list of nn.Module, optional
        The layers (default: one :class:`Block` per ``cfg.layers``).
    """

    def __init__(self, cfg: PortConfig, rope: str = "half", blocks: list[nn.Module] | None = None):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = (
            nn.ModuleList(Block(cfg, rope) for _ in range(cfg.layers))
            if blocks is None
            else nn.ModuleList(blocks)
        )
        self.final_norm = RMSNorm(cfg.dim, cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))

    @classmethod
    def from_hf(cls, hf_model: nn.Module, rope: str = "half") -> LlamaPort:
        """A port holding the weights of a ``LlamaForCausalLM`` (fused where the port fuses)."""
        port = cls(PortConfig.from_hf(hf_model.config), rope)
        sd = hf_model.state_dict()
        new = {
            "embed.weight": sd["model.embed_tokens.weight"],
            "final_norm.scale": sd["model.norm.weight"],
            "head.weight": sd["lm_head.weight"],
        }
        for i in range(len(port.blocks)):
            p = f"model.layers.{i}."
            new[f"blocks.{i}.attn_norm.scale"] = sd[p + "input_layernorm.weight"]
            new[f"blocks.{i}.mlp_norm.scale"] = sd[p + "post_attention_layernorm.weight"]
            new[f"blocks.{i}.attn.qkv.weight"] = torch.cat(
                [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            )
            new[f"blocks.{i}.attn.o.weight"] = sd[p + "self_attn.o_proj.weight"]
            new[f"blocks.{i}.ffn.gate_up.weight"] = torch.cat(
                [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
            )
            new[f"blocks.{i}.ffn.down.weight"] = sd[p + "mlp.down_proj.weight"]
        port.load_state_dict(new)
        return port.eval()


def make_hf_llama(seed: int = 0, **overrides) -> nn.Module:
    """A tiny ``transformers`` ``LlamaForCausalLM`` with random weights (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def port_tokens(seed: int = 0, length: int = 12, batch: int = 2, vocab: int = 100) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def capture_port_pair(
    root: str | os.PathLike, rope: str = "half", steps: int = 1, seed: int = 0
) -> tuple[Path, Path]:
    """Capture the HF reference and its port (same weights, same tokens) under ``root``.

    Returns the two dump folders ``(root/reference, root/port)``.
    """
    import tdinspect

    root = Path(root)
    hf = make_hf_llama(seed)
    port = LlamaPort.from_hf(hf, rope=rope)
    out = []
    for name, model in (("reference", hf), ("port", port)):
        with torch.no_grad(), tdinspect.capture(model, root / name) as dump:
            for step in range(steps):
                model(port_tokens(seed + step))
                dump.step()
        out.append(root / name)
    return out[0], out[1]
