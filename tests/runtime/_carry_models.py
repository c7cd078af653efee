"""Models whose cuts carry every kind of value, for ``test_stages`` (run by torchrun jobs).

``carry``: three blocks; across the cuts travel a non-contiguous view (a transpose), an integer
tensor (positions), a bool mask, a float tensor that needs no gradient, and several tensors at
once; the output is a dict holding a tensor, a tuple and a list.  ``batchnorm``: a small
convolutional net with BatchNorm (traced by torch.fx); ``batchnorm_export`` the same traced by
torch.export (``aten.batch_norm`` on its buffers).  ``skip`` (for ``test_chunked_zoo``): eight
blocks, eight units; block 0's output and its transposed view are used again by blocks 3, 5 and
7, and an integer tensor, a bool mask and a float tensor that needs no gradient, made from the
inputs before block 0, by blocks 3, 5 and 7.  Cut into one chunk per block, each crosses chunks
that sit on other ranks (chunk 3 is on rank 1 of 2, on rank 3 of 4) and passes through the
chunks between.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

D, T, VOCAB = 8, 6, 5


class Carry(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    def forward(self, x: Tensor, ids: Tensor) -> dict[str, Any]:
        mask = ids > 2  # bool, crosses every cut
        pos = ids.cumsum(-1)  # int64
        scale = (x.detach() ** 2).mean(-1, keepdim=True) + 1  # float, no gradient
        h = self.blocks[0](x + self.embed(ids))
        v = h.transpose(1, 2)  # (B, D, T) view: non-contiguous across the cut
        h = self.blocks[1](v.transpose(1, 2) * scale + pos.unsqueeze(-1).to(h.dtype) / 10)
        h = h.masked_fill(mask.unsqueeze(-1), 0.0)
        out = self.blocks[2](torch.tanh(h))
        return {"out": out, "aux": (h.sum(-1), [v.mean(), mask])}


def _carry_loss(output: dict[str, Any], target: Tensor) -> Tensor:
    assert type(output) is dict and type(output["aux"][1]) is list  # as the model returns
    aux_sum, (aux_mean, mask) = output["aux"]
    assert mask.dtype == torch.bool
    return F.mse_loss(output["out"], target) + 0.1 * aux_sum.mean() + 0.01 * aux_mean


def carry(seed: int = 0) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)

    def make_batch(b: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        g = torch.Generator().manual_seed(b)
        x = torch.randn(b, T, D, generator=g)
        return (x, torch.randint(VOCAB, (b, T), generator=g)), torch.randn(b, T, D, generator=g)

    return Carry(), make_batch, _carry_loss


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Conv2d(3 if i == 0 else 4, 4, 3, padding=1), nn.BatchNorm2d(4),
                            nn.ReLU()) for i in range(3))
        )  # fmt: skip
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x).mean((2, 3)))


class _Export(BNNet):
    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] > 0:  # data-dependent Python: torch.fx cannot trace it, export can
            x = x + 0
        return super().forward(x)


def _bn_spec(net: nn.Module) -> tuple[nn.Module, Any, Any]:
    def make_batch(b: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(b, 3, 6, 6, generator=g) * 2 + 1, torch.randint(2, (b,), generator=g)

    return net, make_batch, F.cross_entropy


def batchnorm(seed: int = 0) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    return _bn_spec(BNNet())


def batchnorm_export(seed: int = 0) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    return _bn_spec(_Export())


Out = namedtuple("Out", "logits batch")


class Reuse(nn.Module):
    """An optional argument left at its default, one module applied on two stages, and a
    namedtuple output holding a tensor and an int."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.shared = nn.Linear(D, D)

    def forward(self, x: Tensor, scale: Tensor | None = None) -> Out:
        if scale is not None:
            x = x * scale
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i % 2:
                x = self.shared(x)
        return Out(x, x.shape[0])


def reuse(seed: int = 0) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)

    def make_batch(b: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(b, D, generator=g), torch.randn(b, D, generator=g)

    def loss(out: Out, y: Tensor) -> Tensor:
        assert isinstance(out, Out) and isinstance(out.batch, int)
        return F.mse_loss(out.logits, y)

    return Reuse(), make_batch, loss


class HFOut(Carry):
    """``Carry`` returning a ``transformers`` ``ModelOutput`` (a pytree node that
    ``transformers`` registers) with a nested tuple and a bool mask among its fields."""

    def forward(self, x: Tensor, ids: Tensor) -> Any:  # type: ignore[override]
        out = super().forward(x, ids)
        aux_sum, (aux_mean, mask) = out["aux"]
        return _carry_output()(logits=out["out"], hidden=(aux_sum, (aux_mean,)), mask=mask)


def _carry_output() -> type:
    """A ``ModelOutput`` subclass, made once (``transformers`` is imported only when used)."""
    global _CARRY_OUTPUT
    if _CARRY_OUTPUT is None:
        from dataclasses import dataclass

        from transformers.utils import ModelOutput

        @dataclass
        class CarryOutput(ModelOutput):
            logits: Tensor | None = None
            hidden: tuple[Any, ...] | None = None
            mask: Tensor | None = None

        _CARRY_OUTPUT = CarryOutput
    return _CARRY_OUTPUT


_CARRY_OUTPUT: type | None = None


def hfout(seed: int = 0) -> tuple[nn.Module, Any, Any]:
    _, make_batch, _ = carry(seed)
    torch.manual_seed(seed)

    def loss(output: Any, target: Tensor) -> Tensor:
        cls: Any = _carry_output()
        assert type(output) is cls, type(output)
        aux_sum, (aux_mean,) = output.hidden
        assert output.mask.dtype == torch.bool
        return F.mse_loss(output.logits, target) + 0.1 * aux_sum.mean() + 0.01 * aux_mean

    return HFOut(), make_batch, loss


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(8))

    def forward(self, x: Tensor, ids: Tensor) -> dict[str, Any]:
        mask = ids > 2  # bool
        pos = ids.cumsum(-1)  # int64
        scale = (x.detach() ** 2).mean(-1, keepdim=True) + 1  # float, no gradient
        s = self.blocks[0](x)  # made in chunk 0, used in chunks 3, 5 and 7
        v = s.transpose(1, 2)  # a view of it
        h = s
        for i in range(1, 8):
            h = self.blocks[i](torch.tanh(h))
            if i == 3:
                h = h + s * scale
            elif i == 5:
                h = h + v.transpose(1, 2) * pos.unsqueeze(-1).to(h.dtype) / 10
            elif i == 7:
                h = h.masked_fill(mask.unsqueeze(-1), 0.0)
        return {"out": h, "aux": (s.sum(-1), v.mean())}


def skip(seed: int = 0) -> tuple[nn.Module, Any, Any]:
    _, make_batch, _ = carry(seed)
    torch.manual_seed(seed)

    def loss(output: dict[str, Any], target: Tensor) -> Tensor:
        aux_sum, aux_mean = output["aux"]
        return F.mse_loss(output["out"], target) + 0.1 * aux_sum.mean() + 0.01 * aux_mean

    return Skip(), make_batch, loss
