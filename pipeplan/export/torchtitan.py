"""torchtitan 0.3.x: the model's direct children and the items of its block list per model part
(``parallelism.module_fqns_per_model_part``), as its ``_split_module`` keeps them.

torchtitan 0.3.0 (the current release) configures a job with a Python config function and
``--section.field`` overrides that its ``ConfigManager`` (tyro) parses; it reads no TOML.  The
export is those overrides on one line (a ``list[str]`` is comma-separated, a list of them one
argument each) and, in comments, the same settings for a config function:

* ``--parallelism.pipeline_parallel_degree p``, ``--parallelism.pipeline_parallel_schedule``
  (torch's class name: ``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``ZBVZeroBubble``, ...),
  ``--parallelism.module_fqns_per_model_part`` (p·v model parts for v stages per rank);
* the micro-batches as ``--training.local_batch_size B`` and
  ``--parallelism.pipeline_parallel_microbatch_size B / m`` (0.3.0 has no micro-batch count);
* ``--training.disable_cuda_graphs``: 0.3.0 refuses pipeline parallelism with CUDA graphs;
* the plan's recomputation as the ``activation_checkpoint`` policy, a tyro subcommand in 0.3.0
  (``activation_checkpoint:none`` or ``activation_checkpoint:full``; its default, selective
  activation checkpointing, crashes a zero-bubble schedule's split backward: "Trying to
  backward an extra time").  ``none`` where no stage recomputes, ``full`` where every stage
  does, and a comment naming the layers it covers: 0.3.0's ``FullAC`` wraps each decoder
  block (the items of ``layers``) of every model part, and nothing else, so a recomputing
  stage that also holds the embedding, the final norm or the head gets a note that those keep
  their activations, more memory than the plan counted.  0.3.0 applies one policy to every
  stage, so a plan that recomputes some stages only gets ``full`` and a note: the stages it
  kept pay a recomputation it did not predict.  ``full`` runs under a zero-bubble schedule
  (the suite trains a ZB-V step under it);
* with d > 1 data-parallel ranks, ``--parallelism.data_parallel_shard_degree d`` (FSDP2,
  ``shard``) or ``--parallelism.data_parallel_replicate_degree d`` (``replicate``), the other
  1 (``training.local_batch_size`` is then each rank's share); both given whenever d > 1 or
  t > 1, so that torchtitan checks p d t against the world size;
* with t > 1 tensor-parallel ranks, ``--parallelism.tensor_parallel_degree t`` and the plan's
  sequence parallelism as ``--parallelism.enable_sequence_parallel`` or
  ``--parallelism.no_enable_sequence_parallel`` (torchtitan's default is on).  torchtitan
  applies its own TP plan (projections column- then row-wise); 0.3.0 has no loss-parallel
  setting: its head is always split over the vocabulary and its cross-entropy loss-parallel.
  Its mesh is (pp, dp, tp), pipeline ranks outermost: a plan whose layout puts the replicas
  outermost, on several nodes, gets a note (:mod:`pipeplan.export.degrees`).

A transformers decoder (blocks in ``model.layers``) is named as 0.3.0's transformers backend
flattens it (``HFTransformerModel.named_children``): ``tok_embeddings``, ``layers.N``, ``norm``,
``lm_head`` and ``rotary_emb`` on every stage.  Its decoder calls ``self.layers[:n]`` on the
stage's layers, which a stage holding no layer (an emptied ``ModuleDict``) fails with
``TypeError: unhashable type: 'slice'``: such a plan gets a note, and ``plan --for torchtitan``
plans around it (:func:`pipeplan.export.snap.target_cuts`).  A weight tied across stages (a
tied head and embedding) gets a note too: 0.3.0 keeps a copy on each stage and never
synchronises them (its transformers backend even unties them for FSDP).
"""

from __future__ import annotations

import shlex
from typing import Final

from pipeplan.export.degrees import RankOrder
from pipeplan.export.layout import ModelLayout
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import Plan

__all__ = ["TORCHTITAN_VERSION", "check_torchtitan", "needs_layer_per_stage", "torchtitan_text"]

#: The release whose configuration the export is written for.
TORCHTITAN_VERSION: Final = "0.3.0"

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


def needs_layer_per_stage(layout: ModelLayout) -> bool:
    """Whether torchtitan runs this model through its transformers backend, whose stages must
    each hold a decoder layer."""
    return layout.wrapper == "model" and layout.container == "model.layers"


def check_torchtitan(layout: ModelLayout, names: list[list[str]]) -> None:
    """Raise unless torchtitan can keep every name: a direct child of the model or an item of
    a direct block list (after the transformers backend's flattening)."""
    if layout.wrapper and not needs_layer_per_stage(layout):
        raise InvalidRequestError(
            f"torchtitan: the block list {layout.container} is not a direct child of the model, "
            f"and torchtitan keeps only the model's direct children and the items of a direct "
            f"ModuleList (its transformers backend flattens Llama-like models only); "
            f"export --to deepspeed or fqns"
        )
    prefix = layout.wrapper + "." if layout.wrapper else ""
    for n in sorted({n.removeprefix(prefix) for ns in names for n in ns}):
        parts = n.split(".")
        if n != "lm_head" and (len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit())):
            raise InvalidRequestError(
                f"torchtitan: {n} is neither a direct child of the model nor an item of a "
                f"direct ModuleList, and torchtitan keeps only those; export --to deepspeed or "
                f"fqns"
            )


