"""Which solver plans a request (``pipeplan.solvers.choose.solve``): ``schedule="auto"``, the
default, is never slower than any family, and a request no solver plans is refused."""

from __future__ import annotations

import pytest
from _solver_strategies import with_split

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.families import FAMILIES
from pipeplan.planner.types import Cluster, Link, PlanOptions, Profile
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers import SOLVERS
from pipeplan.solvers.choose import ONE_CHUNK, solve
from pipeplan.solvers.multichunk import solve_schedule


@pytest.fixture(scope="module")
def prof() -> Profile:
    return with_split(synthetic_profile(6, batch_size=8, microbatch_sizes=(2, 4), seed=3))


def _cluster(replicas: int = 1) -> Cluster:
    c = Cluster.homogeneous(2, 1 << 34, Link(bandwidth_Bps=1e9, latency_s=1e-5))
    return c.model_copy(update={"data_parallel": replicas})


def test_auto_is_the_fastest_of_every_family_and_optimal_where_every_one_was(
    prof: Profile,
) -> None:
    plan = solve(prof, _cluster(), PlanOptions(schedule="auto"))
    each = {f: solve_schedule(prof, _cluster(), PlanOptions(schedule=f)) for f in FAMILIES}
    for f in ONE_CHUNK:
        each[f] = SOLVERS["dp"](prof, _cluster(), PlanOptions(schedule=f))
    best = min(p.simulated_step_time_s for p in each.values())
    assert plan.simulated_step_time_s == pytest.approx(best, rel=1e-12)
    assert all(p.status == "optimal" for p in each.values())  # small: every one enumerated
    assert plan.status == "optimal"
    # what auto weighed travels with the winner, whichever solver's plan it is
    assert {w.family for w in plan.weighed} == set(FAMILIES)
    for w in plan.weighed:
        assert w.step_time_s is None or w.step_time_s >= best * (1 - 1e-12)


def test_families_restrict_auto(prof: Profile) -> None:
    plan = solve(prof, _cluster(), PlanOptions(schedule="auto", families=("1f1b",)))
    assert plan.schedule == "1f1b" and plan.solver == "dp"
    loop = solve(prof, _cluster(), PlanOptions(schedule="auto", families=("interleaved1f1b",)))
    assert loop.schedule == "interleaved1f1b" and loop.stages_per_rank == 2


@pytest.mark.parametrize("solver", ["cpsat", "uniform"])
def test_auto_with_a_one_chunk_solver_is_its_faster_of_gpipe_and_1f1b(
    prof: Profile, solver: str
) -> None:
    plan = solve(prof, _cluster(), PlanOptions(schedule="auto"), solver)
    both = [SOLVERS[solver](prof, _cluster(), PlanOptions(schedule=f)) for f in ONE_CHUNK]
    assert plan.schedule in ONE_CHUNK
    assert plan.simulated_step_time_s == min(p.simulated_step_time_s for p in both)


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_auto_with_replicas_weighs_every_family(prof: Profile, mode: str) -> None:
    """Replicas no longer confine auto to one chunk per rank: it returns the faster of the
    DP's one-chunk plan and the schedule solver's, both on the replicated (or sharded) axis."""
    clus = _cluster(replicas=2).model_copy(update={"data_parallel_mode": mode})
    plan = solve(prof, clus, PlanOptions(schedule="auto"))
    assert plan.cluster.data_parallel == 2 and plan.cluster.data_parallel_mode == mode
    sched = solve_schedule(prof, clus, PlanOptions(schedule="auto"))
    one = solve(prof, clus, PlanOptions(schedule="1f1b"))
    assert plan.simulated_step_time_s == pytest.approx(
        min(sched.simulated_step_time_s or sched.step_time_s, one.simulated_step_time_s or 0.0)
        if one.feasible
        else sched.simulated_step_time_s
    )


def test_a_multi_chunk_family_plans_with_replicas(prof: Profile) -> None:
    plan = solve(prof, _cluster(replicas=2), PlanOptions(schedule="zbv"))
    assert (plan.schedule, plan.stages_per_rank, plan.cluster.data_parallel) == ("zbv", 2, 2)


def test_a_multi_chunk_family_needs_the_schedule_solver(prof: Profile) -> None:
    with pytest.raises(InvalidRequestError, match="not with --solver cpsat"):
        solve(prof, _cluster(), PlanOptions(schedule="zbv"), "cpsat")
    with pytest.raises(InvalidRequestError, match="unknown"):
        solve(prof, _cluster(), PlanOptions(schedule="auto"), "nope")
    only = PlanOptions(schedule="auto", families=("zbv",))  # auto, but no one-chunk family
    with pytest.raises(InvalidRequestError, match="allows zbv, .* not --solver cpsat"):
        solve(prof, _cluster(), only, "cpsat")
    assert solve(prof, _cluster(), only, "dp").schedule == "zbv"
    with pytest.raises(InvalidRequestError, match="allows no schedule family"):
        solve(prof, _cluster(), PlanOptions(schedule="auto", families=()), "dp")


@pytest.mark.parametrize("solver", ["dp", "cpsat"])
def test_1f1b_is_never_planned_with_fewer_micro_batches_than_stages(solver: str) -> None:
    """torch's Schedule1F1B refuses m < p, so the solvers never choose it (m = 1 was the
    DP's pick here before), and a request for it is refused with the fix."""
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=(2, 8), seed=0)
    plan = SOLVERS[solver](prof, _cluster(), PlanOptions(schedule="1f1b"))
    assert plan.microbatches >= 2
    with pytest.raises(InvalidRequestError, match="1F1B needs at least as many micro-batches"):
        SOLVERS[solver](prof, _cluster(), PlanOptions(schedule="1f1b", microbatches=1))
