"""A toy serving engine on a Hugging Face Llama: packed tokens, continuous batching, a flat KV cache.

:class:`PackedLlama` runs a ``LlamaForCausalLM``'s own modules the way a serving engine
does: the tokens of every request in a step are packed into one ``[1, total_tokens,
hidden]`` row, a prefill (or a chunk of one) beside other requests' decode steps;
attention sees, for each token, its own request's earlier tokens only (a block-diagonal
causal mask over one flat KV cache of every token computed so far). Module names are the
reference's (``model.model.layers.0.self_attn``), so the two runs compare by name once
their tokens are lined up (``DumpSet.diff(other, tokens=True)``).

``bug=(request, k)`` plants a KV-cache bug: that request's tokens at positions ``>= k``
do not see its first token. :func:`capture_engine` records each step with its token
layout; :func:`capture_reference` runs the Hugging Face model one request at a time, or
the requests padded into one batch with an attention mask.

Examples
--------
>>> hf = make_hf_llama(seed=0)                                          # doctest: +SKIP
>>> prompts = engine_prompts()                                          # lengths 5, 9 and 16
>>> capture_reference(hf, prompts, "dumps/hf")                          # doctest: +SKIP
>>> capture_engine(PackedLlama(hf), prompts, CONTINUOUS, "dumps/engine")  # doctest: +SKIP
>>> DumpSet.open("dumps/hf").diff("dumps/engine", tokens=True).verdict().outcome  # doctest: +SKIP
'matches'
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

LENGTHS = (5, 9, 16)

#: Every prompt packed into one step: ``[1, 30, hidden]``.
PACKED = [[(0, 5), (1, 9), (2, 16)]]

#: Continuous batching: ``(request, tokens fed)`` per step. Request 0 prefills 3 tokens
#: beside a chunk of request 1, request 2 joins in step 1, requests leave when done.
CONTINUOUS = [
    [(0, 3), (1, 6)],
    [(0, 1), (1, 1), (2, 12)],
    [(0, 1), (1, 1), (2, 1)],
    [(1, 1), (2, 1)],
    [(2, 1)],
    [(2, 1)],
]


def engine_prompts(seed: int = 0, lengths=LENGTHS, vocab: int = 100) -> list[torch.Tensor]:
    """One prompt of token ids per request, of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