def torchtitan_text(
    layout: ModelLayout,
    stage_keys: list[list[str]],
    plan: Plan,
    order: RankOrder | None = "pp,dp,tp",
) -> tuple[str, list[list[str]], list[str]]:
    """The overrides line and its Python form, the names per stage, and notes (``order``: the
    plan's rank order, :func:`pipeplan.export.degrees.rank_order`)."""
    check_torchtitan(layout, stage_keys)
    prefix = layout.wrapper + "." if layout.wrapper else ""
    names = [[k.removeprefix(prefix) for k in ks] for ks in stage_keys]
    notes: list[str] = []
    if needs_layer_per_stage(layout):
        names = [[_TITAN_HF_NAMES.get(n, n) for n in ns] + ["rotary_emb"] for ns in names]
        empty = [j for j, ks in enumerate(stage_keys) if not any(layout.is_block(k) for k in ks)]
        if empty:
            notes.append(
                f"torchtitan: stage(s) {empty} hold no decoder layer, and torchtitan "
                f"{TORCHTITAN_VERSION}'s transformers backend fails on such a stage (TypeError: "
                f"unhashable type: 'slice'); plan again with --for torchtitan"
            )
    schedule = _TITAN_SCHEDULES[plan.schedule]
    settings: list[tuple[str, str, object]] = [
        ("parallelism", "pipeline_parallel_degree", len(names) // plan.stages_per_rank),
        ("parallelism", "pipeline_parallel_schedule", schedule),
        ("parallelism", "module_fqns_per_model_part", names),
        ("parallelism", "pipeline_parallel_microbatch_size", plan.microbatch_size),
        ("training", "local_batch_size", plan.batch_size),
        ("training", "disable_cuda_graphs", True),
    ]
    recompute = [j for j, stage in enumerate(plan.stages) if stage.recompute]
    full = bool(recompute)
    # FullAC wraps each item of the model part's ``layers``, nothing else (its ``apply``)
    blocks = [
        [n for k, n in zip(ks, ns) if layout.is_block(k)] for ks, ns in zip(stage_keys, names)
    ]
    kept = [
        f"{', '.join(n for k, n in zip(stage_keys[j], names[j]) if not layout.is_block(k))} "
        f"(stage {j})"
        for j in recompute
        if len(blocks[j]) < len(stage_keys[j])
    ]
    if kept:
        notes.append(
            f"torchtitan: {TORCHTITAN_VERSION}'s full activation checkpointing recomputes the "
            f"decoder blocks only; {'; '.join(kept)} keep their activations, which the plan "
            f"counted as recomputed (more memory than it predicts on those stages)"
        )
    if recompute and len(recompute) < len(plan.stages):
        notes.append(
            f"torchtitan: the plan recomputes stage(s) {recompute} only, but torchtitan "
            f"{TORCHTITAN_VERSION} applies one activation-checkpoint policy to every stage; "
            f"exported activation_checkpoint:full (the memory the plan needs; the other stages "
            f"run slower than it predicts)"
        )
    d, t = plan.cluster.data_parallel, plan.cluster.tensor_parallel
    if d > 1 or t > 1:  # FSDP2 over the d ranks (shard), or DDP-like replicas (replicate)
        shard = plan.cluster.data_parallel_mode == "shard"
        settings += [
            ("parallelism", "data_parallel_shard_degree", d if shard else 1),
            ("parallelism", "data_parallel_replicate_degree", 1 if shard else d),
        ]
    if t > 1:  # torchtitan's own TP plan; its head is always vocabulary-sharded (loss-parallel)
        settings += [
            ("parallelism", "tensor_parallel_degree", t),
            ("parallelism", "enable_sequence_parallel", plan.cluster.sequence_parallel),
        ]
        if needs_layer_per_stage(layout) and not plan.cluster.sequence_parallel:
            notes.append(
                f"torchtitan: {TORCHTITAN_VERSION}'s transformers backend shards the norms "
                f"sequence-parallel whenever t > 1 (it ignores enable_sequence_parallel), "
                f"which the plan did not price: less activation memory than planned, a "
                f"reduce-scatter and an all-gather for each all-reduce"
            )
    nodes = plan.cluster.devices_per_node
    if order is None or (
        order == "dp,pp,tp" and nodes is not None and plan.pipeline_ranks * d * t > nodes
    ):
        notes.append(
            f"torchtitan: places the ranks pipeline-outermost (mesh pp, dp, tp: replica r's "
            f"stage j on ranks (j d + r) t ..), not as the plan's layout "
            f"{[list(r) for r in plan.layout]}; across nodes its pipeline transfers and "
            f"data-parallel reductions cross other links than the plan priced"
        )
    args: list[str] = []
    for section, field, value in settings:
        args.append(f"--{section}.{'' if value is not False else 'no_'}{field}")
        if isinstance(value, list):
            args.extend(",".join(ns) for ns in value)
        elif not isinstance(value, bool):
            args.append(str(value))
    args.append(f"activation_checkpoint:{'full' if full else 'none'}")
    python = "\n".join(f"#   config.{s}.{f} = {v!r}" for s, f, v in settings)
    python += "\n#   config.activation_checkpoint = " + (
        "FullAC.Config()  # from torchtitan.distributed.activation_checkpoint import FullAC"
        if full
        else "None"
    )
    covers = ""
    if full:
        every = [n for ns in blocks for n in ns]
        covers = (
            f"# activation_checkpoint:full recomputes in the backward each decoder block of "
            f"every model part: {', '.join(every) or 'none (no stage holds one)'}\n"
        )
    text = (
        f"# torchtitan {TORCHTITAN_VERSION}: add to the launch's arguments after --module and "
        f"--config\n{shlex.join(args)}\n{covers}"
        f"# or set the same in your config function (a config_registry entry):\n{python}\n"
    )
    return text, names, notes
