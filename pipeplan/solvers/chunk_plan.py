"""A schedule solver's answer as a :class:`~pipeplan.planner.types.Plan`: the stages of a
chunk partition (times, memory at their peaks) and its replay's step, as the local search
(:mod:`pipeplan.solvers.multichunk`) and the exact model (:mod:`pipeplan.solvers.exact_plan`)
both return it."""

from __future__ import annotations

from pipeplan.planner.costmodel import stage_params, tied_syncs
from pipeplan.planner.evaluate import profile_fields, stage_record
from pipeplan.planner.families import action_order
from pipeplan.planner.replay import Replay
from pipeplan.planner.types import MemoryBreakdown, Plan
from pipeplan.solvers.chunks import ChunkPlan

__all__ = ["chunk_plan"]


def chunk_plan(
    cp: ChunkPlan,
    starts: list[int],
    rc: list[bool],
    rep: Replay,
    *,
    solver: str,
    status: str,
    gap: float | None,
    bound: float,
    solve_time_s: float,
) -> Plan:
    """The plan of these cuts and flags, ``rep`` their replay (what the schedule solvers
    return: the stages' times and memory at their peaks, the replay's step)."""
    profile, cluster, m = cp.profile, cp.cluster, cp.m
    costs = cp.costs_of(starts, rc)
    n, k = profile.n_units, len(starts)
    order = action_order(cp.family, cp.p, cp.v, m)
    flight = [0] * k
    live = [0] * k
    for acts in order:
        for a in acts:
            live[a.stage] += 1 if a.kind == "F" else (-1 if a.kind in "BW" else 0)
            flight[a.stage] = max(flight[a.stage], live[a.stage])
    state = cp.state
    stages = []
    for s, l in enumerate(starts):
        r = (starts[s + 1] if s + 1 < k else n) - 1
        q = cp.owner[s]
        dev = cluster.devices[q]
        params = int(stage_params(cp.costs, l, r))
        parts = {
            "params": int(state.params * params),
            "grads": int(state.grads * params),
            "optimizer": int(state.optimizer * params),
            "stashed_inputs": int(m * cp.costs.x[l]),
            "gradient_buffers": int(m * cp.costs.x[r + 1]),
            "activations": flight[s] * costs.held_bytes[s],
            "transient": costs.transient_bytes[s],
        }
        times = (costs.forward_s[s], costs.backward_s[s], costs.comm_s[s])
        split = (
            (costs.backward_input_s[s], costs.backward_weight_s[s])
            if costs.backward_input_s and costs.backward_weight_s
            else None
        )
        memory = MemoryBreakdown(**parts, total=sum(parts.values()))
        stages.append(
            stage_record(
                profile,
                s,
                dev,
                l,
                r,
                rc[s],
                times,
                costs.update_s[s],
                memory,
                rep.peak_bytes[q],
                split,
            )
        )
    shared = [(sp.bytes, sp.units) for sp in profile.shared_params]
    T = rep.makespan_s
    return Plan(
        **profile_fields(profile, m),
        schedule=cp.family,  # type: ignore[arg-type]
        stages_per_rank=cp.v,
        rank_peak_bytes=rep.peak_bytes,
        checkpoint=cp.options.checkpoint,
        optimizer=cp.options.optimizer,
        cluster=cluster,
        stages=tuple(stages),
        tied_syncs=tuple(tied_syncs(shared, cluster, starts)),
        step_time_s=T,
        simulated_step_time_s=T,
        bubble_fraction=rep.bubble_fraction,
        throughput=profile.batch_size / T if T > 0 else 0.0,
        feasible=True,
        solver=solver,
        status=status,  # type: ignore[arg-type]
        gap=gap,
        lower_bound_s=bound,
        solve_time_s=solve_time_s,
    )
