"""The baselines do what their namesakes do, and never beat the exact DP."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.planner.errors import UnsupportedConstraintError
from pipeplan.planner.types import Cluster, Link, PlanOptions
from pipeplan.planner.unitcosts import unit_costs
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers import SOLVERS
from pipeplan.solvers.baselines import (
    baseline_microbatches,
    block_partition,
    minmax_partition,
    solve_params,
    solve_torchgpipe,
    solve_uniform,
    uniform_partition,
)
from pipeplan.solvers.dp import partition_dp, solve_dp
from pipeplan.solvers.request import resolve_request

BASELINES = ("uniform", "params", "torchgpipe")


def blocks(seq: list[float], starts: list[int]) -> list[float]:
    ends = [*starts[1:], len(seq)]
    return [sum(seq[a:b]) for a, b in zip(starts, ends)]


def brute_minmax(seq: list[float], p: int) -> float:
    n = len(seq)
    return min(max(blocks(seq, [0, *cuts])) for cuts in itertools.combinations(range(1, n), p - 1))


@given(st.integers(1, 50), st.integers(1, 50))
def test_uniform_sizes_differ_by_at_most_one(n: int, p: int) -> None:
    p = min(p, n)
    starts = uniform_partition(n, p)
    sizes = [b - a for a, b in zip(starts, [*starts[1:], n])]
    assert starts[0] == 0 and len(sizes) == p and sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


sequences = st.lists(st.integers(0, 100), min_size=1, max_size=9)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(sequences, st.integers(1, 9))
def test_minmax_partition_is_optimal(seq: list[int], p: int) -> None:
    p = min(p, len(seq))
    starts = minmax_partition(seq, p)
    assert len(starts) == p and starts == sorted(set(starts)) and starts[-1] < len(seq)
    assert max(blocks(seq, starts)) == brute_minmax(seq, p)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.floats(0.01, 10.0), min_size=1, max_size=9), st.integers(1, 9))
def test_block_partition_meets_barany_grinberg_bound(seq: list[float], p: int) -> None:
    """Normalised to [0, 1], the largest block is at most the brute-force min-max plus one."""
    p = min(p, len(seq))
    starts = block_partition(seq, p)
    assert len(starts) == p and starts == sorted(set(starts)) and starts[-1] < len(seq)
    lo, span = min(seq), max(seq) - min(seq)
    norm = [0.0] * len(seq) if span == 0 else [(v - lo) / span for v in seq]
    assert max(blocks(norm, starts)) <= brute_minmax(norm, p) + 1 + 1e-9


def test_block_partition_examples() -> None:
    # Equal weights: torchgpipe's equal-count start is already balanced.
    assert block_partition([1.0] * 8, 4) == [0, 2, 4, 6]
    # Normalising by (x - min) / (max - min) makes the light units weigh 0, so the equal-count
    # start already meets M <= m + 1: torchgpipe keeps it, though [0, 7] is balanced.
    assert block_partition([1, 1, 1, 1, 1, 1, 1, 9], 2) == [0, 4]
    assert block_partition([0, 0, 0, 0, 4, 4, 4, 4], 2) == [0, 6]
    with pytest.raises(ValueError, match="non-empty"):
        block_partition([1.0, 2.0], 3)


def test_params_baseline_balances_parameters() -> None:
    prof = synthetic_profile(9, batch_size=8, seed=4)
    plan = solve_params(prof, Cluster.homogeneous(3, 2**40))
    w = [u.param_bytes for u in prof.units]
    assert max(s.memory.params for s in plan.stages) == brute_minmax(w, 3)
    assert plan.solver == "params" and plan.status == "heuristic"


def test_torchgpipe_baseline_balances_times() -> None:
    prof = synthetic_profile(9, batch_size=8, seed=4, spread=1.0)
    plan = solve_torchgpipe(prof, Cluster.homogeneous(3, 2**40))
    c = unit_costs(prof, plan.microbatches)
    assert list(plan.boundaries) == block_partition(list(c.f + c.g), 3)[1:]


def test_uniform_baseline() -> None:
    prof = synthetic_profile(10, batch_size=8)
    plan = solve_uniform(prof, Cluster.homogeneous(4, 2**40))
    assert [len(s.unit_names) for s in plan.stages] == [3, 3, 2, 2]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.integers(2, 14),
    st.integers(0, 10**6),
    st.sampled_from([2**40, 2**24]),
    st.sampled_from(["always", "except_last", "never"]),
)
def test_baselines_never_beat_the_dp(n: int, seed: int, memory: int, policy: str) -> None:
    prof = synthetic_profile(n, batch_size=8, seed=seed, heavy_ends=True)
    clus = Cluster.homogeneous(min(n, 3), memory, Link(bandwidth_Bps=1e9))
    options = PlanOptions(checkpoint=policy)  # type: ignore[arg-type]
    found = partition_dp(prof, clus, options)
    for name in BASELINES:
        plan = SOLVERS[name](prof, clus, options)
        assert plan.solver == name
        assert plan.status == ("heuristic" if plan.feasible else "infeasible")
        if found is not None:
            assert plan.microbatches == found[1]
            if plan.feasible:
                assert plan.step_time_s >= found[2] * (1 - 1e-12)
        else:
            assert plan.microbatches == max(prof.batch_size // b for b in prof.microbatch_sizes)
            assert not plan.feasible


def test_infeasible_baselines_are_marked_not_raised() -> None:
    prof = synthetic_profile(12, batch_size=8)
    clus = Cluster.homogeneous(3, 2**16)
    for name in BASELINES:
        plan = SOLVERS[name](prof, clus, PlanOptions())
        assert not plan.feasible and plan.status == "infeasible"
        assert any(not s.feasible for s in plan.stages)


def test_microbatches_follow_the_user_then_the_dp() -> None:
    prof = synthetic_profile(12, batch_size=16)
    clus = Cluster.homogeneous(3, 2**40)
    user, auto = (resolve_request(prof, clus, PlanOptions(microbatches=m)) for m in (2, None))
    assert baseline_microbatches(user) == 2
    assert baseline_microbatches(auto) == solve_dp(prof, clus).microbatches
    assert solve_uniform(prof, clus, PlanOptions(microbatches=4)).microbatches == 4


def test_baselines_refuse_pins_and_unit_bounds() -> None:
    prof = synthetic_profile(6, batch_size=8)
    for name in BASELINES:
        with pytest.raises(UnsupportedConstraintError, match="cpsat"):
            SOLVERS[name](prof, Cluster.homogeneous(2, 2**40), PlanOptions(pinned={0: 0}))
