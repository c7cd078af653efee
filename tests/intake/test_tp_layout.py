"""The tensor-parallel layout of the zoo's transformers and the bundled models."""

from __future__ import annotations

import pytest
from torch import nn

from pipeplan.intake.tp_layout import Layout, check_degree, find_layout, unit_styles
from pipeplan.models.gpt import gpt
from pipeplan.models.zoo import build
from pipeplan.planner.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("name", "source", "per_layer"),
    [
        ("llama", "transformers", 7),
        ("qwen2", "transformers", 7),
        ("bert", "names", 6),
        ("t5", "names", None),
        ("bart", "names", None),
    ],
)
def test_zoo_blocks_split_column_then_row(name: str, source: str, per_layer: int | None) -> None:
    layout = find_layout(build(name, n_layers=2).module)
    assert isinstance(layout, Layout)
    assert layout.source == source
    cols = [k for k, v in layout.styles.items() if v == "colwise"]
    rows = [k for k, v in layout.styles.items() if v == "rowwise"]
    assert cols and rows
    heads = [k for k, v in layout.styles.items() if v == "colwise_gather"]
    if per_layer is not None:
        assert len(layout.styles) == 2 * per_layer + len(heads)
    # transformers' own plan splits an untied head over the vocabulary; names never do
    assert heads == (["lm_head"] if source == "transformers" else [])
    assert layout.divisors["heads"] == 2


def test_llama_layout_is_megatrons() -> None:
    layout = find_layout(build("llama", n_layers=1).module)
    assert isinstance(layout, Layout)
    assert layout.styles == {
        "model.layers.0.self_attn.q_proj": "colwise",
        "model.layers.0.self_attn.k_proj": "colwise",
        "model.layers.0.self_attn.v_proj": "colwise",
        "model.layers.0.self_attn.o_proj": "rowwise",
        "model.layers.0.mlp.gate_proj": "colwise",
        "model.layers.0.mlp.up_proj": "colwise",
        "model.layers.0.mlp.down_proj": "rowwise",
        "lm_head": "colwise_gather",  # the vocabulary split, the logits gathered
    }
    assert layout.divisors["lm_head features"] == 128  # the vocabulary
    assert unit_styles(layout, ["model.layers.0.mlp.up_proj.weight"]) == {
        "model.layers.0.mlp.up_proj": "colwise"
    }


def test_fused_qkv_is_not_split() -> None:
    assert isinstance(find_layout(build("gpt2", n_layers=1).module), str)
    layout = find_layout(gpt(n_layers=1).module)
    assert isinstance(layout, Layout)
    assert set(layout.styles) == {"blocks.0.fc", "blocks.0.out"}


def test_no_projections_is_one_line() -> None:
    reason = find_layout(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    assert isinstance(reason, str)
    assert "\n" not in reason and "stays 1" in reason


def test_degree_names_the_dimension() -> None:
    layout = find_layout(build("llama", n_layers=1).module)
    assert isinstance(layout, Layout)
    check_degree(layout, 1)
    assert layout.divisors["kv_heads"] == 1  # the zoo's Llama: 2 heads, 1 KV head
    with pytest.raises(InvalidRequestError, match=r"does not divide the model's kv_heads \(1\)"):
        check_degree(layout, 2)
    layout = find_layout(build("bert", n_layers=1).module)
    assert isinstance(layout, Layout)
    check_degree(layout, 2)
    with pytest.raises(InvalidRequestError, match=r"does not divide the model's heads \(2\)"):
        check_degree(layout, 4)


def test_a_head_tied_to_the_embedding_stays_whole() -> None:
    """Splitting a weight the embedding shares would split the embedding too: a tied head is
    left out of the layout, its blocks still split."""
    model = build("llama", n_layers=1).module
    model.lm_head.weight = model.model.embed_tokens.weight
    layout = find_layout(model)
    assert isinstance(layout, Layout)
    assert "lm_head" not in layout.styles and len(layout.styles) == 7
