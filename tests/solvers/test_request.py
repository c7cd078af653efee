"""pipeplan.solvers.request: a request checked once and its tables built once, on first use."""

from __future__ import annotations

import numpy as np
import pytest

from pipeplan.planner.collectives import state_factors
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.evaluate import allowed_starts
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.planner.unitcosts import microbatch_choices
from pipeplan.planner.updates import update_cost
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.request import ResolvedRequest, resolve_request


def test_the_tables_are_the_ones_each_solver_built_and_are_built_once() -> None:
    prof = synthetic_profile(6, batch_size=8, seed=2)
    cluster = Cluster.homogeneous(3, 2**30)
    options = PlanOptions(schedule="1f1b", allowed_cuts=(2, 3, 4))
    req = resolve_request(prof, cluster, options)
    assert req.microbatches == microbatch_choices(prof, options, 3)
    assert req.update == update_cost(prof, options.optimizer, cluster)
    assert req.state == state_factors(options.optimizer, cluster)
    assert np.array_equal(req.allowed, allowed_starts(options, prof.n_units))
    assert req.caps.tolist() == [float(2**30)] * 3
    assert req.allowed is req.allowed and req.caps is req.caps and req.update is req.update
    with pytest.raises(ValueError, match="read-only"):
        req.allowed[0] = False


def test_resolving_checks_the_request_and_a_table_raises_only_when_read() -> None:
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[4], seed=2)
    cluster = Cluster.homogeneous(3, 2**30)
    with pytest.raises(InvalidRequestError, match="stages but the profile has only"):
        resolve_request(prof, Cluster.homogeneous(7, 2**30), PlanOptions())
    req = resolve_request(prof, cluster, PlanOptions(schedule="1f1b"))  # m = 2 < p = 3
    with pytest.raises(InvalidRequestError, match="1F1B needs at least as many"):
        _ = req.microbatches
    assert ResolvedRequest(prof, cluster, PlanOptions()).microbatches == [2]
