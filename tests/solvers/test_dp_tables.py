"""The DP's tables: the drain's bound on the earlier cuts' trips, and the relaxation it makes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.planner.types import Cluster, Device, Link, PlanOptions, Profile
from pipeplan.planner.unitcosts import unit_costs
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.dp_tables import Instance, longest_sums
from pipeplan.solvers.request import ResolvedRequest


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=12),
    st.integers(0, 6),
)
def test_longest_sums_match_sorting(comm: list[float], k_max: int) -> None:
    table = longest_sums(np.array(comm), k_max)
    assert table.shape == (len(comm), k_max + 1)
    for l in range(len(comm)):
        before = sorted(comm[1:l], reverse=True)
        for k in range(k_max + 1):
            assert table[l, k] == pytest.approx(sum(before[:k]), abs=1e-12)


def _instance(prof: Profile, cluster: Cluster, options: PlanOptions, m: int) -> Instance:
    return Instance(ResolvedRequest(prof, cluster, options), unit_costs(prof, m))


@pytest.mark.parametrize("seed", range(6))
def test_relaxed_objective_bounds_every_partition(seed: int) -> None:
    # One cut's trip dwarfs the others (a wide activation on a slow link).  The relaxed
    # objective the DP minimises must stay below the true step time of every partition, and
    # reach it where the longest trips before each stage are the plan's own cuts.
    n, p = 7, 4
    prof = synthetic_profile(n, batch_size=8, seed=seed, spread=1.5, update_s_per_byte=3e-8)
    cluster = Cluster(
        devices=tuple(Device(name=f"d{j}", memory_bytes=10**12) for j in range(p)),
        link=Link(bandwidth_Bps=3e7, latency_s=1e-4),
    )
    options = PlanOptions.model_validate({"checkpoint": "never", "optimizer": "adam"})
    inst = _instance(prof, cluster, options, m=2)
    assert not inst.exact
    met = 0
    for cuts in itertools.combinations(range(1, n), p - 1):
        starts = (0, *cuts)
        relaxed, true = inst.relaxed(starts), inst.step_time(starts)
        assert relaxed <= true * (1 + 1e-12)
        # Stage j >= 2 starts at cuts[j - 1]; its drain is exact when the cuts before it carry
        # the j - 1 longest trips before that unit.
        if all(
            sum(inst.comm[list(cuts[: j - 1])])
            == pytest.approx(sum(sorted(inst.comm[1 : cuts[j - 1]], reverse=True)[: j - 1]))
            for j in range(2, p)
        ):
            assert relaxed == pytest.approx(true, rel=1e-12)
            met += 1
    assert met  # the equality case occurs (the first cuts at the longest trips)
