"""The critical-path bound of GPipe and 1F1B against brute force: never above the best replayed
step of any partition and recomputation that fits, and equal to it where the chains are tight."""

from __future__ import annotations

from itertools import combinations, product

import numpy as np
import pytest
from _solver_strategies import CALL_COSTS, CHECKPOINTS, SEEDS, brute_step, draw_devices
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.planner.families import check
from pipeplan.planner.types import Cluster, Device, Link, PlanOptions, Profile
from pipeplan.planner.unitcosts import microbatch_choices
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.chunks import ChunkPlan
from pipeplan.solvers.multichunk import solve_schedule
from pipeplan.solvers.path_bound import (
    LEVELS,
    ONE_CHUNK_FAMILIES,
    least_sum_plus_max,
    one_chunk_bound,
)
from pipeplan.solvers.request import ResolvedRequest
from pipeplan.solvers.schedule_bounds import family_bound


def _best(profile: Profile, cluster: Cluster, options: PlanOptions, family: str, m: int) -> float:
    return brute_step(profile, cluster, options, family, 1, m)


def _peaks(profile: Profile, cluster: Cluster, options: PlanOptions, family: str, m: int) -> list:
    cp = ChunkPlan(ResolvedRequest(profile, cluster, options), family, 1, m)
    n, p = profile.n_units, cluster.n_stages
    return [
        max(cp.replay([0, *c], list(rc)).peak_bytes)
        for c in combinations(range(1, n), p - 1)
        for rc in product((False, True), repeat=p)
    ]


@settings(max_examples=150, deadline=None)
@given(
    seed=SEEDS,
    n=st.integers(4, 7),
    p=st.integers(1, 3),
    family=st.sampled_from(ONE_CHUNK_FAMILIES),
    checkpoint=CHECKPOINTS,
    tied=st.booleans(),
    inner=st.booleans(),
    update=st.sampled_from([0.0, 3e-8]),
    calls=CALL_COSTS,
    slow_link=st.booleans(),
    quantile=st.sampled_from([None, 30, 70]),
    overheads=st.sampled_from([(0.0, 0.0), (2e-4, 5e-4)]),
    contention=st.sampled_from([0.0, 0.3]),
    data=st.data(),
)
def test_the_bound_is_below_every_partition_that_fits(
    seed: int, n: int, p: int, family: str, checkpoint: str, tied: bool, inner: bool,
    update: float, calls: tuple[float, float], slow_link: bool, quantile: int | None,
    overheads: tuple[float, float], contention: float, data: st.DataObject,
) -> None:  # fmt: skip
    """Every term the replay charges (loss, tied and interior shared parameters, Adam's
    update, checkpoint calls, transfers, engine and step overheads, contention, devices of
    different speeds and memories, allowed cuts, every policy): the bound at each m, and its
    tighter form through thresholds, is at most the brute force's best step at that m."""
    prof = synthetic_profile(
        n, batch_size=8, microbatch_sizes=[1, 2, 4, 8], seed=seed, heavy_ends=True, loss=True,
        tied=tied, shared=[[1, n - 2]] if inner and n > 3 else [], update_s_per_byte=update,
        checkpoint_call_s=calls,
    )  # fmt: skip
    link = Link(bandwidth_Bps=1e8, latency_s=1e-4) if slow_link else Link()
    devices = draw_devices(data.draw, p, st.just(2**50), st.sampled_from([1.0, 0.5, 2.0]))
    cluster = Cluster(devices=devices, link=link, op_overhead_s=overheads[0],
                      contention=contention).model_copy(update={"step_overhead_s": overheads[1]})  # fmt: skip
    cuts = data.draw(st.sampled_from([None, [c for c in range(1, n) if c != 2]]))
    options = PlanOptions.model_validate(
        {"checkpoint": checkpoint, "optimizer": "adam", "schedule": family, "allowed_cuts": cuts}
    )
    for m in microbatch_choices(prof, options, p):
        if check(family, p, 1, m) is not None:
            continue
        if quantile is not None:
            cap = int(np.percentile(_peaks(prof, cluster, options, family, m), quantile))
            cluster = cluster.model_copy(
                update={
                    "devices": tuple(d.model_copy(update={"memory_bytes": cap}) for d in devices)
                }
            )
        best = _best(prof, cluster, options, family, m)
        bound = one_chunk_bound(prof, cluster, options, family, m)
        tight = one_chunk_bound(prof, cluster, options, family, m, levels=LEVELS)
        assert bound <= tight * (1 + 1e-12) and tight <= best * (1 + 1e-12), (m, tight, best)


@pytest.mark.parametrize(("family", "slack"), [("gpipe", 0.0), ("1f1b", 0.01)])
def test_equal_stages_meet_the_bound(family: str, slack: float) -> None:
    """8 equal units on 4 devices, no transfers: two units a stage is the optimum.  GPipe's
    chain (B) meets it, so the schedule solver proves it optimal without the exact model;
    1F1B's idles inside its steady phase where B_j > F_j, which no chain sees: within 1 %."""
    prof = synthetic_profile(8, batch_size=8, microbatch_sizes=[2], seed=1, spread=0.0)
    cluster = Cluster.homogeneous(4, 2**40)
    options = PlanOptions(schedule=family, checkpoint="never")  # type: ignore[arg-type]
    best = _best(prof, cluster, options, family, 4)
    bound = one_chunk_bound(prof, cluster, options, family, 4)
    assert best * (1 - slack) * (1 - 1e-12) <= bound <= best * (1 + 1e-12)
    plan = solve_schedule(prof, cluster, options, exhaustive_limit=0)  # searched, not enumerated
    assert plan.step_time_s == pytest.approx(best, rel=1e-12)
    assert plan.status == ("optimal" if slack == 0 else "feasible")
    assert plan.gap is None or plan.gap <= slack


