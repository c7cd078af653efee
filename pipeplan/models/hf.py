"""Tiny Hugging Face causal language models built from a config: random weights, no download.

``transformers`` models cannot be traced by ``torch.fx`` (they branch on Python state), so these
exercise the ``torch.export`` path.  Each is wrapped so ``forward(input_ids)`` returns the logits,
with ``use_cache=False`` and dropout off (dropout would make two runs differ).
``transformers`` is imported lazily; without it the models raise ``ModelLoadError``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from pipeplan.intake.model import ModelSpec
from pipeplan.models._common import build_seeded, next_token_task, positive
from pipeplan.planner.errors import ModelLoadError

__all__ = ["CausalLM", "gpt2", "llama"]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelLoadError(
            f"the Hugging Face models need the transformers package ({exc}); "
            f"pip install 'pipeplan[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()
    return transformers


class CausalLM(nn.Module):
    """``forward(input_ids) -> logits`` around a Hugging Face ``*ForCausalLM``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:  # (B, T) -> (B, T, V)
        return self.model(input_ids=input_ids, use_cache=False).logits


def _spec(build: Any, vocab: int, seq_len: int, seed: int) -> ModelSpec:
    module = build_seeded(seed, lambda: CausalLM(build()))
    return ModelSpec(module, *next_token_task(vocab, seq_len, seed))


def llama(
    vocab: int = 1024,
    d_model: int = 64,
    n_layers: int = 4,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    seq_len: int = 32,
    tie_weights: bool = False,
    seed: int = 0,
) -> ModelSpec:
    """``pipeplan.models.hf:llama``: a tiny Llama (RMSNorm, rotary, grouped-query attention, SwiGLU)."""
    positive(
        vocab=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        seq_len=seq_len,
    )
    tf = _transformers()
    config = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=d_model,
        intermediate_size=4 * d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=bool(tie_weights),
        attention_dropout=0.0,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return _spec(lambda: tf.LlamaForCausalLM(config), vocab, seq_len, seed)


def gpt2(
    vocab: int = 1024,
    d_model: int = 64,
    n_layers: int = 4,
    n_heads: int = 4,
    seq_len: int = 32,
    seed: int = 0,
) -> ModelSpec:
    """``pipeplan.models.hf:gpt2``: a tiny GPT-2 (its LM head is tied to the token embedding)."""
    positive(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len)
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=vocab,
        n_embd=d_model,
        n_layer=n_layers,
        n_head=n_heads,
        n_positions=seq_len,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    return _spec(lambda: tf.GPT2LMHeadModel(config), vocab, seq_len, seed)