class FlatCache:
    """Keys and values of every token computed so far, per layer, in one flat sequence
    (what ``LlamaAttention`` calls ``cache.update`` on)."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers

    def update(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, **_
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer_idx] is not None:
            k = torch.cat([self.k[layer_idx], k], 2)
            v = torch.cat([self.v[layer_idx], v], 2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v


def step_mask(
    keys_request: torch.Tensor, keys_position: torch.Tensor, request: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """``[T, K]``: which of the flat cache's keys (every token so far, this step's last) each
    of the step's ``T`` tokens attends to: its own request's, up to its own position."""
    return (keys_request[None, :] == request[:, None]) & (keys_position[None, :] <= position[:, None])


class PackedLlama(nn.Module):
    """A ``LlamaForCausalLM``'s modules run on packed tokens with continuous batching.

    Parameters
    ----------
    hf : LlamaForCausalLM
        The reference; its modules (and weights) are used as they are.
    bug : (request, k), optional
        Plant a KV-cache bug: that request's positions ``>= k`` do not attend to its first token.
    logits : {"all", "last"}
        ``"last"``: the head runs on each sequence's last token of the step only (as engines
        do), an output that is not token-major.
    """

    def __init__(self, hf: nn.Module, bug: tuple[int, int] | None = None, logits: str = "all"):
        super().__init__()
        self.model, self.lm_head = hf.model, hf.lm_head
        self.bug, self.logits = bug, logits
        self.reset()

    def reset(self) -> None:
        """Forget every request (an empty KV cache)."""
        self.cache = FlatCache(len(self.model.layers))
        self.kv_request = torch.empty(0, dtype=torch.long)
        self.kv_position = torch.empty(0, dtype=torch.long)

    def forward(self, ids: torch.Tensor, request: torch.Tensor, position: torch.Tensor) -> dict:
        """One step: token ``ids``, their ``request`` and ``position`` (each ``[T]``) -> ``{"logits"}``."""
        keys_r = torch.cat([self.kv_request, request])
        keys_p = torch.cat([self.kv_position, position])
        mask = step_mask(keys_r, keys_p, request, position)
        if self.bug is not None:
            r, k = self.bug
            late = (request == r) & (position >= k)
            mask[late] &= ~((keys_r == r) & (keys_p == 0))
        x = self.model.embed_tokens(ids[None])
        cos_sin = self.model.rotary_emb(x, position[None])
        for layer in self.model.layers:
            x = layer(
                x,
                attention_mask=mask[None, None],
                position_ids=position[None],
                cache=self.cache,
                position_embeddings=cos_sin,
            )
        x = self.model.norm(x)
        if self.logits == "last":
            ends = torch.nonzero(torch.cat([request[1:] != request[:-1], torch.tensor([True])])).flatten()
            x = x[:, ends]
        self.kv_request, self.kv_position = keys_r, keys_p
        return {"logits": self.lm_head(x)}


def capture_engine(
    engine: PackedLlama, prompts: list[torch.Tensor], schedule, path: str | os.PathLike
) -> Path:
    """Serve ``prompts`` by ``schedule`` (``[(request, tokens fed), ...]`` per step) under a
    capture at ``path``, each step recorded with its token layout; returns ``path``."""
    import tdinspect

    engine.reset()
    with torch.no_grad(), tdinspect.capture(engine, path) as dump:
        for ids, req, pos, layout in engine_steps(prompts, schedule):
            engine(ids, req, pos)
            dump.step(tokens=layout)
    return Path(path)


def engine_steps(prompts: list[torch.Tensor], schedule):
    """Each step of ``schedule`` (``[(request, tokens fed), ...]``) packed:
    ``(ids, request, position, layout)``, the first three ``[T]``, ``layout`` the step's
    :func:`tdinspect.tokens` for tensors ``[1, T, ...]``."""
    import tdinspect

    fed = [0] * len(prompts)
    for step in schedule:
        ids, req, pos, lens = [], [], [], []
        for r, n in step:
            if not 0 < n <= len(prompts[r]) - fed[r]:
                raise ValueError(
                    f"schedule step {step}: request {r} has {len(prompts[r]) - fed[r]} tokens left, not {n}"
                )
            ids.append(prompts[r][fed[r] : fed[r] + n])
            req.append(torch.full((n,), r))
            pos.append(torch.arange(fed[r], fed[r] + n))
            lens.append(n)
            fed[r] += n
        ids, req, pos = torch.cat(ids), torch.cat(req), torch.cat(pos)
        layout = tdinspect.tokens(
            request_ids=[r for r, _ in step], positions=pos, seq_lens=lens, shape=(1, len(ids))
        )
        yield ids, req, pos, layout


def capture_reference(
    hf: nn.Module, prompts: list[torch.Tensor], path: str | os.PathLike, *, padded: bool = False
) -> Path:
    """The Hugging Face model on ``prompts`` under a capture at ``path``: one pass per request,
    or (``padded``) one right-padded batch with its attention mask; returns ``path``."""
    import tdinspect

    with torch.no_grad(), tdinspect.capture(hf, path) as dump:
        if padded:
            width = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros(len(prompts), width, dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, : len(p)], mask[i, : len(p)] = p, 1
            hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
            dump.step(tokens=tdinspect.tokens(attention_mask=mask))
        else:
            for r, p in enumerate(prompts):
                hf(p[None])
                dump.step(tokens=tdinspect.tokens(request_ids=[r], seq_lens=[len(p)], shape=(1, len(p))))
    return Path(path)
