"""The optimizer update's cost curve: the fit, the fallback, and the solvers that use it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.synthetic import synthetic_profile
from pipeplan.planner.types import Cluster, PlanOptions, Profile
from pipeplan.planner.unitcosts import microbatch_choices
from pipeplan.planner.updates import UpdateCost, fit_update_cost, update_cost
from pipeplan.solvers.cpsat import solve_cpsat
from pipeplan.solvers.dp import solve_dp


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
