"""``transformers`` models with no Python of the user's: ``hf:PATH/config.json`` and bare models.

:func:`load_config` builds the model a local ``config.json`` describes, with random weights
(seeded, no download: the file is read, nothing is fetched) and dropout off, so two runs of a
step agree.  The class is the config's ``architectures[0]`` (without one, the model type's
usual head: :func:`default_head`).  :func:`default_spec` gives such a
model, or a bare ``PreTrainedModel`` a model callable returned, its batches and its standard
loss, chosen by the class's head:

==========================================  ===============================  =================
head (class name ends with)                 inputs (B = batch, T = seq_len)  target, loss
==========================================  ===============================  =================
``ForCausalLM``, ``LMHeadModel``            ``input_ids`` (B, T)             the same ids;
                                                                             next-token CE
``ForMaskedLM``                             ``input_ids`` (B, T)             the same ids; CE
``ForConditionalGeneration``, ``Seq2SeqLM``  ``input_ids``,                   labels (B, T); CE
                                            ``decoder_input_ids`` (labels
                                            shifted right)
``ForSequenceClassification``               ``input_ids`` (B, T)             class ids (B,); CE
``ForImageClassification``                  ``pixel_values`` (B, C, H, W)    class ids (B,); CE
==========================================  ===============================  =================

Token ids are uniform in ``[1, vocab_size)``; every loss is the mean cross entropy, the
number ``model(**inputs, labels=target).loss`` gives (tested).  A loss receives the model's
``ModelOutput`` and reads its ``logits``; it also takes the logits tensor itself.  A sequence
classifier whose config has no ``pad_token_id`` (GPT-2, Llama) would refuse batches of more
than one sample; it gets ``pad_token_id = 0``, which no generated id equals, so it pools the
last token as it would anyway.  ``seq_len`` (default: 128, at
most the model's ``max_position_embeddings``) and ``seed`` (default 0) come from the model
arguments (``pipeplan profile hf:config.json --seq-len 512`` or ``--model-arg seq_len=512``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeplan.planner.errors import ModelLoadError

__all__ = [
    "DROPOUT_KEYS",
    "TASKS",
    "default_head",
    "default_spec",
    "file_sha256",
    "load_config",
    "no_dropout",
    "task_of",
]

#: Class-name suffix -> task, first match wins.
TASKS: tuple[tuple[str, str], ...] = (
    ("ForCausalLM", "causal"),
    ("LMHeadModel", "causal"),
    ("ForMaskedLM", "masked"),
    ("ForConditionalGeneration", "seq2seq"),
    ("ForSeq2SeqLM", "seq2seq"),
    ("ForSequenceClassification", "sequence"),
    ("ForImageClassification", "image"),
)

#: Config fields holding a dropout probability.
DROPOUT_KEYS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "attention_dropout",
    "hidden_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "dropout",
    "dropout_rate",
    "activation_dropout",
    "classifier_dropout",
)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelLoadError(
            f"hf: models need the transformers package ({exc}); pip install 'pipeplan[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()
    return transformers


def no_dropout(config: Any) -> Any:
    """Set every dropout probability of a ``transformers`` config to 0 (so runs agree)."""
    for key in DROPOUT_KEYS:
        if getattr(config, key, None):
            setattr(config, key, 0.0)
    return config


def file_sha256(path: str | Path) -> str:
    """The hex SHA-256 of a file's bytes (a plan records its model config's)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def task_of(class_name: str) -> str | None:
    """The task a head implies (:data:`TASKS`), ``None`` for a head pipeplan cannot feed."""
    return next((task for suffix, task in TASKS if class_name.endswith(suffix)), None)


