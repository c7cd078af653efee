"""The chain bound of every schedule family against brute force: never above the best replayed
step of any partition and recomputation that fits; its longest paths are the replay's."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest
from _solver_strategies import (
    CALL_COSTS,
    CHECKPOINTS,
    SEEDS,
    brute_step,
    draw_devices,
    with_split,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipeplan.planner.families import FAMILIES, check, rank_of_stage
from pipeplan.planner.types import Cluster, Link, PlanOptions
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.chain_bound import TERMS, chain_bound, chain_coefficients, modes_of, path_row
from pipeplan.solvers.chunks import ChunkPlan
from pipeplan.solvers.request import ResolvedRequest
from pipeplan.solvers.schedule_bounds import family_bound
from pipeplan.solvers.schedule_search import Cuts

CANDIDATES = [(f, v) for f, fam in FAMILIES.items() for v in fam.v if v <= 3]


@settings(max_examples=60, deadline=None)
@given(
    seed=SEEDS,
    p=st.integers(1, 3),
    candidate=st.sampled_from(CANDIDATES),
    checkpoint=CHECKPOINTS,
    tied=st.booleans(),
    update=st.sampled_from([0.0, 3e-8]),
    calls=CALL_COSTS,
    slow_link=st.booleans(),
    quantile=st.sampled_from([None, 40]),
    overheads=st.sampled_from([(0.0, 0.0), (2e-4, 5e-4)]),
    contention=st.sampled_from([0.0, 0.3]),
    data=st.data(),
)
def test_the_bound_is_below_every_partition_that_fits(
    seed: int, p: int, candidate: tuple[str, int], checkpoint: str, tied: bool, update: float,
    calls: tuple[float, float], slow_link: bool, quantile: int | None,
    overheads: tuple[float, float], contention: float, data: st.DataObject,
) -> None:  # fmt: skip
    """Every family and v on up to 3 ranks, with the loss, tied parameters, Adam's update,
    checkpoint calls, transfers, engine and step overheads, contention, devices of different
    speeds, allowed cuts, every policy and memory that forces recomputation or rules spans out:
    the bound, seeded with a random partition's longest path, is at most the brute force's
    best step, and at least :func:`family_bound`'s work bound where that is its floor."""
    family, v = candidate
    n = 7
    assume(p * v <= n - 1)
    prof = with_split(synthetic_profile(
        n, batch_size=8, microbatch_sizes=[2, 4], seed=seed, heavy_ends=True, loss=True,
        tied=tied, update_s_per_byte=update, checkpoint_call_s=calls,
    ))  # fmt: skip
    link = Link(bandwidth_Bps=1e8, latency_s=1e-4) if slow_link else Link()
    devices = draw_devices(data.draw, p, st.just(2**50), st.sampled_from([1.0, 0.5]))
    cluster = Cluster(devices=devices, link=link, op_overhead_s=overheads[0],
                      contention=contention).model_copy(update={"step_overhead_s": overheads[1]})  # fmt: skip
    cuts = data.draw(st.sampled_from([None, [c for c in range(1, n) if c != 2]]))
    options = PlanOptions.model_validate(
        {"checkpoint": checkpoint, "optimizer": "adam", "schedule": family, "allowed_cuts": cuts}
    )
    m = data.draw(st.sampled_from([2, 4]))
    assume(check(family, p, v, m) is None)
    k = p * v
    if quantile is not None:
        cp = ChunkPlan(ResolvedRequest(prof, cluster, options), family, v, m)
        peaks = [max(cp.replay([0, *c], [r] * k).peak_bytes)
                 for c in combinations(range(1, n), k - 1) for r in (False, True)]  # fmt: skip
        cap = int(np.percentile(peaks, quantile))
        cluster = cluster.model_copy(update={
            "devices": tuple(d.model_copy(update={"memory_bytes": cap}) for d in devices)
        })  # fmt: skip
    best = brute_step(prof, cluster, options, family, v, m)
    inner = cuts if cuts is not None else list(range(1, n))
    seed_cut = sorted(data.draw(st.permutations(inner))[: k - 1])
    chains = chain_bound(prof, cluster, options, family, v, m,
                         plans=[([0, *seed_cut], [False] * k)])  # fmt: skip
    assert chains.bound <= best * (1 + 1e-12), (chains.bound, best)


