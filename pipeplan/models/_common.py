"""Helpers shared by the bundled models: seeded construction and seeded batches."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__: list[str] = []


def build_seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Call ``build`` with the global RNG seeded, leaving the caller's RNG state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def generator(seed: int, batch_size: int) -> torch.Generator:
    """A CPU generator whose stream depends only on ``seed`` and ``batch_size``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + batch_size)


def positive(**knobs: int) -> None:
    """Check size knobs at the boundary: each must be a positive integer."""
    for name, value in knobs.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def next_token_task(
    vocab: int, seq_len: int, seed: int
) -> tuple[Callable[[int], tuple[Tensor, Tensor]], Callable[[Tensor, Tensor], Tensor]]:
    """``make_batch`` (seeded random tokens, target = input shifted by one) and a mean loss."""

    def make_batch(batch_size: int) -> tuple[Tensor, Tensor]:
        shape = (batch_size, seq_len + 1)
        tokens = torch.randint(vocab, shape, generator=generator(seed, batch_size))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss(logits: Tensor, target: Tensor) -> Tensor:  # (B, T, V), (B, T) -> mean over B·T
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    return make_batch, loss
