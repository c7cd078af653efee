"""Models for ``test_units.py``: a stack of identical layers, and layers that differ only in
behaviour (a local and a global attention, alternating)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeplan.intake.model import ModelSpec


class Dense(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x))


def stack(n_layers: int = 4, width: int = 64) -> ModelSpec:
    """``n_layers`` identical ``Dense`` layers of ``width`` (4 x width^2 bytes of weights each)."""
    module = nn.Sequential(*[Dense(width) for _ in range(n_layers)])

    def make_batch(b: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(b, width, generator=g), torch.randn(b, width, generator=g)

    return ModelSpec(module, make_batch, F.mse_loss)


class Attention(nn.Module):
    """Single-head causal attention over (B, T, W).  ``window`` set: each position sees only the
    last ``window`` positions (local attention).  The mask is made in ``forward`` (so the traced
    graph differs), or with ``banded`` held as a buffer (the same graph, other values)."""

    def __init__(self, width: int, seq: int, window: int | None, banded: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.window = None if banded else window
        self.banded = banded
        blocked = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        if banded and window is not None:
            blocked = blocked | torch.ones(seq, seq, dtype=torch.bool).tril(-window)
        self.register_buffer("blocked", blocked)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        if self.banded:
            blocked = self.blocked
        else:
            t = x.shape[1]
            blocked = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            if self.window is not None:
                far = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-self.window)
                blocked = blocked | far
        scores = scores.masked_fill(blocked, float("-inf"))
        return x + scores.softmax(-1) @ v


def alternating(
    n_layers: int = 4, width: int = 16, seq: int = 8, window: int = 3, banded: bool = False
) -> tuple[Any, Any, Any]:
    """Even layers global, odd layers local (``window``): same shapes, other behaviour."""
    layers = [Attention(width, seq, window if i % 2 else None, banded) for i in range(n_layers)]
    module = nn.Sequential(*layers)

    def make_batch(b: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(b, seq, width, generator=g), torch.randn(b, seq, width, generator=g)

    return module, make_batch, F.mse_loss