@pytest.mark.parametrize(("family", "v"), CANDIDATES)
def test_a_partitions_longest_path_is_its_replayed_step(family: str, v: int) -> None:
    """Without contention and tied all-reduces the chain of :func:`path_row` measures exactly
    the replay's makespan (its durations are the chunk costs the replay charges); with
    contention the replay only runs longer."""
    n, p, m = 9, 3, 4
    prof = with_split(synthetic_profile(n, batch_size=8, microbatch_sizes=[2], seed=3,
                                        heavy_ends=True, loss=True, update_s_per_byte=3e-8))  # fmt: skip
    link = Link(bandwidth_Bps=1e8, latency_s=1e-4)
    rng = np.random.default_rng(0)
    for contention in (0.0, 0.3):
        cluster = Cluster.homogeneous(p, 2**50, link, contention=contention)
        options = PlanOptions(schedule=family)  # type: ignore[arg-type]
        if check(family, p, v, m) is not None or p * v > n:
            continue
        cp = ChunkPlan(ResolvedRequest(prof, cluster, options), family, v, m)
        modes = modes_of(prof, cluster, options, family, v, m)
        pos = list(Cuts.of(options, n).positions)
        for _ in range(3):
            starts = [0, *sorted(rng.choice(range(1, n), p * v - 1, replace=False).tolist())]
            rc = [bool(b) for b in rng.integers(0, 2, p * v)]
            at = [pos.index(b) for b in [*starts, n]]
            values = np.array([modes[s][int(rc[s])][:, at[s], at[s + 1]] for s in range(p * v)])
            row = path_row(family, p, v, m, values)
            length = float((row * values).sum())
            step = cp.replay(starts, rc).makespan_s
            if contention == 0.0:
                assert length == pytest.approx(step, rel=1e-12)
            else:
                assert length <= step * (1 + 1e-12)


def test_the_chains_see_a_loops_bubble_that_the_family_bound_does_not() -> None:
    """A heavy head on the last rank of interleaved 1F1B: the chains through it (micro-batch
    0's forward and backward through every chunk, each rank's own work, its drain) bound the
    step far above the averaged work bound, and within 10 % of the brute force's best."""
    prof = synthetic_profile(9, batch_size=8, microbatch_sizes=[2], seed=3, heavy_ends=True,
                             loss=True)  # fmt: skip
    cluster = Cluster.homogeneous(3, 2**50, Link(bandwidth_Bps=1e8, latency_s=1e-4))
    options = PlanOptions(schedule="interleaved1f1b")
    best = brute_step(prof, cluster, options, "interleaved1f1b", 2, 4)
    bound = chain_bound(prof, cluster, options, "interleaved1f1b", 2, 4).bound
    floor = family_bound(prof, cluster, options, "interleaved1f1b", 2, 4)
    assert floor < 0.6 * best and 0.99 * best <= bound <= best * (1 + 1e-12)


def test_the_chains_of_each_rank() -> None:
    """(A), (A') and (C) of GPipe on 2 ranks, m = 2 (module docstring), term by term."""
    rows = {tuple(map(tuple, r)) for r in chain_coefficients("gpipe", 2, 1, 2)}
    f, b, d, k, u, _ = range(len(TERMS))

    def row(entries: dict[tuple[int, int], int]) -> tuple[tuple[float, ...], ...]:
        out = np.zeros((2, len(TERMS)))
        for (s, t), x in entries.items():
            out[s, t] = x
        return tuple(map(tuple, out))

    a1 = {(0, f): 1, (1, f): 2, (1, k): 2, (1, u): 1}
    a1_drain = {(0, f): 1, (1, f): 2, (1, k): 2, (0, b): 1, (0, u): 1}
    c1 = {(0, f): 1, (1, f): 1, (1, k): 2, (1, u): 1}  # GPipe runs no forward after a backward
    c0 = {(0, f): 1, (1, f): 1, (1, d): 1, (0, k): 2, (0, u): 1}
    assert {row(a1), row(a1_drain), row(c1), row(c0)} <= rows
    assert rank_of_stage("gpipe", 2, 1) == [0, 1]


def test_the_work_it_may_do_is_a_count() -> None:
    """A budget of one programme stops after one, whatever the clock, and says what it did."""
    prof = synthetic_profile(9, batch_size=8, microbatch_sizes=[2], seed=5, heavy_ends=True)
    cluster = Cluster.homogeneous(2, 2**50)
    options = PlanOptions(schedule="interleaved1f1b")
    one = chain_bound(prof, cluster, options, "interleaved1f1b", 2, 4, work=1.0)
    more = chain_bound(prof, cluster, options, "interleaved1f1b", 2, 4)
    assert 0 < one.work < more.work and one.bound <= more.bound
