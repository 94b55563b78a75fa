"""The bundled models: a tiny decoder-only transformer and the LayerNorm example.

They are real ``nn.Module``s used by the demo, the sample dumps, the tests and
the benchmarks, so every figure and test runs on the same code.

Examples
--------
>>> model = TinyTransformer(d_model=32, n_layers=2, n_heads=2, vocab=50)
>>> model(torch.randint(0, 50, (1, 8))).shape
torch.Size([1, 8, 50])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/o projections."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.o_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.n_heads

        def heads(t):
            return t.view(b, s, h, d // h).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    """Two linear layers around a GELU."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A decoder-only transformer with an "expert" refined over several Euler steps.

    The expert is one module called ``euler_steps`` times per forward, so its
    outputs are dumped as ``model.expert``, ``model.expert::call1``, ...

    Parameters
    ----------
    d_model, n_layers, n_heads, mlp_ratio, vocab : int
        The usual sizes.
    euler_steps : int
        How many times the expert runs per forward (0 to skip it).
    """

    def __init__(
        self,
        d_model: int = 64,
        n_layers: int = 4,
        n_heads: int = 4,
        mlp_ratio: int = 4,
        vocab: int = 100,
        euler_steps: int = 3,
    ):
        super().__init__()
        self.euler_steps = euler_steps
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads, mlp_ratio) for _ in range(n_layers))
        self.expert = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        for _ in range(self.euler_steps):
            x = x + 0.1 * self.expert(x)
        return self.lm_head(self.norm(x))


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **sizes) -> TinyTransformer:
    """A :class:`TinyTransformer` with weights drawn from ``seed`` (same seed, same weights)."""
    with torch.random.fork_rng(devices=[]):  # seeded weights, caller's RNG untouched
        torch.manual_seed(seed)
        model = TinyTransformer(**sizes)
    return model.to(dtype).eval()


class CompiledGELU(nn.GELU):
    """A GELU whose compiled form is the tanh approximation: the same module computes other
    numbers under ``torch.compile`` than eagerly, as a kernel swapped by a compiler does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return F.gelu(x, approximate="tanh")
        return super().forward(x)


def make_compile_sensitive(seed: int = 0, layer: int = 1, **sizes) -> TinyTransformer:
    """:func:`make_model` whose ``layers[layer].mlp.act`` is a :class:`CompiledGELU`: its
    eager and compiled runs first differ at ``model.layers.<layer>.mlp.act``.

    Examples
    --------
    >>> type(make_compile_sensitive().layers[1].mlp.act).__name__
    'CompiledGELU'
    """
    model = make_model(seed, **sizes)
    model.layers[layer].mlp.act = CompiledGELU()
    return model


def make_tokens(batch: int = 2, seq: int = 16, vocab: int = 100, seed: int = 1) -> torch.Tensor:
    """Deterministic token ids."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def layernorm_test(
    dtype: torch.dtype = torch.bfloat16, device: str = "cpu", shape: tuple[int, ...] = (1, 64, 32)
) -> torch.Tensor:
    """The design document's LayerNorm example: forward, a scaled sum, backward.

    Returns the LayerNorm weight gradient.
    """
    activations = torch.randn(*shape).to(device).to(dtype)
    layernorm = nn.LayerNorm(shape[-1]).to(device).to(dtype)
    result = layernorm(activations)
    sum_out = result.sum() * 0.0001
    sum_out.backward()
    return layernorm.weight.grad
