"""torchtitan: the model's direct children and the items of its block list per model part
(``module_fqns_per_model_part``), as its ``_split_module`` keeps them."""

from __future__ import annotations

import json
from typing import Final

from pipeplan.export.layout import ModelLayout
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import Plan

__all__ = ["torchtitan_text"]


#: torchtitan's transformers backend's names for a Llama-like model's modules under ``model.``
#: (torchtitan/experiments/transformers_modeling_backend/model.py, ``named_children``).
_TITAN_HF_NAMES: Final = {"embed_tokens": "tok_embeddings", "final_layernorm": "norm"}


#: torchtitan's ``pipeline_parallel_schedule`` names (torch's ``get_schedule_class``).
_TITAN_SCHEDULES: Final = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved1f1b": "Interleaved1F1B",
    "loopedbfs": "LoopedBFS",
    "zb-interleaved": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}


def torchtitan_text(
    layout: ModelLayout, stage_keys: list[list[str]], plan: Plan
) -> tuple[str, list[list[str]]]:
    prefix = layout.wrapper + "." if layout.wrapper else ""
    names = [[k.removeprefix(prefix) for k in ks] for ks in stage_keys]
    if layout.wrapper == "model" and layout.container == "model.layers":
        # Before the first layer a decoder only embeds: a unit there named lm_head reads the
        # embedding tied to it (units are named after the parameters they read).
        first = next(
            j for j, ns in enumerate(names) if any(layout.is_block(k) for k in stage_keys[j])
        )
        for j in range(first + 1):
            block = next((i for i, k in enumerate(stage_keys[j]) if layout.is_block(k)), None)
            cut = len(names[j]) if block is None else block
            names[j] = [
                "embed_tokens" if n == "lm_head" and i < cut else n for i, n in enumerate(names[j])
            ]
            names[j] = list(dict.fromkeys(names[j]))
        names = [[_TITAN_HF_NAMES.get(n, n) for n in ns] + ["rotary_emb"] for ns in names]
    elif layout.wrapper:
        raise InvalidRequestError(
            f"torchtitan: the block list {layout.container} is not a direct child of the model, "
            f"and torchtitan keeps only the model's direct children and the items of a direct "
            f"ModuleList (its transformers backend flattens Llama-like models only); "
            f"export --to deepspeed or fqns"
        )
    for n in sorted({n for ns in names for n in ns}):
        parts = n.split(".")
        if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise InvalidRequestError(
                f"torchtitan: {n} is neither a direct child of the model nor an item of a "
                f"direct ModuleList, and torchtitan keeps only those; export --to deepspeed or "
                f"fqns"
            )
    schedule = _TITAN_SCHEDULES[plan.schedule]
    text = (
        "[parallelism]\n"
        f"pipeline_parallel_degree = {len(names) // plan.stages_per_rank}\n"
        f'pipeline_parallel_schedule = "{schedule}"\n'
        f"num_pp_microbatches = {plan.microbatches}\n"
        f"module_fqns_per_model_part = {json.dumps(names)}\n"
    )
    return text, names
