"""The accuracy benchmark's own arithmetic: re-evaluating a plan with another profile."""

from __future__ import annotations

import pytest

from benchmarks.accuracy.main import _simulated
from planner.synthetic import synthetic_profile
from planner.types import Cluster, PlanOptions
from solvers.dp import solve_dp


def test_reevaluating_a_plan_with_its_own_profile_gives_its_prediction() -> None:
    prof = synthetic_profile(6, batch_size=8, seed=3)
    cluster = Cluster.homogeneous(2, 2**40)
    plan = solve_dp(prof, cluster, PlanOptions(microbatches=4, checkpoint="except_last"))
    assert _simulated(plan, prof, cluster) == pytest.approx(plan.simulated_step_time_s)


def test_reevaluating_with_a_slower_profile_scales_the_prediction() -> None:
    # A host twice as slow (every timing doubled, no link or engine cost) doubles the makespan.
    prof = synthetic_profile(6, batch_size=8, seed=3)
    slow = prof.model_copy(
        update={
            "units": tuple(
                u.model_copy(update={"timings": {
                    b: t.model_copy(update={
                        k: 2 * getattr(t, k)
                        for k in ("forward_s", "backward_s", "recompute_backward_s",
                                  "recompute_forward_s")
                        if getattr(t, k) is not None
                    })
                    for b, t in u.timings.items()
                }})
                for u in prof.units
            ),
            "loss": {},
        }
    )  # fmt: skip
    cluster = Cluster.homogeneous(2, 2**40)
    plan = solve_dp(prof.model_copy(update={"loss": {}}), cluster, PlanOptions(microbatches=2))
    assert _simulated(plan, slow, cluster) == pytest.approx(2 * plan.simulated_step_time_s)
