"""The exact multi-chunk model against brute force: every cut placement and recompute mask of
every multi-chunk family torch ships, replayed."""

from __future__ import annotations

from itertools import combinations, product

import numpy as np
import pytest
from _solver_strategies import with_split

from pipeplan.planner.errors import InfeasiblePlanError, UnsupportedConstraintError
from pipeplan.planner.families import FAMILIES, check
from pipeplan.planner.replay import replay_plan
from pipeplan.planner.types import Cluster, Link, PlanOptions, Profile
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.chunks import ChunkPlan
from pipeplan.solvers.exact_order import ExactOrder
from pipeplan.solvers.exact_plan import solve_exact_order
from pipeplan.solvers.multichunk import solve_schedule
from pipeplan.solvers.request import ResolvedRequest

MULTI = [name for name, fam in FAMILIES.items() if 1 not in fam.v]
ADAM = PlanOptions(optimizer="adam")
LINK = Link(bandwidth_Bps=2e8, latency_s=2e-4)


def _cluster(p: int, memory: int, contention: float = 0.0) -> Cluster:
    """p devices on a link whose transfers matter, with the engine's costs per action and
    per step."""
    base = Cluster.homogeneous(p, memory, link=LINK, op_overhead_s=1e-4, contention=contention)
    return base.model_copy(update={"step_overhead_s": 3e-4})


def _profile(n: int, seed: int = 3) -> Profile:
    """n units with I and W, a loss, Adam update times and a weight tied between the ends."""
    return with_split(
        synthetic_profile(n, batch_size=8, microbatch_sizes=[2, 4], seed=seed, loss=True,
                          update_s_per_byte=3e-8, tied=True)
    )  # fmt: skip


def _partitions(cp: ChunkPlan, masks: bool = True) -> list[tuple[list[int], tuple[bool, ...]]]:
    n, k = cp.costs.n, cp.p * cp.v
    flags = product((False, True), repeat=k) if masks else [(False,) * k]
    return [([0, *c], rc) for rc in flags for c in combinations(range(1, n), k - 1)]


def _brute(cp: ChunkPlan, masks: bool = True) -> float:
    reps = [cp.replay(st, rc) for st, rc in _partitions(cp, masks)]
    return min((r.makespan_s for r in reps if cp.fits(r)), default=float("inf"))


def _tight(profile: Profile, family: str, p: int, m: int, q: float = 30) -> Cluster:
    """Devices whose memory is the q-th percentile of the partitions' peaks (every cut and
    mask): most partitions do not fit."""
    cp = ChunkPlan(ResolvedRequest(profile, _cluster(p, 2**40), ADAM), family, 2, m)
    peaks = [max(cp.replay(st, rc).peak_bytes) for st, rc in _partitions(cp)]
    return _cluster(p, int(np.percentile(peaks, q)))


def _fits_as_replayed(cp: ChunkPlan) -> int:
    """Every cut and mask with the cuts and flags fixed: the model fits exactly where the
    replay's walk does, and its step is the replay's less at most the rounding it states.
    Returns how many fit."""
    fits = 0
    for starts, rc in _partitions(cp):
        rep = cp.replay(starts, rc)
        got = ExactOrder(cp, starts=starts, recompute=rc).solve()
        assert (got.status != "infeasible") == cp.fits(rep), (starts, rc)
        if cp.fits(rep):
            fits += 1
            assert got.model_s <= rep.makespan_s <= got.model_s + got.error_s, (starts, rc)
            assert got.error_s < 1e-7 * rep.makespan_s
    return fits


@pytest.mark.parametrize("family", MULTI)
def test_every_partition_as_the_replay_scores_it(family: str) -> None:
    """Cuts and flags fixed, the model fits exactly where the replay's walk does, and its step
    is the replay's less at most the rounding it states."""
    prof = _profile(5)
    cp = ChunkPlan(ResolvedRequest(prof, _tight(prof, family, 2, 4), ADAM), family, 2, 4)
    assert len(_partitions(cp)) == 64 and 0 < _fits_as_replayed(cp) < 64


@pytest.mark.parametrize("family", MULTI)
@pytest.mark.parametrize("tight", [False, True], ids=["free", "tight"])
def test_optimum_equals_brute_force(family: str, tight: bool) -> None:
    prof = _profile(5)
    cluster = _tight(prof, family, 2, 4) if tight else _cluster(2, 2**40)
    cp = ChunkPlan(ResolvedRequest(prof, cluster, ADAM), family, 2, 4)
    best = _brute(cp)
    got = ExactOrder(cp).solve()
    assert got.status == "optimal" and got.replay is not None and cp.fits(got.replay)
    assert got.replay.makespan_s == pytest.approx(best, rel=1e-9)
    assert got.bound_s <= best <= got.bound_s + got.error_s
    assert got.model_s <= got.replay.makespan_s


