"""Helpers shared by the bundled models: seeded construction and seeded batches."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__: list[str] = []


def build_seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Call ``build`` with the global RNG seeded, leaving the caller's RNG state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def generator(seed: int, batch_size: int) -> torch.Generator:
    """A CPU generator whose stream depends only on ``seed`` and ``batch_size``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + batch_size)


def positive(name: str, value: int) -> int:
    """Check a size knob at the boundary."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
