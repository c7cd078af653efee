"""A deep uniform MLP: ``depth`` identical Linear+ReLU layers and a linear classifier.

Every layer costs the same (B x W x W flops, W x W parameters), so a balanced partition is
simply equal counts of layers: a sanity check for the solvers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeplan.intake.model import ModelSpec
from pipeplan.models._common import build_seeded, generator, positive

__all__ = ["Layer", "mlp"]


class Layer(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.linear(x))


class MLP(nn.Module):
    def __init__(self, width: int, depth: int, in_features: int, classes: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(Layer(in_features if i == 0 else width, width) for i in range(depth))
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:  # (B, in_features) -> (B, classes)
        return self.head(self.layers(x))


def mlp(
    width: int = 1024, depth: int = 8, in_features: int = 1024, classes: int = 10, seed: int = 0
) -> ModelSpec:
    """``pipeplan.models.mlp:mlp``: classify seeded Gaussian vectors into random classes.

    >>> spec = mlp(width=8, depth=3, in_features=4, classes=2)
    >>> (x,), y = spec.batch(5)
    >>> spec.module(x).shape
    torch.Size([5, 2])
    """
    positive(width=width, depth=depth, in_features=in_features, classes=classes)
    module = build_seeded(seed, lambda: MLP(width, depth, in_features, classes))

    def make_batch(batch_size: int) -> tuple[Tensor, Tensor]:
        g = generator(seed, batch_size)
        x = torch.randn(batch_size, in_features, generator=g)
        return x, torch.randint(classes, (batch_size,), generator=g)

    return ModelSpec(module, make_batch, F.cross_entropy)
