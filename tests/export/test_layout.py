"""The model's block lists (:mod:`pipeplan.export.layout`)."""

from __future__ import annotations

from _export_rules import (
    T5_NAMES,
    ds_fields,
    named_profile,
    plan_of,
)

from pipeplan.export import export_plan


def test_an_encoder_and_a_decoder_are_two_block_lists() -> None:
    """DeepSpeed cuts between the blocks of either stack, not only between the stacks."""
    prof = named_profile(T5_NAMES)
    result = export_plan(plan_of(prof, [0, 2, 5]), "deepspeed")
    assert result.adjustment is None
    assert ds_fields(result.text)["parts"] == [0, 2, 5, 8]
    assert result.stage_keys[1] == (
        "encoder.block.1",
        "encoder.final_layer_norm",
        "decoder.block.0",
    )
