"""A plan in the terms of the frameworks users train with (``pipeplan export``).

A plan cuts between units; each unit's name says which modules it holds (:mod:`pipeplan.intake.graph`:
``model.layers.3``, ``model.norm+lm_head``, a piece of a leaf module ``blocks.3.norm[pow_1]``,
a second piece of one module ``blocks.3.attn#2``, parameter-free glue ``glue`` or ``[add]``).
Names are relative to the user's model (a prefix every module shares, such as pipeplan's own
wrapper's, is dropped).  Each target sees the model at its own granularity, a *key* per module:

``fqns``
    The module names as the plan names them.  A list of module names per stage.
``torchtitan``
    torchtitan 0.3.x's ``--parallelism.*`` overrides and the same settings for a config function
    (:mod:`pipeplan.export.torchtitan`).  The model's direct children and the items of its block list (``embed``, ``blocks.3``,
    ``head``): what torchtitan's ``_split_module`` keeps per stage (``module_fqns_per_model_part``:
    a direct child by name, or ``child.i`` of a direct ``ModuleList``/``ModuleDict``; nested
    lists are not supported).  A transformers decoder, whose blocks lie in ``model.layers``, is
    named as torchtitan's transformers backend flattens it: ``tok_embeddings`` (for
    ``model.embed_tokens``), ``layers.N``, ``norm``, ``lm_head``, and ``rotary_emb`` on every
    stage.  Any other
    model whose block list is not a direct child cannot be named (an error).  A block list
    that is an ``nn.Sequential`` is kept whole by torchtitan; pipeplan does not load the model
    to check.
``deepspeed``
    The same modules, with their full names, as the flat ``LAYERS`` of a small Python module that
    builds DeepSpeed's ``PipelineModule`` with the plan's ``PARTS`` (stage s holds
    ``LAYERS[PARTS[s]:PARTS[s + 1]]``) and ``TiedLayerSpec`` for a parameter shared across
    stages (:mod:`pipeplan.export.deepspeed`).
``megatron``
    ``E`` (every unit before the first block), one ``t`` per block, ``L`` (every unit after the
    last block): the ``--pipeline-model-parallel-layout`` string, and the
    ``--decoder-first/last-pipeline-num-layers`` pair when the middle stages hold equal counts.
    A plan with v chunks per rank in a loop lists its p v chunks in the layout and the size p,
    which makes Megatron's virtual pipeline size v (its VPP runs its own interleaved
    schedule); V-placed plans are refused.

Schedules: torchtitan gets the plan's family by torch's name and its p v model parts; DeepSpeed
runs only its own schedule, so plans of the other families are refused for it.

Degrees: the plan's p x d x t ranks in each target's terms (torchtitan's and Megatron's tensor-
and sequence-parallel settings, Megatron's rank order); DeepSpeed refuses t > 1, and a t the
profile's split dimensions do not take is an error (:mod:`pipeplan.export.degrees`).

A tied weight is named under the module torch names it after (GPT-2's ``transformer.wte``), not
after the head that shares it (:func:`pipeplan.export.layout.owner_names`; the plan's profile
tells which, without it a transformers decoder's tied embedding is ``model.embed_tokens``).  A
module named in several stages gets a note on each export.

Cut snapping lives in :mod:`pipeplan.export.snap`.  A cut between two units is expressible when no key lies on both sides of it (parameter-free glue
has no key and is transparent).  A plan with a cut the target cannot express is moved to the
closest plan it can: each such cut goes to the nearest expressible position before or after it,
and of those choices the one with the lowest predicted step time (:func:`pipeplan.planner.evaluate.
evaluate` on the plan's profile) is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from pipeplan.export.deepspeed import deepspeed_config, deepspeed_text, fqns_text
from pipeplan.export.degrees import check_tensor_parallel, rank_order
from pipeplan.export.layout import (
    TARGET_FAMILIES,
    TARGETS,
    ModelLayout,
    Target,
    owner_names,
    param_prefix,
)
from pipeplan.export.megatron import (
    megatron_batch_args,
    megatron_layout,
    megatron_mesh_args,
    megatron_text,
)
from pipeplan.export.snap import (
    Adjustment,
    closest_plan,
    legal_cuts,
    pricer,
    stage_keys_of,
    starts_of,
    target_cuts,
    tied_notes,
)
from pipeplan.export.torchtitan import TORCHTITAN_VERSION, torchtitan_text
from pipeplan.planner.errors import FingerprintMismatchError, InvalidRequestError
from pipeplan.planner.types import Plan, Profile

__all__ = [
    "TARGETS",
    "TARGET_FAMILIES",
    "Adjustment",
    "Export",
    "ModelLayout",
    "Target",
    "export_plan",
    "megatron_layout",
    "target_cuts",
]


@dataclass(frozen=True)
class Export:
    """One plan written for one target."""

    target: Target
    text: str
    """What the target reads (command-line arguments, a Python module or JSON), ending in a
    newline."""
    stage_keys: tuple[tuple[str, ...], ...]
    """Per stage, the target's names in order (megatron: ``E``, ``t``, ``L``)."""
    adjustment: Adjustment | None = None
    notes: tuple[str, ...] = ()