def test_the_chains_are_tighter_than_the_work_bound() -> None:
    """A heavy head on 3 devices: the family's bound takes the chains', which the averaged work
    bound is far below."""
    prof = synthetic_profile(7, batch_size=8, microbatch_sizes=[2], seed=3, heavy_ends=True,
                             loss=True)  # fmt: skip
    cluster = Cluster.homogeneous(3, 2**40, Link(bandwidth_Bps=1e8, latency_s=1e-4))
    options = PlanOptions(schedule="1f1b")
    best = _best(prof, cluster, options, "1f1b", 4)
    bound = family_bound(prof, cluster, options, "1f1b", 1, 4)
    assert bound == one_chunk_bound(prof, cluster, options, "1f1b", 4)
    assert 0.9 * best < bound <= best


def test_a_stage_that_cannot_fit_is_left_out() -> None:
    """Heavy ends on 2 devices whose memory the split after unit 3 just fits and the fastest
    split (after unit 5) does not: leaving out the stages that cannot fit lifts the bound from
    the unlimited request's to the best fitting step (seed 5: 0.165 s to 0.196 s)."""
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[2], seed=5, heavy_ends=True)
    options = PlanOptions(schedule="gpipe", checkpoint="never")
    free = Cluster.homogeneous(2, 2**40)
    cp = ChunkPlan(ResolvedRequest(prof, free, options), "gpipe", 1, 4)
    cap = max(cp.replay([0, 3], [False, False]).peak_bytes)
    assert max(cp.replay([0, 5], [False, False]).peak_bytes) > cap
    tight = Cluster(devices=tuple(Device(name=f"d{j}", memory_bytes=cap) for j in range(2)),
                    link=Link())  # fmt: skip
    best = _best(prof, tight, options, "gpipe", 4)
    loose = one_chunk_bound(prof, free, options, "gpipe", 4)
    assert loose < 0.9 * best
    assert one_chunk_bound(prof, tight, options, "gpipe", 4) == pytest.approx(best, rel=1e-12)


def test_a_stage_that_fits_only_recomputing_is_priced_recomputing() -> None:
    """Memory that the even split fits only with its second stage recomputing (and no split
    keeping both): the bound prices that stage's checkpointed forward and backward and meets
    the best step, 50 % above what the stages would cost keeping their activations."""
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[2], seed=2, spread=0.0)
    options = PlanOptions(schedule="gpipe")  # --checkpoint auto: recomputation free
    free = Cluster.homogeneous(2, 2**40)
    cp = ChunkPlan(ResolvedRequest(prof, free, options), "gpipe", 1, 4)
    cap = max(cp.replay([0, 3], [True, True]).peak_bytes)
    tight = Cluster(devices=tuple(Device(name=f"d{j}", memory_bytes=cap) for j in range(2)),
                    link=Link())  # fmt: skip
    best = _best(prof, tight, options, "gpipe", 4)
    assert best == pytest.approx(cp.replay([0, 3], [False, True]).makespan_s, rel=1e-12)
    assert one_chunk_bound(prof, free, options, "gpipe", 4) < 0.7 * best
    assert one_chunk_bound(prof, tight, options, "gpipe", 4) == pytest.approx(best, rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(seed=SEEDS, k=st.integers(1, 4), n=st.integers(4, 9), levels=st.sampled_from([2, 32]))
def test_the_thresholds_bound_the_sum_plus_max_from_below(
    seed: int, k: int, n: int, levels: int
) -> None:
    """min over partitions of sum_j cost_j + max_j own_j, brute force, against the threshold
    programme (with a coarse grid too): never above it, never below the two parts minimised
    apart."""
    rng = np.random.default_rng(seed)
    cost = [np.triu(rng.uniform(1, 5, (n, n)), 1) for _ in range(k)]
    own = [np.triu(rng.uniform(1, 5, (n, n)), 1) for _ in range(k)]
    cost = [np.where(c > 0, c, np.inf) for c in cost]
    own = [np.where(o > 0, o, np.inf) for o in own]
    if k > n - 1:
        return
    brute = min(
        sum(cost[j][a, b] for j, (a, b) in enumerate(zip((0, *cuts), (*cuts, n - 1), strict=True)))
        + max(own[j][a, b] for j, (a, b) in enumerate(zip((0, *cuts), (*cuts, n - 1), strict=True)))
        for cuts in combinations(range(1, n - 1), k - 1)
    )
    got = least_sum_plus_max(cost, own, levels)
    apart = min(
        sum(cost[j][a, b] for j, (a, b) in enumerate(zip((0, *cuts), (*cuts, n - 1), strict=True)))
        for cuts in combinations(range(1, n - 1), k - 1)
    ) + min(
        max(own[j][a, b] for j, (a, b) in enumerate(zip((0, *cuts), (*cuts, n - 1), strict=True)))
        for cuts in combinations(range(1, n - 1), k - 1)
    )
    assert apart - 1e-9 <= got <= brute + 1e-9


def test_other_families_are_refused() -> None:
    prof = synthetic_profile(4, batch_size=8, microbatch_sizes=[2])
    with pytest.raises(ValueError, match="zbv"):
        one_chunk_bound(prof, Cluster.homogeneous(2, 2**40), PlanOptions(), "zbv", 4)
