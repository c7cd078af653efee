"""A model for ``test_runtime_weights``: a parameter of its own that nothing initialises on meta
(its module has no ``reset_parameters``), so ``--init stage`` must refuse it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeplan.intake.model import ModelSpec


class Scaled(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x)) * self.gain


class Bare(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.Sequential(Scaled(width), Scaled(width))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)  # type: ignore[no-any-return]


def bare() -> ModelSpec:
    torch.manual_seed(0)

    def make_batch(b: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(b, 8, generator=g), torch.randn(b, 8, generator=g)

    return ModelSpec(Bare(), make_batch, F.mse_loss)
