"""Model callables that return ``transformers`` models as they are, for ``test_model``.

Tiny (hidden 16, one or two layers), seeded, dropout off (so a pass equals the model's own).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipeplan.intake.hf_source import no_dropout


def _build(arch: str, config_class: str, **sizes: Any) -> Any:
    import transformers as tf

    config = no_dropout(getattr(tf, config_class)(**sizes))
    torch.manual_seed(0)
    return getattr(tf, arch)(config)


_TEXT = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "max_position_embeddings": 16}  # fmt: skip

#: name -> (class, config class, sizes): what ``bare`` builds.
BARE: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {**_TEXT, "num_key_value_heads": 1}),
    "bert_mlm": ("BertForMaskedLM", "BertConfig", _TEXT),
    "bert_cls": ("BertForSequenceClassification", "BertConfig", {**_TEXT, "num_labels": 3}),
    "gpt2_cls": ("GPT2ForSequenceClassification", "GPT2Config",
                 {"vocab_size": 64, "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 16,
                  "bos_token_id": 1, "eos_token_id": 1}),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           {"vocab_size": 64, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1,
            "num_decoder_layers": 1, "num_heads": 2, "decoder_start_token_id": 0}),
    "vit": ("ViTForImageClassification", "ViTConfig",
            {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "image_size": 8, "patch_size": 4, "num_labels": 3}),
}  # fmt: skip


def bare(name: str) -> Any:
    """The bare ``PreTrainedModel`` ``BARE[name]`` describes: no batches, no loss, no wrapper."""
    arch, config_class, sizes = BARE[name]
    return _build(arch, config_class, **sizes)


def bare_with_seq_len(seq_len: int = 4) -> Any:
    """A callable that takes ``seq_len`` itself (here: the model's positions)."""
    arch, config_class, sizes = BARE["llama"]
    return _build(arch, config_class, **{**sizes, "max_position_embeddings": seq_len})


def llama_spec() -> Any:
    """A ``LlamaForCausalLM`` with the user's named batch (and a mask) and a loss that reads the
    ``ModelOutput``: the loss checks that it gets one."""
    from transformers.utils import ModelOutput

    model = bare("llama")

    def make_batch(b: int) -> tuple[dict[str, Tensor], Tensor]:
        ids = torch.randint(1, 64, (b, 8), generator=torch.Generator().manual_seed(b))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids

    def loss(out: Any, ids: Tensor) -> Tensor:
        assert isinstance(out, ModelOutput), type(out)
        logits = out["logits"][:, :-1].flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, ids[:, 1:].flatten())

    return model, make_batch, loss


def positional_spec() -> Any:
    """A plain module taking two tensors positionally: no wrapper is needed or made."""

    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 2)

        def forward(self, x: Tensor, mask: Tensor) -> Tensor:
            return self.a(x * mask)

    def make_batch(b: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        return (torch.randn(b, 4), torch.ones(b, 4)), torch.randint(2, (b,))

    return Gate(), make_batch, torch.nn.functional.cross_entropy


def named_forward_raises() -> Any:
    """A model with named inputs whose forward has a bug."""

    class Tagger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 2)

        def forward(self, *, features: Tensor) -> Tensor:
            return self.a(features.view(-1, 3))  # BUG-NAMED-FORWARD

    def make_batch(b: int) -> tuple[dict[str, Tensor], Tensor]:
        return {"features": torch.randn(b, 4)}, torch.randint(2, (b,))

    return Tagger(), make_batch, torch.nn.functional.cross_entropy


def spec_without_seq_len() -> Any:
    """A ``(module, make_batch, loss)`` callable with no ``seq_len`` parameter."""
    return positional_spec()