def export_plan(plan: Plan, target: Target, profile: Profile | None = None) -> Export:
    """``plan`` in ``target``'s terms; when the target cannot express a cut, the closest plan
    it can (priced on ``profile``, which must be the plan's; without it the cut is an error).
    """
    if target not in TARGETS:
        raise InvalidRequestError(f"--to {target!r} is not one of {', '.join(TARGETS)}")
    if profile is not None and profile.fingerprint != plan.profile_fingerprint:
        raise FingerprintMismatchError(
            f"the profile's fingerprint {profile.fingerprint} is not the plan's "
            f"({plan.profile_fingerprint}); give the profile the plan was made from"
        )
    if plan.granularity == "node":
        raise InvalidRequestError(
            "the plan's units are graph nodes (profiled with --granularity node), not modules, "
            "so no framework can name them; profile with --granularity auto and plan again"
        )
    chunked = plan.schedule not in ("gpipe", "1f1b")
    if chunked and target == "deepspeed":
        raise InvalidRequestError(
            f"deepspeed runs its own schedule (one stage per rank, 1F1B-like), not "
            f"{plan.schedule}; plan with --schedule 1f1b to export it there"
        )
    if chunked and target == "megatron" and plan.schedule in ("zbv", "dualpipev"):
        raise InvalidRequestError(
            f"megatron runs virtual stages in a loop (VPP), not {plan.schedule}'s V; plan with "
            "--schedule interleaved1f1b to export it there"
        )
    mesh_notes = check_tensor_parallel(plan, target, profile)
    names = [n for s in plan.stages for n in s.unit_names]
    if profile is not None:
        shared = [(sp.name, sp.units) for sp in profile.shared_params]
        names = owner_names(names, shared, [u.params for u in profile.units])
    else:
        names = owner_names(names)
    layout = ModelLayout.of(names)
    keys = layout.keys(target)
    legal = legal_cuts(keys)
    starts = starts_of(plan)
    adjustment = None
    if not all(legal[b] for b in starts[1:]):
        price = None if profile is None or chunked else pricer(plan, profile)
        cuts, reason, nearest = closest_plan(plan, keys, legal, price, target)
        if nearest is None:
            raise InvalidRequestError(
                f"{reason}; give --profile PROFILE (the plan's profile) to price the closest "
                f"plan it can express"
            )
        adjustment = Adjustment(reason, nearest)
        starts = [0, *cuts]
    stage_keys = stage_keys_of(keys, starts)
    notes = tied_notes(stage_keys, target) + mesh_notes
    if target == "megatron":
        block_starts = [
            min(u for u, ks in enumerate(keys) if k in ks)
            for k in dict.fromkeys(k for ks in keys for k in ks if k not in ("E", "L"))
        ]
        price = None if profile is None or chunked else pricer(plan, profile)
        text, more = megatron_text(
            stage_keys, block_starts, price, plan.step_time_s, plan.stages_per_rank
        )
        mesh, order_notes = megatron_mesh_args(plan, rank_order(plan))
        batch = " ".join(filter(None, (megatron_batch_args(plan), mesh)))
        # on each line: the alternative replaces the first
        text = "".join(f"{line} {batch}\n" if line else "\n" for line in text.splitlines())
        notes += more + order_notes
        out_keys = [
            (["E"] if j == 0 else [])
            + ["t"] * sum(k not in ("E", "L") for k in ks)
            + (["L"] if j == len(stage_keys) - 1 else [])
            for j, ks in enumerate(stage_keys)
        ]
    elif target == "torchtitan":
        text, out_keys, more = torchtitan_text(layout, stage_keys, plan, rank_order(plan))
        notes += more
        if profile is not None:
            bounds = [*starts, len(names)]
            stage_of = [j for j, (a, b) in enumerate(pairwise(bounds)) for _ in range(a, b)]
            prefix = param_prefix(names, [u.params for u in profile.units])
            for sp in profile.shared_params:
                spans = sorted({stage_of[u] for u in sp.units})
                if len(spans) > 1:
                    notes.append(
                        f"torchtitan: {sp.name.removeprefix(prefix)} is tied across stages "
                        f"{spans}; torchtitan "
                        f"{TORCHTITAN_VERSION} keeps a copy on each and does not synchronise "
                        f"them (its transformers backend unties a tied head), so they train "
                        f"apart"
                    )
    elif target == "deepspeed":
        config = deepspeed_config(
            plan.microbatch_size,
            plan.microbatches,
            plan.cluster.data_parallel,
            plan.cluster.data_parallel_mode == "shard",
        )
        text, out_keys = deepspeed_text(stage_keys, plan.model, config), stage_keys
    else:
        text, out_keys = fqns_text(stage_keys), stage_keys
    return Export(
        target,
        text,
        tuple(tuple(ks) for ks in out_keys),
        adjustment,
        tuple(notes),
    )
