"""``hf:PATH/config.json``: the class a config names (or its model type's usual head), seeded
weights with dropout off, batches for every head, each head's own loss, and the config's hash.
The command-line round trip too: profile -> plan -> a changed config refused by run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

tf = pytest.importorskip("transformers")

from pipeplan.intake.hf_source import DROPOUT_KEYS, default_head, default_spec, file_sha256
from pipeplan.intake.model import ModelSpec, NamedInputs, load_model
from pipeplan.planner.errors import ModelLoadError
from pipeplan.planner.io import load_plan, load_profile
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


CLI_FAST = ["--warmup", "0", "--repeats", "1", "--quiet"]
HEADS = {
    "LlamaForCausalLM": ("LlamaConfig", {"num_key_value_heads": 1}),
    "BertForMaskedLM": ("BertConfig", {}),
    "BertForSequenceClassification": ("BertConfig", {"num_labels": 3}),
    "BartForConditionalGeneration": ("BartConfig", {}),
    "ViTForImageClassification": ("ViTConfig", {"image_size": 8, "patch_size": 4}),
}


def _config(tmp_path: Path, arch: str) -> Path:
    tf = pytest.importorskip("transformers")
    cls, extra = HEADS[arch]
    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "vocab_size": 64, "max_position_embeddings": 32}  # fmt: skip
    if cls == "BartConfig":
        sizes = {"d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "vocab_size": 64,
                 "encoder_attention_heads": 2, "decoder_attention_heads": 2,
                 "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 32}  # fmt: skip
    getattr(tf, cls)(**sizes, **extra, architectures=[arch]).save_pretrained(tmp_path / arch)
    return tmp_path / arch / "config.json"


@pytest.mark.parametrize("arch", list(HEADS))
def test_hf_config_source_matches_the_models_own_loss(tmp_path: Path, arch: str) -> None:
    spec = load_model(f"hf:{_config(tmp_path, arch)}", {"seq_len": 8})
    inputs, target = spec.batch(2)
    assert isinstance(spec.module, NamedInputs) and type(spec.module.model).__name__ == arch
    named = dict(zip(spec.module.names or (), inputs))
    ours = spec.loss(spec.module(*inputs), target)
    theirs = spec.module.model(**named, labels=target).loss
    torch.testing.assert_close(ours, theirs)


@pytest.mark.multirank
def test_hf_source_profile_plan_and_changed_config(tmp_path: Path, cli) -> None:
    config = _config(tmp_path, "LlamaForCausalLM")
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    code, _, err = cli(["profile", f"hf:{config}", "-b", "2", "--seq-len", "8", *CLI_FAST,
                        "-o", str(prof)])  # fmt: skip
    assert code == 0, err
    profile = load_profile(prof)
    assert profile.model_kwargs == {"seq_len": 8} and profile.model_sha256 == file_sha256(config)
    code, _, err = cli(["plan", str(prof), "--stages", "2", "--memory", "1GiB", "-o", str(plan)])
    assert code == 0, err
    assert load_plan(plan).model_sha256 == file_sha256(config)
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "rms_norm_eps": 1e-5}))
    code, _, err = cli(["run", str(plan), "--steps", "1"])
    assert code == 2 and "changed since the plan was made" in err and len(err.splitlines()) == 1


def test_hf_source_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(f"hf:{tmp_path / 'missing.json'}")
    config = _config(tmp_path, "LlamaForCausalLM")
    with pytest.raises(ModelLoadError, match="seq_len 64 exceeds the model's 32 positions"):
        load_model(f"hf:{config}", {"seq_len": 64})
    with pytest.raises(ModelLoadError, match="takes the model arguments seq_len and seed"):
        load_model(f"hf:{config}", {"depth": 3})
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "architectures": ["LlamaModel"]}))
    with pytest.raises(ModelLoadError, match="names no class with a head"):
        load_model(f"hf:{config}")
    bare = pytest.importorskip("transformers").LlamaModel(_tiny_llama_config())
    with pytest.raises(ModelLoadError, match="no head pipeplan can feed"):
        default_spec(bare)


def _tiny_llama_config() -> object:
    tf = pytest.importorskip("transformers")
    return tf.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
