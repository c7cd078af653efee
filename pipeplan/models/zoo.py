"""A zoo of real architectures this project did not write, as their users would bring them.

Each callable builds a tiny ``transformers`` model from a config (random weights, seeded, no
download) and returns it **unwrapped**: the ``PreTrainedModel`` itself, a ``make_batch`` whose
inputs are a dict of named tensors (``input_ids``, ``decoder_input_ids``, ``pixel_values``) and
a loss written against the model's ``ModelOutput`` (``output.logits``).  Nothing here adapts the
model to pipeplan: that is pipeplan's job.  Dropout is off so two runs of a step agree.

=============  ===========================  =======================  ==================
name           class                        family                   task
=============  ===========================  =======================  ==================
``gpt2``       GPT2LMHeadModel              decoder, tied head       next token
``llama``      LlamaForCausalLM             decoder, RoPE, GQA       next token
``mistral``    MistralForCausalLM           decoder, sliding window  next token
``qwen2``      Qwen2ForCausalLM             decoder, qkv bias        next token
``gpt_neox``   GPTNeoXForCausalLM           decoder, parallel res.   next token
``phi``        PhiForCausalLM               decoder, partial RoPE    next token
``gemma``      GemmaForCausalLM             decoder, tied, scaled    next token
``mixtral``    MixtralForCausalLM           mixture of experts       next token
``bert``       BertForMaskedLM              encoder                  masked tokens
``roberta``    RobertaForMaskedLM           encoder                  masked tokens
``electra``    ElectraForMaskedLM           encoder, small embed     masked tokens
``deberta``    DebertaV2ForMaskedLM         encoder, rel. position   masked tokens
``t5``         T5ForConditionalGeneration   encoder-decoder          sequence to seq.
``bart``       BartForConditionalGeneration encoder-decoder          sequence to seq.
``vit``        ViTForImageClassification    vision transformer       image class
=============  ===========================  =======================  ==================

``pipeplan.models.zoo:NAME`` takes ``n_layers`` (per stack), ``d_model``, ``vocab``, ``seq_len`` and ``seed``
as ``--model-arg``s.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeplan.intake.hf_source import no_dropout
from pipeplan.intake.model import ModelSpec
from pipeplan.models._common import build_seeded, generator, positive
from pipeplan.models.hf import _transformers

__all__ = ["ZOO", "build"]


def _decoder(d: int, n: int, t: int) -> dict[str, Any]:
    return {
        "hidden_size": d,
        "intermediate_size": 2 * d,
        "num_hidden_layers": n,
        "num_attention_heads": 2,
        "max_position_embeddings": max(t, 8),
        "use_cache": False,
    }


def _encoder(d: int, n: int, t: int) -> dict[str, Any]:
    return {**_decoder(d, n, t), "use_cache": None}


def _seq2seq(d: int, n: int, t: int) -> dict[str, Any]:
    return {
        "d_model": d,
        "encoder_layers": n,
        "decoder_layers": n,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 2 * d,
        "decoder_ffn_dim": 2 * d,
        "max_position_embeddings": max(t, 8),
        "use_cache": False,
    }


#: name -> (config class, model class, task, config from (d_model, n_layers, seq_len), extras)
_TABLE: dict[str, tuple[str, str, str, Callable[[int, int, int], dict[str, Any]], dict[str, Any]]]
_TABLE = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "causal", lambda d, n, t: {
        "n_embd": d, "n_layer": n, "n_head": 2, "n_positions": max(t, 8), "use_cache": False,
        "bos_token_id": None, "eos_token_id": None}, {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "causal", _decoder, {"num_key_value_heads": 1}),
    "mistral": ("MistralConfig", "MistralForCausalLM", "causal", _decoder,
                {"num_key_value_heads": 1, "sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "causal", _decoder, {"num_key_value_heads": 1}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", "causal", _decoder, {}),
    "phi": ("PhiConfig", "PhiForCausalLM", "causal", _decoder, {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "causal", _decoder, {"num_key_value_heads": 1}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "causal", _decoder,
                {"num_key_value_heads": 1, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "bert": ("BertConfig", "BertForMaskedLM", "masked", _encoder, {}),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", "masked", lambda d, n, t: {
        **_encoder(d, n, t), "max_position_embeddings": max(t, 8) + 2}, {"pad_token_id": 1}),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", "masked", lambda d, n, t: {
        **_encoder(d, n, t), "embedding_size": d // 2}, {}),
    "deberta": ("DebertaV2Config", "DebertaV2ForMaskedLM", "masked", _encoder, {}),
    "t5": ("T5Config", "T5ForConditionalGeneration", "seq2seq", lambda d, n, t: {
        "d_model": d, "d_kv": d // 2, "d_ff": 2 * d, "num_layers": n, "num_heads": 2,
        "use_cache": False}, {"decoder_start_token_id": 0}),
    "bart": ("BartConfig", "BartForConditionalGeneration", "seq2seq", _seq2seq, {}),
    "vit": ("ViTConfig", "ViTForImageClassification", "image", lambda d, n, t: {
        **_encoder(d, n, t), "image_size": t, "patch_size": 4, "max_position_embeddings": None},
        {"num_labels": 5}),
}  # fmt: skip


#: Config keys that count attention heads, and those that count key-value heads.
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads",
              "decoder_attention_heads")  # fmt: skip
_KV_KEYS = ("num_key_value_heads",)


def _config(
    name: str, d_model: int, n_layers: int, seq_len: int, vocab: int, heads: int = 2,
    kv_heads: int | None = None,
) -> Any:  # fmt: skip
    config_cls, _, task, sizes, extra = _TABLE[name]
    kwargs = {k: v for k, v in {**sizes(d_model, n_layers, seq_len), **extra}.items()
              if v is not None or k.endswith("token_id")}  # fmt: skip
    if heads != 2 or kv_heads is not None:
        for key in _HEAD_KEYS:
            if key in kwargs:
                kwargs[key] = heads
        for key in _KV_KEYS:
            if key in kwargs:
                kwargs[key] = kv_heads or kwargs[key]
        if "d_kv" in kwargs:  # T5: the head size is its own key
            kwargs["d_kv"] = d_model // heads
    if task != "image":
        kwargs["vocab_size"] = vocab
    return no_dropout(getattr(_transformers(), config_cls)(**kwargs))


def _batches(task: str, vocab: int, seq_len: int, classes: int, seed: int) -> Callable[[int], Any]:
    """Seeded batches: named inputs and the target, by task (see the module docstring)."""

    def make_batch(b: int) -> tuple[dict[str, Tensor], Tensor]:
        g = generator(seed, b)
        if task == "image":
            pixels = torch.randn(b, 3, seq_len, seq_len, generator=g)
            return {"pixel_values": pixels}, torch.randint(classes, (b,), generator=g)
        tokens = torch.randint(1, vocab, (b, seq_len + 1), generator=g)
        source, shifted = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if task == "causal":
            return {"input_ids": source}, shifted
        if task == "masked":  # recover each token from its context: the target is the input
            return {"input_ids": source}, source.clone()
        start = torch.zeros(b, 1, dtype=tokens.dtype)  # seq2seq: decoder reads target right-shifted
        return {
            "input_ids": source,
            "decoder_input_ids": torch.cat([start, shifted[:, :-1]], 1),
        }, shifted

    return make_batch


def _loss(output: Any, target: Tensor) -> Tensor:
    """Mean cross entropy of ``output.logits``, (B, T, V) or (B, C), against ``target``."""
    logits = output.logits
    return F.cross_entropy(logits.flatten(0, logits.dim() - 2), target.flatten())


def build(
    name: str,
    n_layers: int = 2,
    d_model: int = 32,
    vocab: int = 128,
    seq_len: int = 16,
    seed: int = 0,
    heads: int = 2,
    kv_heads: int | None = None,
) -> ModelSpec:
    """Zoo model ``name``: the unwrapped model, named-input batches, a loss on its output.

    ``seq_len`` is the image side for ``vit`` (patches of 4 x 4, 5 classes).  ``heads``
    attention heads (2 by default), and ``kv_heads`` key-value heads for the models with
    grouped-query attention (Llama, Mistral, Qwen2, Gemma, Mixtral: 1 by default): a model
    tensor parallelism splits t ways needs t to divide both.
    """
    if name not in _TABLE:
        raise ValueError(f"zoo model {name!r} is not one of {', '.join(_TABLE)}")
    positive(n_layers=n_layers, d_model=d_model, vocab=vocab, seq_len=seq_len, seed=seed + 1)
    positive(heads=heads, kv_heads=kv_heads or 1)
    if d_model % (2 * heads):
        raise ValueError(
            f"d_model must be a multiple of 2 x heads ({heads} heads, even head size), got "
            f"{d_model}"
        )
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"kv_heads {kv_heads} must divide heads {heads}")
    config = _config(name, d_model, n_layers, seq_len, vocab, heads, kv_heads)
    model = build_seeded(seed, lambda: getattr(_transformers(), _TABLE[name][1])(config))
    return ModelSpec(model, _batches(_TABLE[name][2], vocab, seq_len, 5, seed), _loss)


#: Every zoo model: ``pipeplan.models.zoo:NAME`` is ``build(NAME, ...)``.
ZOO: dict[str, Callable[..., ModelSpec]] = {name: partial(build, name) for name in _TABLE}

for _name, _build in ZOO.items():
    globals()[_name] = _build
__all__ += list(ZOO)
