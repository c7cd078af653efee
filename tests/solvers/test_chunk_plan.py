"""A chunk partition and its replay as a Plan: the record both schedule solvers return."""

from __future__ import annotations

import pytest

from pipeplan.planner.families import rank_of_stage
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.chunk_plan import chunk_plan
from pipeplan.solvers.chunks import ChunkPlan
from pipeplan.solvers.request import ResolvedRequest


@pytest.mark.parametrize("family", ["interleaved1f1b", "loopedbfs"])
@pytest.mark.parametrize("memory", [1 << 40, None])
def test_the_plan_is_its_replay_and_its_chunks(family: str, memory: int | None) -> None:
    profile = synthetic_profile(8, batch_size=8, microbatch_sizes=[2], seed=5)
    options = PlanOptions(schedule=family, checkpoint="never", microbatches=4)
    big = Cluster.homogeneous(2, 1 << 40)
    cp = ChunkPlan(ResolvedRequest(profile, big, options), family, 2, 4)
    starts, rc = [0, 2, 5, 6], [False] * 4
    rep = cp.replay(starts, rc)
    if memory is None:  # a device just under rank 0's peak: its chunks do not fit
        cluster = Cluster.homogeneous(2, int(rep.peak_bytes[0]) - 1)
        cp = ChunkPlan(ResolvedRequest(profile, cluster, options), family, 2, 4)
        rep = cp.replay(starts, rc)
    plan = chunk_plan(cp, starts, rc, rep, solver="schedules", status="feasible", gap=0.5,
                      bound=1.0, solve_time_s=0.0)  # fmt: skip
    assert plan.simulated_step_time_s == plan.step_time_s == rep.makespan_s
    assert plan.rank_peak_bytes == rep.peak_bytes and plan.bubble_fraction == rep.bubble_fraction
    assert [(s.first_unit, s.last_unit) for s in plan.stages] == [(0, 1), (2, 4), (5, 5), (6, 7)]
    owner = rank_of_stage(family, 2, 2)
    assert [s.device for s in plan.stages] == [cp.cluster.devices[q].name for q in owner]
    for s, q in zip(plan.stages, owner, strict=True):
        parts = s.memory.model_dump(exclude={"total"})
        assert s.memory.total == sum(parts.values())
        assert s.feasible == (rep.peak_bytes[q] <= cp.cluster.devices[q].memory_bytes)
    assert all(s.feasible for s in plan.stages) == (memory is not None)
    assert (plan.schedule, plan.stages_per_rank, plan.microbatches) == (family, 2, 4)
    assert (plan.status, plan.gap, plan.lower_bound_s) == ("feasible", 0.5, 1.0)
