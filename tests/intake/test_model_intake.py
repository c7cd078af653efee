"""The model contract as users meet it: named inputs, transformers models as they are, the
``hf:config.json`` source, and errors in the user's code (one line with file:line, exit 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from pipeplan.intake.hf_source import default_spec, file_sha256
from pipeplan.intake.model import NamedInputs, load_model
from pipeplan.planner.errors import ModelLoadError, UserCodeError
from pipeplan.planner.io import load_plan, load_profile

FAST = ["--warmup", "0", "--repeats", "1", "--quiet"]
HERE = Path(__file__).parent
SOURCE = (HERE / "_user_code.py").read_text().splitlines()


def _line_of(tag: str) -> int:
    return next(i for i, line in enumerate(SOURCE, start=1) if tag in line)


def test_named_inputs_become_positional_in_a_fixed_order() -> None:
    spec = load_model("_user_code:named_inputs")
    assert isinstance(spec.module, NamedInputs) and spec.module.names == ("offset", "features")
    (offset, features), y = spec.batch(3)
    assert offset.shape == features.shape == (3, 4) and y.shape == (3,)
    out = spec.module(offset, features)
    assert set(out) == {"logits"} and spec.loss(out, y).dim() == 0


def test_a_bare_transformers_model_gets_batches_and_its_own_loss() -> None:
    spec = load_model("_user_code:bare_llama")
    assert isinstance(spec.module, NamedInputs)
    assert spec.module.fixed == {"use_cache": False, "return_dict": True}
    (ids,), target = spec.batch(2)
    assert ids.shape == (2, 16) and torch.equal(ids, target)
    out = spec.module(ids)
    ours = spec.loss(out, target)
    theirs = spec.module.model(input_ids=ids, labels=target).loss
    torch.testing.assert_close(ours, theirs)


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
    code, _, err = cli(["profile", f"hf:{config}", "-b", "2", "--seq-len", "8", *FAST,
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


ERRORS = {
    "callable_raises": ("the model callable _user_code:callable_raises raised KeyError", "BUG-CALLABLE"),
    "make_batch_raises": ("the model's make_batch(1) raised RuntimeError", "BUG-BATCH"),
    "loss_raises": ("the model's loss raised AttributeError", "BUG-LOSS"),
    "forward_raises": ("the model's forward (Net) raised RuntimeError", "BUG-FORWARD"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ERRORS))
def test_user_code_errors_are_one_line_with_file_and_line(tmp_path: Path, cli, name: str) -> None:
    out = tmp_path / "p.json"
    code, _, err = cli(["profile", f"_user_code:{name}", "-b", "2", *FAST, "-o", str(out)])
    what, tag = ERRORS[name]
    assert code == 2 and not out.exists()
    line = " ".join(err.split())
    assert line.startswith(f"error: {what}"), line
    assert re.search(rf"_user_code\.py:{_line_of(tag)}\)$", line), line
    assert "Traceback" not in err


def test_debug_shows_the_traceback(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["profile", "_user_code:loss_raises", "-b", "2", *FAST, "-o", str(tmp_path / "p.json")]
    code, _, err = cli([*argv, "--debug"])
    assert code == 2 and "Traceback" in err and "AttributeError" in err
    monkeypatch.setenv("PIPEPLAN_DEBUG", "1")
    code, _, err = cli(argv)
    assert code == 2 and "Traceback" in err


def test_user_errors_raise_user_code_error() -> None:
    with pytest.raises(UserCodeError, match=r"KeyError: 'vocab_size' \(.*_user_code\.py:\d+\)"):
        load_model("_user_code:callable_raises")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["_user_code:named_inputs", "--max-stages", "0"], "--max-stages 0 must be at least 1"),
        (["_user_code:named_inputs", "--seq-len", "0"], "--seq-len 0 must be positive"),
        (["hf:/no/such/config.json"], "cannot read /no/such/config.json"),
        (["_user_code:named_inputs", "--model-arg", "depth=3"], "check --model-arg"),
    ],
)
def test_bad_profile_input(tmp_path: Path, cli, args: list[str], message: str) -> None:
    out = tmp_path / "p.json"
    code, _, err = cli(["profile", *args, "-b", "2", *FAST, "-o", str(out)])
    assert code == 2 and message in " ".join(err.split()), err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
