"""A ResNet-style CNN with residual connections and GroupNorm.

Shapes: B = batch, C = channels, S = image side.  Stage i has ``width * 2**i`` channels at side
``image / 2**i``: activations are heavy early and parameters heavy late, so the best cut is not
in the middle.  Every block's shortcut is a skip tensor live across any cut inside the block.
GroupNorm instead of BatchNorm: its statistics are per sample, so micro-batching does not change
the gradient and a pipeline's gradients equal the full batch's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeplan.intake.model import ModelSpec
from pipeplan.models._common import build_seeded, generator, positive

__all__ = ["BasicBlock", "resnet"]


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(channels, 8), channels)


class BasicBlock(nn.Module):
    """relu(norm(conv(relu(norm(conv(x))))) + shortcut(x)); the shortcut downsamples if needed."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = _norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = _norm(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), _norm(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


class Stem(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.norm = _norm(width)

    def forward(self, x: Tensor) -> Tensor:  # (B, 3, S, S) -> (B, width, S, S)
        return F.relu(self.norm(self.conv(x)))


class Head(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, s, s) -> (B, classes)
        return self.fc(x.mean(dim=(2, 3)))


class ResNet(nn.Module):
    def __init__(self, width: int, blocks: Sequence[int], classes: int) -> None:
        super().__init__()
        self.stem = Stem(width)
        stages, c_in = [], width
        for i, n in enumerate(blocks):
            c_out = width * 2**i
            layer = [
                BasicBlock(c_in if j == 0 else c_out, c_out, 2 if i and not j else 1)
                for j in range(n)
            ]
            stages.append(nn.Sequential(*layer))
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = Head(c_in, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))


def _parse_blocks(blocks: Sequence[int] | str | int) -> tuple[int, ...]:
    if isinstance(blocks, int):
        positive(blocks=blocks)
        return (blocks,) * 4
    if isinstance(blocks, str):
        try:
            blocks = [int(b) for b in blocks.split(",") if b.strip()]
        except ValueError:
            raise ValueError(
                f"blocks {blocks!r} is not a list of integers; write e.g. 2,2,2,2"
            ) from None
    out = tuple(blocks)
    positive(**{f"blocks[{i}]": b for i, b in enumerate(out)})
    if not out:
        raise ValueError("blocks must name at least one stage, e.g. 2,2,2,2")
    return out


def resnet(
    width: int = 16,
    blocks: Sequence[int] | str | int = (2, 2, 2, 2),
    image: int = 32,
    classes: int = 10,
    seed: int = 0,
) -> ModelSpec:
    """``pipeplan.models.resnet:resnet``: classify seeded random images (``blocks`` may be ``"2,2,2,2"``).

    >>> spec = resnet(width=4, blocks="1,1", image=8)
    >>> (x,), y = spec.batch(2)
    >>> spec.module(x).shape
    torch.Size([2, 10])
    """
    positive(width=width, image=image, classes=classes)
    sizes = _parse_blocks(blocks)
    module = build_seeded(seed, lambda: ResNet(width, sizes, classes))

    def make_batch(batch_size: int) -> tuple[Tensor, Tensor]:
        g = generator(seed, batch_size)
        x = torch.randn(batch_size, 3, image, image, generator=g)
        return x, torch.randint(classes, (batch_size,), generator=g)

    return ModelSpec(module, make_batch, F.cross_entropy)
