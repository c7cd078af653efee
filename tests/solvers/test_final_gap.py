"""The schedule solver's final gap: raised bounds change the status and the gap, never the plan."""

from __future__ import annotations

import pytest
from _solver_strategies import with_split

from pipeplan.planner.types import Cluster, Link, PlanOptions
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers import multichunk
from pipeplan.solvers.final_gap import raise_bounds
from pipeplan.solvers.schedule_bounds import family_bound


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "zbv", "auto"])
def test_the_plan_is_the_searchs_and_its_gap_only_shrinks(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same request with the final gap's bounds and without (``raise_bounds`` as the
    identity): the same cuts, flags, m and step; a gap no wider."""
    prof = with_split(synthetic_profile(12, batch_size=8, microbatch_sizes=[1, 2], seed=4,
                                        heavy_ends=True, loss=True))  # fmt: skip
    cluster = Cluster.homogeneous(3, 2**50, Link(bandwidth_Bps=1e8, latency_s=1e-4))
    options = PlanOptions(schedule=schedule)  # type: ignore[arg-type]
    raised = multichunk.solve_schedule(prof, cluster, options, exhaustive_limit=0)
    monkeypatch.setattr(multichunk, "raise_bounds", lambda *a, **k: dict(a[3]))
    plain = multichunk.solve_schedule(prof, cluster, options, exhaustive_limit=0)
    assert [(s.first_unit, s.recompute) for s in raised.stages] == [
        (s.first_unit, s.recompute) for s in plain.stages
    ]
    assert (raised.schedule, raised.microbatches) == (plain.schedule, plain.microbatches)
    assert raised.step_time_s == plain.step_time_s
    assert (raised.gap or 0.0) <= (plain.gap or 0.0) + 1e-12
    assert raised.lower_bound_s >= plain.lower_bound_s
    if schedule == "interleaved1f1b":  # the chains close a gap the averaged work bound left
        assert (plain.gap or 0.0) > 0.2 and (raised.gap or 0.0) < 0.05


def test_no_effort_raises_nothing() -> None:
    prof = synthetic_profile(9, batch_size=8, microbatch_sizes=[2], seed=3, heavy_ends=True)
    cluster = Cluster.homogeneous(3, 2**50)
    options = PlanOptions(schedule="interleaved1f1b")
    c = ("interleaved1f1b", 2, 4)
    floor = family_bound(prof, cluster, options, *c)
    assert raise_bounds(prof, cluster, options, {c: floor}, {c: None}, 1.0, effort=0.0) == {
        c: floor
    }
    raised = raise_bounds(prof, cluster, options, {c: floor}, {c: None}, 1.0)
    assert raised[c] > floor


def test_a_search_over_devices_leaves_it_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning every depth of ``--devices`` solves many requests: none raises its bounds (it
    took benchmarks/mesh's search from 19 to 34 CPU s), while one request does."""
    from pipeplan import api

    calls: list[int] = []
    original = multichunk.raise_bounds

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(multichunk, "raise_bounds", counted)
    prof = with_split(synthetic_profile(12, batch_size=8, microbatch_sizes=[1, 2], seed=4))
    cluster = Cluster.homogeneous(1, 2**50)
    request = api.plan_request(prof, devices=4, cluster=cluster, calibrated=False)
    assert request.best(request.frontier()) is not None and calls == []
    multichunk.solve_schedule(prof, Cluster.homogeneous(2, 2**50), PlanOptions())
    assert calls == [1]
