"""The plan's parallel degrees as each target takes them: p pipeline ranks x d data-parallel
replicas x t tensor-parallel ranks = the world, the degree t checked against the dimensions
it splits, and the order in which the target places the ranks.

Rank order.  ``Plan.layout`` puts replica r's pipeline rank j on ranks (r p + j) t ..
(r p + j) t + t - 1 (mesh (dp, pp, tp), replicas outermost).  torchtitan's mesh is
(pp, dp_replicate, dp_shard, cp, tp), pipeline ranks outermost: (j d + r) t; Megatron's
default order ``tp-cp-ep-dp-pp`` is the same, and ``--use-tp-pp-dp-mapping`` switches it to
``tp-cp-ep-pp-dp``, the plan's.  The two coincide when d = 1 or p = 1; t is innermost in all,
so a tensor-parallel group is t consecutive ranks in every target.

Tensor parallelism per target: torchtitan applies its own TP plan (``tensor_parallel_degree``);
Megatron-LM its own (``--tensor-model-parallel-size``); DeepSpeed 0.19's ``PipelineEngine``
has none of its own (its topology's ``model`` axis only groups ranks for layers that are split
already, as Megatron-DeepSpeed's are; its AutoTP builds a (dp, tp) mesh with no pipeline axis),
so a plan with t > 1 is refused there; ``fqns`` lists modules and leaves the split to the user.
"""

from __future__ import annotations

from typing import Final, Literal

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import Plan, Profile

__all__ = ["RankOrder", "check_tensor_parallel", "rank_order"]

RankOrder = Literal["dp,pp,tp", "pp,dp,tp"]
"""Mesh dimensions outermost first."""

_DEEPSPEED_TP: Final = (
    "deepspeed: its PipelineEngine has no tensor parallelism of its own (DeepSpeed 0.19's "
    "AutoTP builds a (dp, tp) mesh without a pipeline axis, and PipelineModule's 'model' axis "
    "needs layers that are split already, as Megatron-DeepSpeed's)"
)


def rank_order(plan: Plan) -> RankOrder | None:
    """How ``plan.layout`` orders the ranks: ``"dp,pp,tp"`` (replicas outermost, (r p + j) t)
    where that differs from ``"pp,dp,tp"`` ((j d + r) t); ``"pp,dp,tp"`` where the layout is
    that, where the two coincide (d = 1 or p = 1) or where the plan has no layout; ``None``
    for a layout that is neither.

    >>> from pipeplan.planner.types import Plan
    >>> rank_order(Plan.model_construct(stages=(), layout=()))
    'pp,dp,tp'
    """
    if not plan.layout:
        return "pp,dp,tp"
    p, d = len(plan.layout[0]), len(plan.layout)
    t = plan.cluster.tensor_parallel
    first = [list(row) for row in plan.layout]
    pp_outer = first == [[(j * d + r) * t for j in range(p)] for r in range(d)]
    if pp_outer:
        return "pp,dp,tp"
    dp_outer = first == [[(r * p + j) * t for j in range(p)] for r in range(d)]
    return "dp,pp,tp" if dp_outer else None


def check_tensor_parallel(plan: Plan, target: str, profile: Profile | None) -> list[str]:
    """Raise :class:`InvalidRequestError` when ``target`` cannot take the plan's t: DeepSpeed
    for any t > 1; any target when the profile (where given) has no splittable unit in the plan
    or a unit whose dimension (heads, key-value heads, hidden size) t does not divide.  Returns
    notes for what the target takes differently from the plan."""
    t = plan.cluster.tensor_parallel
    if t == 1:
        return []
    if target == "deepspeed":
        raise InvalidRequestError(
            f"{_DEEPSPEED_TP}, so it cannot run the plan's tensor-parallel degree {t}; export "
            f"--to megatron or torchtitan, or plan with tensor parallelism 1"
        )
    if profile is not None:
        split = [
            (u.name, u.tensor_parallel)
            for s in plan.stages
            for u in profile.units[s.first_unit : s.last_unit + 1]
            if u.tensor_parallel is not None
        ]
        if not split:
            raise InvalidRequestError(
                f"{target}: the plan splits its stages over {t} tensor-parallel ranks, but the "
                f"profile finds no block to split; plan with tensor parallelism 1"
            )
        for name, how in split:
            for dim, size in how.divisors.items():
                if size % t:
                    raise InvalidRequestError(
                        f"{target}: the plan's tensor-parallel degree {t} does not divide "
                        f"{name}'s {dim} ({size}); plan again with a degree dividing {size}"
                    )
    if target == "fqns":
        note = (
            f"fqns: lists each stage's modules only; the plan splits their blocks over {t} "
            f"tensor-parallel ranks, which your loop applies (the profile's per-unit "
            f"tensor_parallel.styles, with torch's parallelize_module)"
        )
        return [note]
    return []