def load_config(path: str, kwargs: dict[str, Any]) -> Any:
    """The :class:`~pipeplan.intake.model.ModelSpec` of the model ``path`` (a ``config.json``) describes.

    ``kwargs`` may hold ``seq_len`` and ``seed``; anything else is refused by name.
    """
    unknown = sorted(set(kwargs) - {"seq_len", "seed"})
    if unknown:
        raise ModelLoadError(
            f"hf:{path} takes the model arguments seq_len and seed, not {', '.join(unknown)}"
        )
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        data = json.loads(file.read_text())
    except OSError as exc:
        raise ModelLoadError(f"hf:{path}: cannot read {file} ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"hf:{path}: {file} is not JSON ({exc.msg}, line {exc.lineno})")
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelLoadError(f"hf:{path}: {file} has no model_type; is it a transformers config?")
    tf = _transformers()
    mapping = tf.CONFIG_MAPPING
    if data["model_type"] not in mapping:
        raise ModelLoadError(
            f"hf:{path}: model_type {data['model_type']!r} is unknown to transformers "
            f"{tf.__version__}"
        )
    config = mapping[data["model_type"]].from_dict(data)
    named = data.get("architectures")
    default = default_head(data["model_type"])
    arch = named[0] if isinstance(named, list) and named else default
    if arch is None or task_of(arch) is None or not hasattr(tf, arch):
        heads = ", ".join(suffix for suffix, _ in TASKS)
        fix = f"set architectures to e.g. ['{default}']" if default else "use a model callable"
        raise ModelLoadError(
            f"hf:{path}: architectures {named!r} names no class with a head pipeplan can feed "
            f"({heads}); {fix}"
        )
    no_dropout(config)
    if getattr(config, "use_cache", None):
        config.use_cache = False
    seed = int(kwargs.get("seed", 0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(tf, arch)(config)
    return default_spec(model, seq_len=kwargs.get("seq_len"), seed=seed)


#: Auto-class mappings tried, in order, for a config without ``architectures``.
_DEFAULT_HEADS = (
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
)


def default_head(model_type: str) -> str | None:
    """The class ``hf:`` builds for a config without ``architectures``: the first head
    ``transformers`` has for ``model_type`` among seq2seq LM, masked LM, causal LM, image
    classification and sequence classification (so BERT gets its masked LM, GPT-2 and Llama
    their causal LM, T5 and BART their seq2seq LM, ViT its classifier); ``None`` if none."""
    from transformers.models.auto import modeling_auto

    tf = _transformers()
    for mapping in _DEFAULT_HEADS:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        name = name[0] if isinstance(name, (tuple, list)) else name
        if isinstance(name, str) and task_of(name) is not None and hasattr(tf, name):
            return name
    return None


def _seq_len(config: Any, seq_len: int | None) -> int:
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if seq_len is None:
        return min(128, limit) if isinstance(limit, int) and limit > 0 else 128
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ModelLoadError(f"seq_len must be a positive integer, got {seq_len!r}")
    if isinstance(limit, int) and 0 < limit < seq_len:
        raise ModelLoadError(
            f"seq_len {seq_len} exceeds the model's {limit} positions; use --seq-len {limit}"
        )
    return seq_len


def _image_shape(config: Any) -> tuple[int, int, int]:
    """(C, H, W) of an image classifier's input: ``num_channels`` (3) and ``image_size`` (an
    int or a pair; 224 when the config has none, as for ResNet's), looked up in the config or
    its ``vision_config``."""
    configs = [config, getattr(config, "vision_config", None)]
    size: Any = next((c.image_size for c in configs if getattr(c, "image_size", None)), 224)
    channels = next((c.num_channels for c in configs if getattr(c, "num_channels", None)), 3)
    h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return int(channels), int(h), int(w)


def _generator(seed: int, batch_size: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + batch_size)


def default_spec(model: nn.Module, *, seq_len: int | None = None, seed: int = 0) -> Any:
    """A :class:`~pipeplan.intake.model.ModelSpec` for a ``transformers`` model: batches and the
    standard loss of its head (see the module docstring)."""
    from pipeplan.intake.spec import ModelSpec

    name = type(model).__name__
    task = task_of(name)
    if task is None:
        heads = ", ".join(suffix for suffix, _ in TASKS)
        raise ModelLoadError(
            f"{name} has no head pipeplan can feed by itself ({heads}); return "
            f"(model, make_batch, loss) from the model callable instead"
        )
    config: Any = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    length = _seq_len(config, seq_len) if task != "image" else 0
    classes = int(getattr(config, "num_labels", 2) or 2)
    start = getattr(config, "decoder_start_token_id", None)
    start = int(start) if start is not None else 0
    if task == "sequence" and config is not None and getattr(config, "pad_token_id", 0) is None:
        # Without a pad token the head refuses batches > 1; ids are >= 1, so 0 pads nothing
        # and it pools the last token, as it would.
        config.pad_token_id = 0

    def make_batch(b: int) -> tuple[dict[str, Tensor], Tensor]:
        g = _generator(seed, b)
        if task == "image":
            pixels = torch.randn(b, *_image_shape(config), generator=g)
            return {"pixel_values": pixels}, torch.randint(classes, (b,), generator=g)
        ids = torch.randint(1, max(vocab, 2), (b, length), generator=g)
        if task == "sequence":
            return {"input_ids": ids}, torch.randint(classes, (b,), generator=g)
        if task == "seq2seq":
            labels = torch.randint(1, max(vocab, 2), (b, length), generator=g)
            decoder = torch.cat([torch.full((b, 1), start, dtype=labels.dtype), labels[:, :-1]], 1)
            return {"input_ids": ids, "decoder_input_ids": decoder}, labels
        return {"input_ids": ids}, ids.clone()

    return ModelSpec(model, make_batch, _LOSSES[task])


def _logits(output: Any) -> Tensor:
    """The logits, at least float32 (as ``transformers`` computes its losses)."""
    logits = output if isinstance(output, Tensor) else output.logits
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _causal_loss(output: Any, target: Tensor) -> Tensor:
    """Next-token cross entropy: position t predicts token t + 1."""
    logits = _logits(output)[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), target[:, 1:].flatten())


def _token_loss(output: Any, target: Tensor) -> Tensor:
    logits = _logits(output)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _class_loss(output: Any, target: Tensor) -> Tensor:
    return F.cross_entropy(_logits(output), target)


_LOSSES: dict[str, Callable[[Any, Tensor], Tensor]] = {
    "causal": _causal_loss,
    "masked": _token_loss,
    "seq2seq": _token_loss,
    "sequence": _class_loss,
    "image": _class_loss,
}
