"""The model contract: positional and named inputs, ``transformers`` models returned as they
are (in a spec, or bare) traced and profiled with no wrapper, and ``--seq-len`` for them."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from _hf_models import BARE

from pipeplan.intake.model import NamedInputs, load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.errors import ModelLoadError, UserCodeError
from pipeplan.profiler import profile_model

FAST = {"warmup": 0, "repeats": 1, "progress": False}
CLI_FAST = ["--warmup", "0", "--repeats", "1", "--quiet"]
SOURCE = (Path(__file__).parent / "_hf_models.py").read_text().splitlines()
HF = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers")


@HF
def test_positional_inputs_need_no_wrapper() -> None:
    spec = load_model("_hf_models:positional_spec")
    assert not isinstance(spec.module, NamedInputs)
    (x, mask), y = spec.batch(3)
    assert x.shape == mask.shape == (3, 4) and y.shape == (3,)


@HF
def test_a_transformers_model_in_a_spec_gets_named_inputs_and_its_loss_a_model_output() -> None:
    spec = load_model("_hf_models:llama_spec")
    assert isinstance(spec.module, NamedInputs)
    assert spec.module.names == ("input_ids", "attention_mask")
    assert spec.module.fixed == {"use_cache": False, "return_dict": True}
    model: Any = spec.module.model
    assert model.config.use_cache is False
    inputs, target = spec.batch(2)
    assert spec.loss(spec.module(*inputs), target).dim() == 0  # the loss asserts a ModelOutput
    profile = profile_model(
        "_hf_models:llama_spec",
        batch_size=2,
        microbatch_sizes=[2],
        **FAST,  # type: ignore[arg-type]
    )
    names = [u.name for u in profile.units]  # LlamaForCausalLM's own names, no wrapper's
    assert names[0] == "model.embed_tokens" and names[-1].endswith("lm_head"), names
    assert any(p.startswith("model.model.layers.0.") for u in profile.units for p in u.params)


@HF
@pytest.mark.parametrize("name", list(BARE))
def test_a_bare_transformers_model_traces_and_profiles(name: str) -> None:
    spec = load_model("_hf_models:bare", {"name": name})
    assert isinstance(spec.module, NamedInputs)
    assert type(spec.module.model).__name__ == BARE[name][0]
    inputs, target = spec.batch(2)
    named = dict(zip(spec.module.names or (), inputs))
    theirs = spec.module.model(**named, labels=target).loss  # dropout is off in _hf_models
    torch.testing.assert_close(spec.loss(spec.module(*inputs), target), theirs)
    traced = trace_model(spec.module, inputs)
    assert traced.gm.graph.nodes
    profile = profile_model(
        "_hf_models:bare",
        batch_size=2,
        model_kwargs={"name": name, "seq_len": 8},
        microbatch_sizes=[2],
        **FAST,  # type: ignore[arg-type]
    )
    assert len(profile.units) >= 2 and profile.model_sha256 is None
    assert profile.model_kwargs == {"name": name, "seq_len": 8}


@HF
def test_seq_len_reaches_a_bare_models_batches() -> None:
    spec = load_model("_hf_models:bare", {"name": "llama", "seq_len": 8})
    (ids,), _ = spec.batch(2)
    assert ids.shape == (2, 8)
    (ids,), _ = load_model("_hf_models:bare", {"name": "llama"}).batch(2)
    assert ids.shape == (2, 16)  # default: min(128, the model's positions)
    spec = load_model("_hf_models:bare_with_seq_len", {"seq_len": 6})  # the callable takes it
    (ids,), _ = spec.batch(2)
    model: Any = spec.module.model
    assert ids.shape == (2, 6) and model.config.max_position_embeddings == 6


@HF
def test_seq_len_for_a_callable_that_does_not_take_it() -> None:
    with pytest.raises(ModelLoadError, match="takes no seq_len argument"):
        load_model("_hf_models:spec_without_seq_len", {"seq_len": 8})


@HF
def test_a_bug_in_a_wrapped_forward_names_the_users_class_and_line() -> None:
    spec = load_model("_hf_models:named_forward_raises")
    inputs, _ = spec.batch(2)
    line = next(i for i, s in enumerate(SOURCE, start=1) if "BUG-NAMED-FORWARD" in s)
    with pytest.raises(UserCodeError) as info:
        trace_model(spec.module, inputs, tracer="fx")
    message = str(info.value)
    assert message.startswith("the model's forward (Tagger) raised RuntimeError"), message
    assert re.search(rf"_hf_models\.py:{line}\)$", message) and "\n" not in message
    assert isinstance(info.value.__cause__, RuntimeError)


@HF
def test_cli_seq_len_for_a_bare_model_and_a_callable_without_it(tmp_path: Path, cli: Any) -> None:
    out = tmp_path / "p.json"
    argv = ["profile", "_hf_models:bare", "--model-arg", "name=vit", "-b", "2", "--seq-len", "4"]
    fast = ["--warmup", "0", "--repeats", "1", "--quiet", "--microbatch-sizes", "2"]
    code, _, err = cli([*argv, *fast, "-o", str(out)])
    assert code == 0 and out.exists(), err
    out.unlink()
    code, _, err = cli(["profile", "_hf_models:spec_without_seq_len", "-b", "2", "--seq-len",
                        "4", *fast, "-o", str(out)])  # fmt: skip
    assert code == 2 and not out.exists() and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "takes no seq_len argument" in err


def test_named_inputs_become_positional_in_a_fixed_order() -> None:
    spec = load_model("_user_code:named_inputs")
    assert isinstance(spec.module, NamedInputs) and spec.module.names == ("offset", "features")
    (offset, features), y = spec.batch(3)
    assert offset.shape == features.shape == (3, 4) and y.shape == (3,)
    out = spec.module(offset, features)
    assert set(out) == {"logits"} and spec.loss(out, y).dim() == 0


@HF
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
    code, _, err = cli(["profile", *args, "-b", "2", *CLI_FAST, "-o", str(out)])
    assert code == 2 and message in " ".join(err.split()), err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
