"""Megatron-LM: ``E`` (every unit before the first block), one ``t`` per block, ``L`` (every
unit after the last block) as the ``--pipeline-model-parallel-layout`` string, and the
``--decoder-first/last-pipeline-num-layers`` pair when the middle stages hold equal counts, in a
comment: Megatron refuses the two together ("cannot be set with other pipeline layout
arguments"), so the file's one command line is the layout's.  Each line ends in the batch
arguments and, for a plan with t > 1, ``--tensor-model-parallel-size t`` and
``--sequence-parallel`` where the plan has it (megatron-core's ``TransformerConfig`` checks t
against the attention heads and query groups); ``--use-tp-pp-dp-mapping`` where the plan's
layout puts the replicas outermost (:mod:`pipeplan.export.degrees`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

from pipeplan.export.degrees import RankOrder
from pipeplan.planner.types import Plan

__all__ = ["megatron_batch_args", "megatron_layout", "megatron_mesh_args", "megatron_text"]


def megatron_layout(counts: Sequence[tuple[bool, int, bool]]) -> str:
    """The layout string of stages holding (embedding?, decoder layers, loss?).

    >>> megatron_layout([(True, 3, False), (False, 3, False), (False, 2, True)])
    'Et*3|t*3|t*2L'
    """
    stages = []
    for emb, t, loss in counts:
        body = "t" * t if t < 2 else f"t*{t}"
        stages.append(("E" if emb else "") + body + ("L" if loss else ""))
    return "|".join(stages)


def _pair_counts(layers: Sequence[int]) -> list[list[int]]:
    """The layers per stage ``--decoder-first/last-pipeline-num-layers`` can give (first and
    last > 0, the middle stages equal and > 0) that move the plan's cuts least, in layers."""
    p, n = len(layers), sum(layers)
    want = list(accumulate(layers))[:-1]
    best: int | None = None
    out: list[list[int]] = []
    for first in range(1, n):
        for mid in range(1, n) if p > 2 else [0]:
            last = n - first - (p - 2) * mid
            if last < 1:
                break
            counts = [first, *[mid] * (p - 2), last]
            moved = sum(abs(a - b) for a, b in zip(accumulate(counts), want))
            if best is None or moved < best:
                best, out = moved, [counts]
            elif moved == best:
                out.append(counts)
    return out


def megatron_text(
    stage_keys: list[list[str]],
    block_starts: Sequence[int],
    price: Callable[[list[int]], Plan] | None,
    planned_s: float,
    virtual: int = 1,
) -> tuple[str, list[str]]:
    """The layout line, the first/last line when it says the same, and a note when it cannot:
    the closest first/last counts, priced when ``price`` is given (``block_starts``: the unit
    each block starts at).  With ``virtual`` v > 1 chunks per rank the layout lists all p v
    chunks and the size is p: Megatron's virtual pipeline size is then v."""
    last = len(stage_keys) - 1
    counts = [
        (j == 0, sum(k not in ("E", "L") for k in ks), j == last) for j, ks in enumerate(stage_keys)
    ]
    p = len(counts)
    layers = [t for _, t, _ in counts]
    size = f"--pipeline-model-parallel-size {p // virtual} --num-layers {sum(layers)}"
    lines = [f"{size} --pipeline-model-parallel-layout '{megatron_layout(counts)}'"]
    if virtual > 1:  # Megatron reads v from the layout: len(stages) / pipeline size
        note = (
            f"megatron: the layout lists the plan's {p} chunks, {virtual} per rank in a loop, "
            f"which sets Megatron's virtual pipeline size to {virtual} (its interleaved schedule)"
        )
        return lines[0] + "\n", [note]
    if p == 1:
        return lines[0] + "\n", []
    middle = layers[1:-1]
    if min(layers) > 0 and len(set(middle)) <= 1:
        lines.append(
            f"# or, replacing the line above (Megatron refuses the layout with these): {size} "
            f"--decoder-first-pipeline-num-layers {layers[0]} "
            f"--decoder-last-pipeline-num-layers {layers[-1]}"
        )
        return "\n".join(lines) + "\n", []
    why = (
        f"a stage holds no decoder layer ({layers})"
        if min(layers) == 0
        else f"the middle stages hold different counts ({middle})"
    )
    note = f"megatron: --decoder-first/last-pipeline-num-layers cannot express this plan: {why}"
    options = _pair_counts(layers)
    if not options:
        return lines[0] + "\n", [f"{note}, and there are fewer layers than stages"]
    choice, cost = options[0], ""
    if price is not None:
        priced = []
        for option in options:
            cuts = [block_starts[c] for c in list(accumulate(option))[:-1]]
            priced.append((price(cuts).step_time_s, option))
        step, choice = min(priced)
        change = (step / planned_s - 1) * 100 if planned_s > 0 else 0.0
        cost = (
            f": predicted step {step * 1e3:.4g} ms vs {planned_s * 1e3:.4g} ms planned "
            f"({change:+.1f}%)"
        )
    else:
        cost = " (give --profile to price it)"
    note += (
        f"; the closest they can is --decoder-first-pipeline-num-layers {choice[0]} "
        f"--decoder-last-pipeline-num-layers {choice[-1]} ({choice} layers per stage){cost}; "
        f"the layout above is the plan itself"
    )
    return lines[0] + "\n", [note]