@pytest.mark.parametrize("family", ["interleaved1f1b", "zbv"])
def test_three_ranks_against_brute_force(family: str) -> None:
    prof = _profile(7, seed=5)
    m = next(m for m in (4, 2) if check(family, 3, 2, m) is None)
    cp = ChunkPlan(ResolvedRequest(prof, _cluster(3, 2**40), ADAM), family, 2, m)
    got = ExactOrder(cp).solve()
    assert got.status == "optimal" and got.replay is not None
    assert got.replay.makespan_s == pytest.approx(_brute(cp), rel=1e-9)


def test_four_ranks_without_recomputation_against_brute_force() -> None:
    """12 units into 8 chunks (330 cut placements) of the zero-bubble loop at p = 4."""
    prof = _profile(12, seed=2)
    never = PlanOptions(optimizer="adam", checkpoint="never")
    cp = ChunkPlan(ResolvedRequest(prof, _cluster(4, 2**40), never), "zb-interleaved", 2, 4)
    got = ExactOrder(cp).solve()
    assert got.status == "optimal" and got.replay is not None
    assert got.replay.makespan_s == pytest.approx(_brute(cp, masks=False), rel=1e-9)


def test_a_fixed_policy_fixes_the_flags() -> None:
    prof = _profile(5)
    never = PlanOptions(optimizer="adam", checkpoint="never")
    cp = ChunkPlan(ResolvedRequest(prof, _cluster(2, 2**40), never), "zb-interleaved", 2, 4)
    got = ExactOrder(cp).solve()
    assert not any(got.recompute) and got.replay is not None
    assert got.replay.makespan_s == pytest.approx(_brute(cp, masks=False), rel=1e-9)


def test_allowed_cuts_are_kept() -> None:
    prof = _profile(7, seed=1)
    options = PlanOptions(optimizer="adam", allowed_cuts=[1, 3, 4, 6])
    cp = ChunkPlan(ResolvedRequest(prof, _cluster(2, 2**40), options), "dualpipev", 2, 4)
    got = ExactOrder(cp).solve()
    assert set(got.starts[1:]) <= {1, 3, 4, 6} and got.replay is not None
    best = min(cp.replay([0, *c], rc).makespan_s for c in combinations([1, 3, 4, 6], 3)
               for rc in product((False, True), repeat=4))  # fmt: skip
    assert got.replay.makespan_s == pytest.approx(best, rel=1e-9)


def test_contention_is_relaxed_to_a_bound() -> None:
    """With compute contention k the model charges none: its bound holds, the plan's step is
    the replay's, and the status says feasible with the gap between them."""
    prof = _profile(5)
    cluster = _cluster(2, 2**40, contention=0.3)
    plan = solve_exact_order(prof, cluster, ADAM, "interleaved1f1b", 2, 4)
    best = _brute(ChunkPlan(ResolvedRequest(prof, cluster, ADAM), "interleaved1f1b", 2, 4))
    assert plan.status == "feasible" and plan.gap is not None and plan.lower_bound_s is not None
    assert plan.lower_bound_s <= best <= plan.step_time_s
    assert plan.step_time_s * (1 - plan.gap) == pytest.approx(plan.lower_bound_s)
    assert replay_plan(plan).makespan_s == pytest.approx(plan.step_time_s, rel=1e-12)


def test_the_plan_is_the_replayed_winner() -> None:
    prof = _profile(5)
    cluster = _tight(prof, "zbv", 2, 4)
    plan = solve_exact_order(prof, cluster, ADAM, "zbv", 2, 4)
    cp = ChunkPlan(ResolvedRequest(prof, cluster, ADAM), "zbv", 2, 4)
    assert plan.status == "optimal" and plan.solver == "exact-order"
    assert plan.step_time_s == pytest.approx(_brute(cp), rel=1e-9)
    assert replay_plan(plan).makespan_s == pytest.approx(plan.step_time_s, rel=1e-12)
    assert max(plan.rank_peak_bytes) <= cluster.devices[0].memory_bytes


def test_no_fit_names_the_rank_and_the_least_memory() -> None:
    """The memory the error names is the least that fits: one byte less still fails."""
    prof = _profile(5)
    with pytest.raises(InfeasiblePlanError, match="tightest rank") as e:
        solve_exact_order(prof, _cluster(2, 10**6), ADAM, "zbv", 2, 4)
    least = e.value.min_memory_bytes
    assert least is not None
    plan = solve_exact_order(prof, _cluster(2, least), ADAM, "zbv", 2, 4)
    assert max(plan.rank_peak_bytes) == least
    with pytest.raises(InfeasiblePlanError):
        solve_exact_order(prof, _cluster(2, least - 1), ADAM, "zbv", 2, 4)


def _interior(users: list[int]) -> Profile:
    """5 units as :func:`_profile`'s, one parameter shared by ``users``."""
    return with_split(
        synthetic_profile(5, batch_size=8, microbatch_sizes=[2, 4], seed=4, loss=True,
                          update_s_per_byte=3e-8, shared=[users])
    )  # fmt: skip


