"""The optimizer update's cost curve (the fit, the fallback, the solvers that use it) and the
updates' tail when updates share the host, against the step simulator."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _one_chunk import one_chunk
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipeplan.planner.costmodel import step_time
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.types import Cluster, PlanOptions, Profile, TiedSync
from pipeplan.planner.unitcosts import microbatch_choices
from pipeplan.planner.updates import (
    UpdateCost,
    fit_update_cost,
    shared_ends,
    update_cost,
    update_tail,
)
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.cpsat import solve_cpsat
from pipeplan.solvers.dp import solve_dp

floats = st.floats(1e-4, 1.0, allow_nan=False)


def test_fit_interpolates_a_convex_curve_at_its_sizes() -> None:
    sizes = np.array([2e6, 5e6, 8e6, 11e6, 14e6])
    true = 6e-10 * sizes * (1 + sizes / 14e6)  # superlinear, as a cache spills
    cost = fit_update_cost(list(zip(sizes, true)))
    assert cost(sizes) == pytest.approx(true, rel=1e-9)
    slopes = [s for s, _ in cost.pieces]
    assert slopes == sorted(slopes) and slopes[0] < slopes[-1]  # convex, and not a line
    mid = 6.5e6
    assert 6e-10 * mid * (1 + mid / 14e6) <= cost.seconds(mid) <= cost.seconds(8e6)
    # Beyond the last size: the last chord's slope; nothing for no bytes.
    assert cost.seconds(20e6) == pytest.approx(cost.seconds(14e6) + 6e6 * slopes[-1])
    assert cost.seconds(0) == 0.0
    assert all(c <= 1e-15 for _, c in cost.pieces)  # through the origin, then below it


def test_fit_is_non_negative_on_noisy_or_concave_points() -> None:
    # A concave set (a fixed cost per step would make one): the fit stays a non-decreasing
    # line or curve through the origin, never a negative slope.
    cost = fit_update_cost([(1e6, 2e-3), (2e6, 2.5e-3), (4e6, 3e-3), (8e6, 3.2e-3)])
    assert all(s >= 0 for s, _ in cost.pieces)
    vals = cost(np.linspace(0, 1e7, 50))
    assert np.all(np.diff(vals) >= -1e-15)


def test_too_few_sizes_give_the_mean_rate() -> None:
    cost = fit_update_cost([(2e6, 2e-3), (4e6, 5e-3)])
    assert cost.pieces == ((7e-3 / 6e6, 0.0),)
    assert not UpdateCost() and UpdateCost()(1e6) == 0.0
    assert fit_update_cost([]) == UpdateCost()


def test_profiles_without_a_curve_spread_the_whole_step_over_the_bytes() -> None:
    prof = synthetic_profile(6, batch_size=8, seed=1, update_s_per_byte=2e-9)
    total = sum(u.param_bytes for u in prof.units)
    cost = update_cost(prof, "adam")
    assert cost.seconds(total / 3) == pytest.approx(prof.update_s["adam"] / 3, rel=1e-12)
    assert not update_cost(prof.model_copy(update={"update_s": {}}), "adam")


def test_stages_pay_the_curve_of_their_bytes() -> None:
    prof = synthetic_profile(6, batch_size=8, seed=1, update_s_per_byte=2e-9, update_curvature=2.0)
    cost = update_cost(prof, "adam")
    assert len(cost.pieces) > 1
    cluster = Cluster.homogeneous(2, 2**40)
    plan = evaluate(prof, cluster, PlanOptions(optimizer="adam"), [3], 2, solver="t")
    for s in plan.stages:
        assert s.update_s == pytest.approx(cost.seconds(s.memory.params), rel=1e-12)
    # The curve charges a long stage more than its share of the whole step.
    big = max(plan.stages, key=lambda s: s.memory.params)
    total = sum(u.param_bytes for u in prof.units)
    assert big.update_s > prof.update_s["adam"] * big.memory.params / total


def _brute(prof: Profile, cluster: Cluster, options: PlanOptions) -> tuple[float, tuple[int, ...]]:
    best: tuple[float, tuple[int, ...]] | None = None
    for m in microbatch_choices(prof, options):
        for cuts in itertools.combinations(range(1, prof.n_units), cluster.n_stages - 1):
            t = evaluate(prof, cluster, options, cuts, m, solver="brute").step_time_s
            if best is None or t < best[0]:
                best = (t, cuts)
    assert best is not None
    return best


@pytest.mark.parametrize("stages", [2, 3])
def test_solvers_find_the_optimum_the_curve_moves(stages: int) -> None:
    """Seed 0: the curved update moves the optimal cuts away from the linear one's, so a
    solver that charged the bytes linearly would fail here."""
    curved = synthetic_profile(
        7, batch_size=8, seed=0, update_s_per_byte=3e-8, update_curvature=3.0
    )
    flat = curved.model_copy(update={"update_curve": {}})
    cluster = Cluster.homogeneous(stages, 2**40)
    options = PlanOptions(optimizer="adam")
    best, cuts = _brute(curved, cluster, options)
    assert _brute(flat, cluster, options)[1] != cuts
    for solve in (solve_dp, solve_cpsat):
        plan = solve(curved, cluster, options)
        assert plan.step_time_s == pytest.approx(best, rel=1e-6)
        if plan.status == "optimal":
            continue
        assert plan.gap is not None and plan.step_time_s * (1 - plan.gap) <= best * (1 + 1e-9)


# Concurrent updates: while a updates run at once each progresses at 1 / (1 + kappa_u (a - 1)).


def test_two_holders_that_start_together_end_at_the_longer_plus_kappa_u_the_shorter() -> None:
    # Both wait for stage 0 (D_1 = 1 earlier), sum for A = 0.5, then update together: the later
    # ends at A + U_max + kappa_u U_min (the 6.6 ms and 12.1 ms Adam steps measured on 2 vCPUs).
    sync = [TiedSync(stages=(0, 1), bytes=1, seconds=0.5)]
    tail = update_tail([6.6, 12.1], [1.0, 1.0], [0.0, 0.0], sync, kappa_u=0.2)
    assert tail == pytest.approx(0.5 + 12.1 + 0.2 * 6.6)
    assert update_tail([6.6, 12.1], [1.0, 1.0], [0.0, 0.0], sync) == pytest.approx(12.6)
    # No all-reduce, no drain between them: both start at 0.
    assert update_tail([3.0, 2.0], [0.0, 5.0], [0.0, 0.0], kappa_u=0.5) == pytest.approx(4.0)
    # The shorter one ends at (1 + kappa_u) U_min.
    assert shared_ends([0.0, 0.0], [6.6, 12.1], 0.2) == pytest.approx([7.92, 13.42])
    # Three at once: rate 1/2 until the first ends (virtual 1, t = 2), 1/1.5 until the second
    # (t = 3.5), then 1 (t = 4.5).  A job with no work takes no part.
    assert shared_ends([0.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 0.0], 0.5) == pytest.approx(
        [2.0, 3.5, 4.5, 1.0]
    )


def test_updates_that_do_not_overlap_are_not_slowed() -> None:
    # Stage 1 ends its update (0.5 of work from -1) before stage 0 starts its own at 0.
    for kappa_u in (0.0, 0.3, 2.0):
        assert update_tail([1.0, 0.5], [1.0, 1.0], [0.0, 0.0], kappa_u=kappa_u) == 1.0
        assert shared_ends([0.0, -1.0], [1.0, 0.5], kappa_u) == pytest.approx([1.0, -0.5])
    # Partial overlap: stage 1 runs alone from -1 to 0 (1 of its 2 done), then both have 1
    # left at rate 1/1.5 and end together at 1.5 (1 without contention).
    assert update_tail([1.0, 2.0], [1.0, 1.0], [0.0, 0.0], kappa_u=0.5) == pytest.approx(1.5)
    assert update_tail([1.0, 2.0], [1.0, 1.0], [0.0, 0.0]) == pytest.approx(1.0)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(floats, floats, st.floats(0.0, 0.2), st.floats(0.0, 3.0)), min_size=1, max_size=5
    ),
    st.lists(st.tuples(st.sets(st.integers(0, 4), min_size=2), st.floats(0.0, 1.0)), max_size=2),
    st.floats(0.0, 2.0),
)
def test_update_tail_without_contention_is_the_plain_maximum(
    stages: list[tuple[float, float, float, float]],
    sets: list[tuple[set[int], float]],
    kappa_u: float,
) -> None:
    upd = [s[3] for s in stages]
    back = [s[1] for s in stages]
    comm = [s[2] for s in stages]
    syncs = [TiedSync(stages=tuple(sorted(st_)), bytes=1, seconds=a) for st_, a in sets
             if max(st_) < len(stages)]  # fmt: skip
    # ready_j = -D_j, then every all-reduce moves its stages to its end: the formula before
    # kappa_u, reproduced here.
    ready = [-sum(b + c / 2 for b, c in zip(back[:j], comm[:j])) for j in range(len(stages))]
    for sync in syncs:
        end = max(ready[i] for i in sync.stages) + sync.seconds
        for i in sync.stages:
            ready[i] = end
    plain = max(0.0, *(r + u for r, u in zip(ready, upd)))
    assert update_tail(upd, back, comm, syncs) == plain
    assert update_tail(upd, back, comm, syncs, kappa_u=0.0) == plain
    # Sharing never ends an update earlier, and costs at most kappa_u of every other update.
    contended = update_tail(upd, back, comm, syncs, kappa_u)
    assert contended >= plain - 1e-12 * (1 + sum(upd))
    assert contended <= plain + kappa_u * sum(upd) + 1e-9


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(floats, floats, st.floats(0.0, 0.2), st.sampled_from([0.0, 0.5, 2.0, 5.0])),
        min_size=2,
        max_size=4,
    ),
    st.lists(st.tuples(st.sets(st.integers(0, 3), min_size=2), st.floats(0.0, 1.0)), max_size=2),
    st.floats(0.0, 1.5),
    st.floats(0.0, 0.5),
)
def test_contended_tail_equals_simulator(
    stages: list[tuple[float, float, float, float]],
    sets: list[tuple[set[int], float]],
    kappa_u: float,
    kappa: float,
) -> None:
    # One micro-batch: every stage's last backward ends exactly D_j before stage 0's, so the
    # step is sum_j t_j plus the tail, and the simulator's updates (integrated between events)
    # must end where the closed form's shared virtual time puts them.  Every cut has its own
    # transfer: D_j counts the gradient's trip across each cut before stage j.  (GPipe: with one
    # micro-batch 1F1B runs the same order, and torch's 1F1B class needs m >= p.)
    p = len(stages)
    fwd = [s[0] for s in stages]
    back = [s[1] for s in stages]
    comm = [s[2] for s in stages[:-1]] + [0.0]
    upd = [s[3] * (1 + j) / p for j, s in enumerate(stages)]
    syncs = [TiedSync(stages=tuple(sorted(st_)), bytes=1, seconds=a) for st_, a in sets
             if max(st_) < p]  # fmt: skip
    pairs = [(s.stages, s.seconds) for s in syncs]
    tl = one_chunk(fwd, back, comm, 1, contention=kappa, update_s=upd,
                  syncs=pairs, update_contention=kappa_u)  # fmt: skip
    times = [f + b + c for f, b, c in zip(fwd, back, comm)]
    closed = step_time(times, 1) + update_tail(upd, back, comm, syncs, kappa_u)
    assert tl.makespan_s == pytest.approx(closed, rel=1e-9, abs=1e-12)
    ops = [e for e in tl.events if e.kind == "optimizer"]
    assert [e.rank for e in ops] == [j for j in range(p) if upd[j] > 0]
    # Each update lasts at least its work, and at most 1 + kappa_u (p - 1) times it.
    for e in ops:
        u = upd[e.rank]
        assert u * (1 - 1e-9) <= e.end_s - e.start_s <= u * (1 + kappa_u * (p - 1)) + 1e-9


@settings(max_examples=100, deadline=None, derandomize=True)
@given(floats, floats, st.integers(2, 5), st.integers(1, 8), st.floats(0.0, 5.0),
       st.floats(0.1, 1.0), st.sampled_from(["gpipe", "1f1b"]))  # fmt: skip
def test_identical_stages_with_contended_updates_equal_simulator(
    f: float, b: float, p: int, m: int, u: float, kappa_u: float, schedule: str
) -> None:
    # Identical stages, no compute contention (it would stretch the drain's backwards):
    # stage j's update starts j b before stage 0's and overlaps the ones after it when u > b;
    # the closed form's tail is the simulator's.
    assume(schedule == "gpipe" or m >= p)  # torch's 1F1B runs m >= p
    tl = one_chunk([f] * p, [b] * p, [0.0] * p, m, schedule=schedule, update_s=[u] * p,
                  update_contention=kappa_u)  # fmt: skip
    closed = step_time([f + b] * p, m)
    tail = update_tail([u] * p, [b] * p, [0.0] * p, kappa_u=kappa_u)
    assert tl.makespan_s == pytest.approx(closed + tail, rel=1e-9)
    if u > b:  # stage 0's update overlaps stage 1's: slower than alone
        assert tail > u
