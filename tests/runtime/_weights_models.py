"""Models for the runtime's weight tests: ``bare`` has a parameter of its own that nothing
initialises on meta (its module has no ``reset_parameters``), so ``--init stage`` must refuse
it (``test_weights``); ``dropped`` draws dropout masks every step
(``test_saving``)."""

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


class Dropped(nn.Module):
    """Linear layers with dropout between them: each step draws from the ranks' RNG, so a
    resumed run equals an uninterrupted one only if the RNG states were saved."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.drop = nn.Dropout(0.25)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return x


def dropped() -> ModelSpec:
    torch.manual_seed(0)

    def make_batch(b: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(b, 16, generator=g), torch.randn(b, 16, generator=g)

    return ModelSpec(Dropped(), make_batch, F.mse_loss)