def megatron_batch_args(plan: Plan) -> str:
    """The batch and data-parallel arguments each command line gets:
    ``--micro-batch-size b --global-batch-size B`` (B over every data-parallel rank; Megatron
    derives m = B / (b d), and d from the world size: launch p d t ranks), then
    ``--use-distributed-optimizer`` (ZeRO-1: optimizer states sharded over the d ranks) for a
    ``shard`` plan, whose memory the plan's model bounds from above (it also counts a 1 / d
    shard of the parameters beside the whole copy)."""
    d = plan.cluster.data_parallel
    args = f"--micro-batch-size {plan.microbatch_size} --global-batch-size {plan.batch_size * d}"
    if d > 1 and plan.cluster.data_parallel_mode == "shard":
        args += " --use-distributed-optimizer"
    return args


def megatron_mesh_args(plan: Plan, order: RankOrder | None) -> tuple[str, list[str]]:
    """The tensor-parallel arguments and the rank order, and a note where Megatron cannot
    place the ranks as the plan does: ``--tensor-model-parallel-size t`` and, with the plan's
    sequence parallelism, ``--sequence-parallel`` (megatron-core refuses it without t > 1)
    when t > 1; ``--use-tp-pp-dp-mapping`` (order ``tp-cp-ep-pp-dp``: replicas outermost, as
    ``Plan.layout``) where ``order`` (:func:`pipeplan.export.degrees.rank_order`) is
    ``"dp,pp,tp"``; Megatron's default ``tp-cp-ep-dp-pp`` is ``"pp,dp,tp"``.

    >>> from pipeplan.planner.types import Cluster
    >>> c = Cluster.homogeneous(2, 2**30).model_copy(
    ...     update={"tensor_parallel": 2, "sequence_parallel": True})
    >>> megatron_mesh_args(Plan.model_construct(cluster=c), "pp,dp,tp")
    ('--tensor-model-parallel-size 2 --sequence-parallel', [])
    """
    t = plan.cluster.tensor_parallel
    args = []
    if t > 1:
        args.append(f"--tensor-model-parallel-size {t}")
        if plan.cluster.sequence_parallel:
            args.append("--sequence-parallel")
    notes = []
    if order == "dp,pp,tp":
        args.append("--use-tp-pp-dp-mapping")
    elif order is None:
        notes.append(
            f"megatron: the plan's layout {[list(r) for r in plan.layout]} is neither of "
            f"Megatron's rank orders (tp-cp-ep-dp-pp, or tp-cp-ep-pp-dp with "
            f"--use-tp-pp-dp-mapping); it places the ranks by its default"
        )
    return " ".join(args), notes
