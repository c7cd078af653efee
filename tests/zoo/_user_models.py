"""Models as a new user writes them, with nothing adapted to pipeplan (used by test_user_models).

- ``sequential``: one ``nn.Sequential`` body of 25 mixed layers behind a wrapper, with one
  dominant layer (an MLP 8x wider, item 14) and a separate output layer;
- ``dict_output``: ``forward`` returns a dict, the loss reads one of its keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Wrapped(nn.Module):
    """``body``: Linear, ReLU, then 11 x (Linear, Tanh) the 7th a wide MLP (25 layers)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
        for k in range(11):
            layers += [_Wide(width) if k == 6 else nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, width))
        self.body = nn.Sequential(*layers)
        self.out = nn.Linear(width, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.body(x))


class _Wide(nn.Sequential):
    """The dominant layer: width -> 8 width -> width."""

    def __init__(self, width: int) -> None:
        super().__init__(nn.Linear(width, 8 * width), nn.GELU(), nn.Linear(8 * width, width))


def sequential() -> tuple[nn.Module, object, object]:
    torch.manual_seed(0)
    net = Wrapped()
    return net, lambda b: (torch.randn(b, 8), torch.randn(b, 4)), F.mse_loss


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h))
        return {"logits": self.c(h), "hidden": h}


def dict_output() -> tuple[nn.Module, object, object]:
    torch.manual_seed(0)

    def loss(out: dict[str, Tensor], y: Tensor) -> Tensor:
        return F.cross_entropy(out["logits"], y)

    return DictNet(), lambda b: (torch.randn(b, 16), torch.randint(0, 4, (b,))), loss
