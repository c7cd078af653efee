"""Model callables with bugs of the kinds users write, for ``test_usercode`` and ``test_model``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class Net(nn.Module):
    def __init__(self, broken_forward: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.broken_forward = broken_forward

    def forward(self, x: Tensor) -> Tensor:
        if self.broken_forward:
            return self.b(self.a(x).reshape(-1, 3))  # BUG-FORWARD
        return self.b(torch.relu(self.a(x)))


def _batch(b: int) -> tuple[Tensor, Tensor]:
    return torch.randn(b, 4), torch.randint(2, (b,))


def _loss(out: Any, y: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(out, y)


def callable_raises() -> Any:
    raise KeyError("vocab_size")  # BUG-CALLABLE


def make_batch_raises() -> Any:
    def make_batch(b: int) -> Any:
        return torch.randn(b, 4) @ torch.randn(5, 2), None  # BUG-BATCH

    return Net(), make_batch, _loss


def loss_raises() -> Any:
    return Net(), _batch, lambda out, y: out.logits.mean()  # BUG-LOSS


def forward_raises() -> Any:
    return Net(broken_forward=True), _batch, _loss


def named_inputs() -> Any:
    """A model that takes keyword inputs and returns a dict: no wrapper written."""

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, *, features: Tensor, offset: Tensor) -> dict[str, Tensor]:
            return {"logits": self.b(torch.relu(self.a(features) + offset))}

    def make_batch(b: int) -> tuple[dict[str, Tensor], Tensor]:
        g = torch.Generator().manual_seed(b)
        x = {"offset": torch.randn(b, 4, generator=g), "features": torch.randn(b, 4, generator=g)}
        return x, torch.randint(2, (b,), generator=g)

    torch.manual_seed(0)
    return Named(), make_batch, lambda out, y: torch.nn.functional.cross_entropy(out["logits"], y)


def bare_llama() -> Any:
    """A bare ``LlamaForCausalLM``: pipeplan supplies batches and the loss."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            max_position_embeddings=16)  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config)
