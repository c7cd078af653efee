"""The bundled models honour the model contract: seeded batches, mean losses, float64."""

from __future__ import annotations

import sys

import pytest
import torch

from pipeplan.intake.model import load_model
from pipeplan.planner.errors import ModelLoadError, UserCodeError

SMALL = {
    "pipeplan.models.gpt:gpt": {
        "vocab": 64,
        "d_model": 16,
        "n_layers": 2,
        "n_heads": 2,
        "seq_len": 8,
    },
    "pipeplan.models.resnet:resnet": {"width": 4, "blocks": "1,1", "image": 8},
    "pipeplan.models.mlp:mlp": {"width": 16, "depth": 3, "in_features": 8},
    "pipeplan.models.hf:gpt2": {
        "vocab": 64,
        "d_model": 16,
        "n_layers": 2,
        "n_heads": 2,
        "seq_len": 8,
    },
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_batches_are_seeded_and_losses_are_batch_means(name: str) -> None:
    if name.startswith("pipeplan.models.hf"):
        pytest.importorskip("transformers")
    spec = load_model(name, SMALL[name])
    (x,), y = spec.batch(4)
    (x2,), y2 = spec.batch(4)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    full = spec.loss(spec.module(x), y)
    halves = [spec.loss(spec.module(x[i : i + 2]), y[i : i + 2]) for i in (0, 2)]
    torch.testing.assert_close(full, sum(halves) / 2)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_float64(name: str) -> None:
    if name.startswith("pipeplan.models.hf"):
        pytest.importorskip("transformers")
    spec = load_model(name, SMALL[name])
    (x,), y = spec.batch(2)
    module = spec.module.double()
    out = module(x.double() if x.is_floating_point() else x)
    assert out.dtype == torch.float64
    spec.loss(out, y).backward()


def test_gpt_ties_head_to_embedding_by_default() -> None:
    tied = load_model("pipeplan.models.gpt:gpt", SMALL["pipeplan.models.gpt:gpt"]).module
    assert tied.head.proj.weight is tied.embed.tok.weight
    untied = load_model(
        "pipeplan.models.gpt:gpt", {**SMALL["pipeplan.models.gpt:gpt"], "tie_weights": False}
    ).module
    assert untied.head.proj.weight is not untied.embed.tok.weight


def test_same_seed_same_weights() -> None:
    a = load_model("pipeplan.models.mlp:mlp", SMALL["pipeplan.models.mlp:mlp"]).module
    b = load_model("pipeplan.models.mlp:mlp", SMALL["pipeplan.models.mlp:mlp"]).module
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_bad_knobs_are_rejected() -> None:
    """A knob the model refuses is the user's error: one line naming the model's check."""
    with pytest.raises(
        UserCodeError, match=r"raised ValueError: .*d_model.*\(pipeplan/models/gpt\.py:\d+\)"
    ):
        load_model("pipeplan.models.gpt:gpt", {"d_model": 10, "n_heads": 4})
    with pytest.raises(UserCodeError, match="blocks"):
        load_model("pipeplan.models.resnet:resnet", {"blocks": "2,x"})


def test_hf_without_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModelLoadError, match="transformers"):
        load_model("pipeplan.models.hf:llama")
