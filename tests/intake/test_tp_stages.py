"""The sizes a traced view, reshape or expand takes on one of t tensor-parallel ranks
(:func:`pipeplan.intake.tp_stages._local_sizes`) and the attention masks cut to its heads; the
split itself is tested on 4 ranks in ``test_mesh.py`` (the loss and every gradient of a pp 2 x
tp 2 run equal the unsplit model's)."""

from __future__ import annotations

import pytest
import torch

from pipeplan.intake.tp_stages import _local_sizes, _rank_heads
from pipeplan.planner.errors import InvalidRequestError


def test_a_split_feature_dimension_shrinks_its_outermost_piece() -> None:
    """q_proj's 32 output features, sharded 2 ways, viewed as 4 heads of 8: 2 heads a rank."""
    assert _local_sizes("reshape", (3, 8, 32), (3, 8, 16), (3, 8, 4, 8)) == [3, 8, 2, 8]


def test_merged_dimensions_shrink_where_the_sharded_one_lands() -> None:
    """Llama's repeat_kv under export: (B, kv 2, rep 2, T, D) -> (B, heads 4, T, D)."""
    assert _local_sizes("reshape", (3, 2, 2, 8, 16), (3, 1, 2, 8, 16), (3, 4, 8, 16)) == [
        3, 2, 8, 16,
    ]  # fmt: skip
    assert _local_sizes("reshape", (3, 8, 2, 8), (3, 8, 1, 8), (3, 8, 16)) == [3, 8, 8]


def test_an_expand_keeps_the_local_size_of_a_dimension_it_does_not_broadcast() -> None:
    assert _local_sizes("expand", (3, 2, 1, 8, 16), (3, 1, 1, 8, 16), (3, 2, 2, 8, 16)) == [
        3, 1, 2, 8, 16,
    ]  # fmt: skip
    assert _local_sizes("expand", (2, 1), (1, 1), (5, 2, 4)) == [5, 1, 4]


def test_unsplit_inputs_keep_their_sizes() -> None:
    assert _local_sizes("reshape", (3, 8, 32), (3, 8, 32), (3, 8, 4, 8)) == [3, 8, 4, 8]


def test_a_shard_that_does_not_divide_the_output_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="cannot hold 1/2 of dimension 1"):
        _local_sizes("reshape", (3, 6, 5), (3, 3, 5), (3, 5, 6))


def test_a_mask_of_every_head_is_cut_to_the_ranks_heads_and_no_other() -> None:
    """T5's cross-attention bias, zeros(1, 4, q, k) with the global 4 heads, meets 2 local
    heads on rank 1 of 2: it gets heads 2 and 3.  A causal mask of one head, a mask already
    local, and one of neither size pass as they are."""
    query = torch.zeros(3, 2, 5, 8)
    whole = torch.arange(4.0).view(1, 4, 1, 1).expand(1, 4, 5, 5)
    assert _rank_heads(whole, query, 1, 2)[0, :, 0, 0].tolist() == [2.0, 3.0]
    for mask in (torch.zeros(3, 1, 5, 5), torch.zeros(1, 2, 5, 5), torch.zeros(1, 3, 5, 5)):
        assert _rank_heads(mask, query, 1, 2) is mask


def test_only_masks_that_held_every_head_unsplit_are_wrapped() -> None:
    """Of two attentions over 4 heads, the one whose mask broadcasts over the heads (a causal
    mask, (1, 1, q, k)) keeps it; the one whose mask holds all 4 is cut, and the body then
    runs on rank 1's 2 heads with that rank's share of the mask."""
    from torch.fx.passes.shape_prop import ShapeProp

    from pipeplan.intake.tp_stages import _local_attention_masks

    class Two(torch.nn.Module):
        def forward(self, q, k, v, causal, bias):  # type: ignore[no-untyped-def]
            sdpa = torch.nn.functional.scaled_dot_product_attention
            return sdpa(q, k, v, attn_mask=causal) + sdpa(q, k, v, attn_mask=bias)

    q = torch.randn(1, 4, 3, 8)
    causal, bias = torch.zeros(1, 1, 3, 3), torch.randn(1, 4, 3, 3)
    body = torch.export.export(Two(), (q, q, q, causal, bias)).module()
    for node in list(body.graph.nodes):  # export's input guards pin the 4 heads
        if node.op == "call_module" and "guards" in str(node.target):
            body.graph.erase_node(node)
    ShapeProp(body).propagate(q, q, q, causal, bias)
    _local_attention_masks(body, 1, 2)
    body.recompile()
    cuts = [n for n in body.graph.nodes if n.target is _rank_heads]
    assert len(cuts) == 1
    local = q[:, 2:]
    want = Two()(local, local, local, causal, bias[:, 2:])
    torch.testing.assert_close(body(local, local, local, causal, bias), want)
