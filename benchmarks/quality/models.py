"""Uneven models for the plan-quality benchmark (``benchmarks.quality.models:NAME``).

``uneven``: a small CNN whose cost and parameters sit at opposite ends.  Shapes: B = batch,
C = channels, H = W = side.  Early blocks run at full resolution with few channels (most of
the compute, few parameters); late blocks run at low resolution with many channels, and a
wide fully connected head holds most of the parameters for little compute.  Balancing
parameters (``params``) or unit counts (``uniform``) therefore lands far from balancing time.

``uneven_mlp``: an MLP whose hidden widths vary by 32x, with the wide layers first, so
equal layer counts are unbalanced (parameters still track compute, as in any MLP).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeplan.intake.model import ModelSpec
from pipeplan.models._common import build_seeded, generator

__all__ = ["uneven", "uneven_mlp"]


class ConvBlock(nn.Module):
    """3x3 conv + ReLU, then an optional 2x2 max-pool: (B, C_in, H, W) -> (B, C_out, H', W')."""

    def __init__(self, c_in: int, c_out: int, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.pool = pool

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.conv(x))
        return F.max_pool2d(x, 2) if self.pool else x


class Dense(nn.Module):
    """Flatten (if needed) + Linear (+ ReLU unless last)."""

    def __init__(self, d_in: int, d_out: int, last: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.last = last

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x.flatten(1))
        return y if self.last else F.relu(y)


def uneven(side: int = 32, classes: int = 10, seed: int = 0) -> ModelSpec:
    """``benchmarks.quality.models:uneven``: 7 conv blocks and 3 dense layers, as one Sequential.

    >>> spec = uneven(side=16)
    >>> (x,), y = spec.batch(2)
    >>> spec.module(x).shape
    torch.Size([2, 10])
    """
    plan = [(3, 32, False), (32, 32, True), (32, 64, False), (64, 64, True),
            (64, 128, False), (128, 128, True), (128, 256, True)]  # fmt: skip
    if side <= 0 or side % 16:
        raise ValueError(f"side must be a positive multiple of 16 (4 max-pools), got {side}")
    final = side // 16

    def build() -> nn.Module:
        blocks: list[nn.Module] = [ConvBlock(a, b, p) for a, b, p in plan]
        blocks += [Dense(256 * final * final, 2048), Dense(2048, 2048),
                   Dense(2048, classes, last=True)]  # fmt: skip
        return nn.Sequential(*blocks)

    module = build_seeded(seed, build)

    def make_batch(batch_size: int) -> tuple[Tensor, Tensor]:
        g = generator(seed, batch_size)
        x = torch.randn(batch_size, 3, side, side, generator=g)
        return x, torch.randint(classes, (batch_size,), generator=g)

    return ModelSpec(module, make_batch, F.cross_entropy)


def uneven_mlp(in_features: int = 256, classes: int = 10, seed: int = 0) -> ModelSpec:
    """``benchmarks.quality.models:uneven_mlp``: widths 256-2048-1024-2048-128-512-128-64.

    >>> spec = uneven_mlp()
    >>> (x,), y = spec.batch(2)
    >>> spec.module(x).shape
    torch.Size([2, 10])
    """
    widths = [in_features, 2048, 1024, 2048, 128, 512, 128, 64]

    def build() -> nn.Module:
        layers: list[nn.Module] = [Dense(a, b) for a, b in itertools.pairwise(widths)]
        layers.append(Dense(widths[-1], classes, last=True))
        return nn.Sequential(*layers)

    module = build_seeded(seed, build)

    def make_batch(batch_size: int) -> tuple[Tensor, Tensor]:
        g = generator(seed, batch_size)
        x = torch.randn(batch_size, in_features, generator=g)
        return x, torch.randint(classes, (batch_size,), generator=g)

    return ModelSpec(module, make_batch, F.cross_entropy)
