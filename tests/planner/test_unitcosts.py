"""pipeplan.planner.unitcosts: each profile's tables are built once and read by every solve."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from pipeplan.planner import unitcosts
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.planner.unitcosts import microbatch_choices, tables, unit_costs
from pipeplan.planner.updates import update_cost
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers import SOLVERS
from pipeplan.solvers.devices import plan_devices


@pytest.mark.parametrize("solver", ["dp", "cpsat", "uniform"])
def test_a_solve_builds_each_tables_once(solver: str) -> None:
    prof = synthetic_profile(24, batch_size=16, seed=3)
    cluster = Cluster.homogeneous(4, 1 << 40)
    options = PlanOptions(optimizer="adam", time_limit_s=10)
    plan = SOLVERS[solver](prof, cluster, options)
    built = tables(prof).builds
    # every micro-batch count the solve looked at, once (evaluate, the bounds and the request
    # check read the same tables as the solver)
    assert 1 <= built <= len(microbatch_choices(prof, options))
    SOLVERS[solver](prof, cluster, options)
    plan_devices(prof, 4, cluster.model_copy(update={"devices": cluster.devices[:1]}), options,
                 SOLVERS["dp"])  # fmt: skip
    assert tables(prof).builds == len(microbatch_choices(prof, options))  # nothing rebuilt
    assert unit_costs(prof, plan.microbatches) is unit_costs(prof, plan.microbatches)
    assert update_cost(prof, "adam") is update_cost(prof, "adam")


def test_the_tables_are_read_only_and_go_with_their_profile() -> None:
    prof = synthetic_profile(8, batch_size=4, seed=1)
    c = unit_costs(prof, 2)
    with pytest.raises(ValueError, match="read-only"):
        c.f[0] = 1.0
    assert np.array_equal(c.Pf, np.concatenate([[0.0], np.cumsum(c.f)]))
    key = id(prof)
    assert key in unitcosts._TABLES
    del prof, c
    gc.collect()
    assert key not in unitcosts._TABLES


def test_an_equal_profile_gets_tables_of_its_own() -> None:
    a = synthetic_profile(8, batch_size=4, seed=1)
    b = a.model_copy()
    assert unit_costs(a, 2) is not unit_costs(b, 2)
    assert np.array_equal(unit_costs(a, 2).Pg, unit_costs(b, 2).Pg)
