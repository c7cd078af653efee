"""A GPT-style decoder: token + position embedding, pre-norm blocks, LM head tied to the embedding.

Shapes: B = batch, T = tokens (``seq_len``), D = ``d_model``, H = heads, V = ``vocab``.
The embedding (V x D parameters) and the head (a B·T x D x V matmul and B·T x V logits) make the
first and last units heavy; the blocks in between are uniform.  With ``tie_weights`` the head
reuses the embedding's weight, as GPT-2 does, so a pipeline must keep the two stages' copies
tied.  The forward has no data-dependent control flow, so ``torch.fx`` traces it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeplan.intake.model import ModelSpec
from pipeplan.models._common import build_seeded, next_token_task, positive

__all__ = ["GPT", "Block", "gpt"]


class Embed(nn.Module):
    def __init__(self, vocab: int, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.empty(seq_len, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The learned position table, N(0, 0.02²) (``Embed`` owns it; ``tok`` resets itself)."""
        with torch.no_grad():
            self.pos.normal_(0.0, 0.02)

    def forward(self, idx: Tensor) -> Tensor:  # (B, T) -> (B, T, D)
        return self.tok(idx) + self.pos[: idx.size(1)]


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, D) each
        q, k, v = (t.unflatten(-1, (self.n_heads, -1)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        return self.proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, V)
        return self.proj(self.norm(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, d_model: int, n_layers: int, n_heads: int, seq_len: int, tie: bool
    ) -> None:
        super().__init__()
        self.embed = Embed(vocab, d_model, seq_len)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.head = Head(d_model, vocab)
        if tie:
            self.head.proj.weight = self.embed.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def gpt(
    vocab: int = 8192,
    d_model: int = 128,
    n_layers: int = 6,
    n_heads: int = 4,
    seq_len: int = 64,
    tie_weights: bool = True,
    seed: int = 0,
) -> ModelSpec:
    """``pipeplan.models.gpt:gpt``: next-token prediction on seeded random tokens.

    >>> spec = gpt(vocab=64, d_model=16, n_layers=2, n_heads=2, seq_len=8)
    >>> (ids,), target = spec.batch(3)
    >>> spec.module(ids).shape, spec.loss(spec.module(ids), target).item() > 0
    (torch.Size([3, 8, 64]), True)
    """
    positive(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len)
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
    module = build_seeded(
        seed, lambda: GPT(vocab, d_model, n_layers, n_heads, seq_len, bool(tie_weights))
    )
    return ModelSpec(module, *next_token_task(vocab, seq_len, seed))
