"""``hf:PATH/config.json``: the class a config names (or its model type's usual head), seeded
weights with dropout off, batches for every head, each head's own loss, and the config's hash.
(The command-line round trip, profile -> plan -> a changed config refused by run, is in
test_model_intake.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

tf = pytest.importorskip("transformers")

from pipeplan.intake.hf_source import DROPOUT_KEYS, default_head, file_sha256
from pipeplan.intake.model import ModelSpec, NamedInputs, load_model
from pipeplan.planner.errors import ModelLoadError
from pipeplan.profiler import profile_model


def _save(tmp_path: Path, config: Any, drop_architectures: bool = False) -> Path:
    folder = tmp_path / type(config).__name__
    config.save_pretrained(folder)
    path = folder / "config.json"
    if drop_architectures:
        data = json.loads(path.read_text())
        data.pop("architectures", None)
        path.write_text(json.dumps(data))
    return path


def _own_loss(spec: ModelSpec, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(pipeplan's standard loss, the model's own ``labels=`` loss) on one batch."""
    assert isinstance(spec.module, NamedInputs)
    inputs, target = spec.batch(batch)
    named = dict(zip(spec.module.names or (), inputs))
    return spec.loss(spec.module(*inputs), target), spec.module.model(**named, labels=target).loss


def _gpt2(**extra: Any) -> Any:
    return tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                         bos_token_id=1, eos_token_id=1, **extra)  # fmt: skip


def _t5(**extra: Any) -> Any:
    return tf.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                       num_decoder_layers=1, num_heads=2, **extra)  # fmt: skip


def test_without_architectures_the_model_types_usual_head(tmp_path: Path) -> None:
    assert default_head("bert") == "BertForMaskedLM"
    assert default_head("gpt2") == "GPT2LMHeadModel"
    assert default_head("t5") == "T5ForConditionalGeneration"
    assert default_head("vit") == "ViTForImageClassification"
    assert default_head("no-such-type") is None
    spec = load_model(f"hf:{_save(tmp_path, _t5(), drop_architectures=True)}", {"seq_len": 8})
    assert type(spec.module.model).__name__ == "T5ForConditionalGeneration"  # type: ignore[union-attr]
    (ids, decoder_ids), labels = spec.batch(2)
    assert ids.shape == decoder_ids.shape == labels.shape == (2, 8)
    assert torch.equal(decoder_ids[:, 1:], labels[:, :-1]) and (decoder_ids[:, 0] == 0).all()
    ours, theirs = _own_loss(spec)
    torch.testing.assert_close(ours, theirs)


def test_a_headless_architecture_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = _save(tmp_path, _gpt2(architectures=["GPT2Model"]))
    with pytest.raises(ModelLoadError) as info:
        load_model(f"hf:{path}")
    message = str(info.value)
    assert "names no class with a head pipeplan can feed (ForCausalLM" in message
    assert "set architectures to e.g. ['GPT2LMHeadModel']" in message and "\n" not in message


def test_seeded_weights_with_dropout_off(tmp_path: Path) -> None:
    path = _save(tmp_path, _gpt2(architectures=["GPT2LMHeadModel"]))
    first, again = load_model(f"hf:{path}"), load_model(f"hf:{path}")
    other = load_model(f"hf:{path}", {"seed": 1})
    model: Any = first.module.model
    config = model.config
    assert all(not getattr(config, k, 0) for k in DROPOUT_KEYS) and config.use_cache is False
    a, b, c = (dict(s.module.state_dict()) for s in (first, again, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    first.module.train()
    inputs, target = first.batch(2)
    loss_1 = first.loss(first.module(*inputs), target)
    loss_2 = first.loss(first.module(*inputs), target)  # training mode, yet equal: no dropout
    assert torch.equal(loss_1, loss_2)
    assert torch.equal(first.batch(2)[0][0], inputs[0])  # batches are seeded too


def test_a_sequence_classifier_without_a_pad_token_takes_batches(tmp_path: Path) -> None:
    config = _gpt2(architectures=["GPT2ForSequenceClassification"], num_labels=3)
    assert config.pad_token_id is None  # the head refuses batches > 1 as it is
    spec = load_model(f"hf:{_save(tmp_path, config)}", {"seq_len": 8})
    ours, theirs = _own_loss(spec, 4)
    torch.testing.assert_close(ours, theirs)
    _, target = spec.batch(4)
    assert target.shape == (4,) and int(target.max()) < 3


def test_an_image_classifier_without_image_size(tmp_path: Path) -> None:
    config = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
                             architectures=["ResNetForImageClassification"])  # fmt: skip
    spec = load_model(f"hf:{_save(tmp_path, config)}")
    (pixels,), target = spec.batch(2)
    assert pixels.shape == (2, 3, 224, 224) and target.shape == (2,)
    ours, theirs = _own_loss(spec)
    torch.testing.assert_close(ours, theirs)


def test_the_profile_records_the_configs_hash(tmp_path: Path) -> None:
    path = _save(tmp_path, _gpt2(architectures=["GPT2LMHeadModel"]))
    profile = profile_model(f"hf:{path.parent}", batch_size=2, model_kwargs={"seq_len": 8},
                            microbatch_sizes=[2], warmup=0, repeats=1, progress=False)  # fmt: skip
    assert profile.model_sha256 == file_sha256(path) and profile.model_kwargs == {"seq_len": 8}