@pytest.mark.parametrize("users", [[1, 3], [0, 2, 4]], ids=["inner", "t5-like"])
@pytest.mark.parametrize("family", ["interleaved1f1b", "zbv", "dualpipev"])
def test_a_shared_parameter_inside_the_model_as_the_replay_scores_it(
    family: str, users: list[int]
) -> None:
    """A parameter whose users the cuts can separate (T5's embedding: its first unit, the
    decoder's embedding and the tied head): for every cut and mask the model fits where the
    replay does and its step is the replay's less the rounding, and its optimum is the brute
    force's.  The all-reduce is slow (50 ms of latency): a rank that waits for it when it
    should not, or does not when it should, moves the step."""
    prof = _interior(users)
    slow = Link(bandwidth_Bps=2e8, latency_s=0.05)
    cluster = _tight(prof, family, 2, 4).model_copy(update={"allreduce": slow})
    cp = ChunkPlan(ResolvedRequest(prof, cluster, ADAM), family, 2, 4)
    assert 0 < _fits_as_replayed(cp) < 64
    best = ExactOrder(cp).solve()
    assert best.status == "optimal" and best.replay is not None
    assert best.replay.makespan_s == pytest.approx(_brute(cp), rel=1e-9)


@pytest.mark.parametrize("family", ["gpipe", "1f1b"])
def test_a_rank_outside_the_all_reduce_does_not_wait_for_it(family: str) -> None:
    """Three stages, a parameter shared by units 1 and 3: where the cuts put its users on the
    first and last ranks, the middle one neither waits for nor pays the (slow) all-reduce."""
    prof = _interior([1, 3])
    slow = Link(bandwidth_Bps=2e8, latency_s=0.05)
    cluster = _cluster(3, 2**40).model_copy(update={"allreduce": slow})
    cp = ChunkPlan(ResolvedRequest(prof, cluster, ADAM), family, 1, 4)
    assert _fits_as_replayed(cp) == len(_partitions(cp))


def test_two_groups_of_shared_parameters_inside_the_model_are_refused() -> None:
    prof = with_split(synthetic_profile(5, batch_size=8, seed=1, shared=[[1, 3], [0, 2]]))
    cp = ChunkPlan(ResolvedRequest(prof, _cluster(2, 2**40), PlanOptions()), "zbv", 2, 8)
    with pytest.raises(UnsupportedConstraintError, match=r"2 groups \(users \[0, 2\], \[1, 3\]\)"):
        ExactOrder(cp)


def _brute_all(profile: Profile, cluster: Cluster, options: PlanOptions) -> float:
    """The best replayed step over every family, v, m, cut and mask the request allows."""
    best = float("inf")
    families = FAMILIES if options.schedule == "auto" else [options.schedule]
    for fam in families:
        for v in FAMILIES[fam].v:
            for b in profile.microbatch_sizes:
                m = profile.batch_size // b
                if cluster.n_stages * v <= profile.n_units and check(fam, 2, v, m) is None:
                    best = min(
                        best,
                        _brute(ChunkPlan(ResolvedRequest(profile, cluster, options), fam, v, m)),
                    )
    return best


def test_the_schedule_solver_proves_its_plan_with_the_exact_model() -> None:
    """Without the enumeration (``exhaustive_limit=0``) the local search's plan is
    ``feasible`` with the family bound's gap; with the exact model on every candidate, the
    same request is proven optimal, and its step is the brute force's best over every
    family, v, m, cut and mask."""
    prof = _profile(5)
    cluster = _cluster(2, 2**40)
    options = PlanOptions(schedule="auto", optimizer="adam")
    searched = solve_schedule(prof, cluster, options, exhaustive_limit=0)
    proven = solve_schedule(prof, cluster, options, exhaustive_limit=0, exact_time=10.0)
    assert searched.status == "feasible" and searched.gap is not None and searched.gap > 0.01
    assert proven.status == "optimal" and proven.gap is None
    assert proven.step_time_s == pytest.approx(_brute_all(prof, cluster, options), rel=1e-9)
    assert proven.lower_bound_s is not None and proven.lower_bound_s <= proven.step_time_s


def test_the_exact_model_finds_a_plan_the_local_search_misses() -> None:
    """A search stopped after its seeds keeps a seed; the exact model, warm-started from it,
    finds the brute force's best."""
    prof = _profile(7, seed=5)
    cluster = _tight(prof, "zbv", 2, 4, q=50)
    options = PlanOptions(schedule="zbv", optimizer="adam", microbatches=4)
    seeds = solve_schedule(prof, cluster, options, exhaustive_limit=0, search_work=1)
    proven = solve_schedule(prof, cluster, options, exhaustive_limit=0, search_work=1,
                            exact_time=10.0)  # fmt: skip
    best = _brute(ChunkPlan(ResolvedRequest(prof, cluster, options), "zbv", 2, 4))
    assert seeds.step_time_s > best * (1 + 1e-6)
    assert proven.status == "optimal"
    assert proven.step_time_s == pytest.approx(best, rel=1e-9)
