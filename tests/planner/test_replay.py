"""The schedule families' action lists (torch's own) and their replay: time and memory."""

from __future__ import annotations

import random

import pytest
from torch.distributed.pipelining import schedules as ts

from pipeplan.planner.families import (
    FAMILIES,
    Action,
    action_order,
    check,
    rank_of_stage,
)
from pipeplan.planner.replay import ChunkCosts, replay
from pipeplan.planner.simulate import operation_order, simulate

CASES = [(f, v, p, m) for f in FAMILIES for v in FAMILIES[f].v[:2] for p, m in [(2, 4), (4, 8)]]


@pytest.mark.parametrize(("family", "v", "p", "m"), CASES)
def test_every_action_once_on_its_rank_in_a_valid_order(
    family: str, v: int, p: int, m: int
) -> None:
    if check(family, p, v, m) is not None:
        pytest.skip(check(family, p, v, m))
    order = action_order(family, p, v, m)
    owner = rank_of_stage(family, p, v)
    seen: dict[tuple[str, int, int], int] = {}
    for r, acts in enumerate(order):
        for k, a in enumerate(acts):
            assert owner[a.stage] == r
            assert (a.kind, a.stage, a.microbatch) not in seen
            seen[(a.kind, a.stage, a.microbatch)] = k
    n = p * v
    for s in range(n):
        for i in range(m):
            assert ("F", s, i) in seen
            back = [k for k in "BI" if (k, s, i) in seen]
            assert len(back) == 1
            assert seen[("F", s, i)] < seen[(back[0], s, i)]
            if back[0] == "I":
                assert seen[("I", s, i)] < seen[("W", s, i)]
    if FAMILIES[family].torch_class != "Schedule1F1B":  # torch checks its own lists too
        tsa = {
            r: [ts._Action(a.stage, ts._ComputationType(a.kind), a.microbatch) for a in acts]
            for r, acts in enumerate(order)
        }
        ts._validate_schedule(tsa, p, n, m)


def test_gpipe_is_torchs_pipeline_order_and_1f1b_what_it_executes() -> None:
    assert [[f"{a.kind}{a.microbatch}" for a in r] for r in action_order("gpipe", 2, 1, 3)] == [
        ["F0", "F1", "F2", "B0", "B1", "B2"]
    ] * 2
    for p, m in [(3, 5), (4, 4)]:
        for r, acts in enumerate(action_order("1f1b", p, 1, m)):
            assert [(a.kind, a.microbatch) for a in acts] == operation_order("1f1b", r, p, m)
    assert action_order("1f1b", 2, 1, 2)[1] == (
        Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1), Action("B", 1, 1)
    )  # fmt: skip


def test_torch_refuses_what_the_family_cannot_run() -> None:
    assert check("1f1b", 4, 1, 2) is not None
    assert "DualPipeV" in (check("dualpipev", 4, 2, 6) or "")
    assert check("zbv", 4, 3, 8) is not None
    assert check("interleaved1f1b", 4, 2, 6) is None
    with pytest.raises(ValueError, match="unknown schedule"):
        check("pipedream", 2, 1, 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k", [0.0, 0.35])
def test_replay_equals_the_simulator_for_one_chunk_per_rank(schedule: str, k: float) -> None:
    """Also with contention k: the two integrate the same rates between events."""
    rng = random.Random(3)
    for p, m in [(2, 2), (3, 5), (4, 8)]:
        F = [rng.uniform(1, 3) for _ in range(p)]
        B = [rng.uniform(2, 5) for _ in range(p)]
        C = [rng.uniform(0, 1) for _ in range(p - 1)] + [0.0]
        U = [rng.uniform(0, 2) for _ in range(p)]
        syncs = [((0, p - 1), 0.3)]
        want = simulate(
            F, B, C, m, schedule=schedule, update_s=U, syncs=syncs, step_overhead_s=0.1,
            contention=k, update_contention=0.2,
        )  # fmt: skip
        got = replay(
            schedule, p, 1, m, ChunkCosts(F, B, C, update_s=U), syncs=syncs, step_overhead_s=0.1,
            contention=k, update_contention=0.2,
        )  # fmt: skip
        assert got.makespan_s == pytest.approx(want.makespan_s, rel=1e-12)
        for r in range(p):
            computed = [
                e for e in want.events if e.stage == r and e.kind in ("forward", "backward")
            ]
            assert got.busy_s(r) == pytest.approx(sum(e.end_s - e.start_s for e in computed))


@pytest.mark.parametrize("family", ["interleaved1f1b", "zbv"])
def test_contention_slows_only_what_overlaps(family: str) -> None:
    """k stretches a step by at most 1 + k (p - 1) and by more than nothing where ranks
    compute at once; a 1-micro-batch or 1-rank step is not slowed (as the simulator)."""
    p, v, m = 2, 2, 4
    n = p * v
    costs = ChunkCosts([1.0] * n, [2.0] * n, [0.1] * n, [1.0] * n, [1.0] * n)
    free = replay(family, p, v, m, costs)
    slow = replay(family, p, v, m, costs, contention=0.5)
    assert free.makespan_s < slow.makespan_s <= free.makespan_s * (1 + 0.5 * (p - 1)) + 1e-9
    assert sum(slow.busy) > sum(free.busy)  # the compute's wall seconds, stretched
    # every action still runs once, in each rank's order
    key = lambda e: (e.rank, e.stage, e.microbatch, e.kind)
    assert sorted(map(key, slow.events)) == sorted(map(key, free.events))
    for r in range(p):
        starts = [e.start_s for e in slow.events if e.rank == r and e.kind in "FBIW"]
        assert starts == sorted(starts)
    one = replay(family, p, v, 1, costs, contention=0.5)
    assert one.makespan_s == replay(family, p, v, 1, costs).makespan_s


@pytest.mark.parametrize(("family", "v"), [("1f1b", 1), ("interleaved1f1b", 2), ("loopedbfs", 3)])
def test_equal_chunks_give_the_closed_form_bubble(family: str, v: int) -> None:
    """(p - 1) / (v m + p - 1) of the step idles (Narayanan et al. 2021), F and B split evenly."""
    for p, m in [(4, 8), (8, 16)]:
        n = p * v
        r = replay(family, p, v, m, ChunkCosts([1.0 / v] * n, [2.0 / v] * n, [0.0] * n))
        assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_zero_bubble_beats_interleaved_when_f_i_w_are_equal() -> None:
    p, m, n = 4, 16, 8
    equal = ChunkCosts([0.5] * n, [1.0] * n, [0.0] * n, [0.5] * n, [0.5] * n)
    inter = replay("interleaved1f1b", p, 2, m, equal).makespan_s
    for family in ("zb-interleaved", "zbv"):
        assert replay(family, p, 2, m, equal).makespan_s < 0.96 * inter
    with pytest.raises(ValueError, match="I and W"):
        replay("zbv", p, 2, m, ChunkCosts([0.5] * n, [1.0] * n, [0.0] * n))


def test_peak_memory_counts_micro_batches_in_flight() -> None:
    """1F1B holds min(m, p - r) micro-batches on rank r, GPipe m, each from its F to its B."""
    p, m = 4, 8
    costs = ChunkCosts([1.0] * p, [2.0] * p, [0.0] * p, static_bytes=[100] * p, held_bytes=[10] * p)
    assert replay("gpipe", p, 1, m, costs).peak_bytes == (180,) * p
    assert replay("1f1b", p, 1, m, costs).peak_bytes == (140, 130, 120, 110)
    split = ChunkCosts(
        [1.0] * 8, [2.0] * 8, [0.0] * 8, [1.0] * 8, [1.0] * 8,
        static_bytes=[0] * 8, held_bytes=[10] * 8, weight_held_bytes=[10] * 8,
    )  # fmt: skip
    freed = ChunkCosts(
        [1.0] * 8, [2.0] * 8, [0.0] * 8, [1.0] * 8, [1.0] * 8,
        static_bytes=[0] * 8, held_bytes=[10] * 8, weight_held_bytes=[0] * 8,
    )  # fmt: skip
    kept = replay("zb-interleaved", p, 2, m, split).peak_bytes  # I frees nothing
    early = replay("zb-interleaved", p, 2, m, freed).peak_bytes  # I frees everything
    assert kept == (80, 80, 80, 80) and early == (80, 70, 60, 50)


def test_gradients_appear_at_the_first_backward_and_later_ones_add_a_temporary() -> None:
    """Gradients are None at the step's start: GPipe's rank holds 2 micro-batches (20), its
    first B frees one and makes the gradients (60), its second adds a temporary (67)."""
    costs = ChunkCosts(
        [1.0] * 2, [2.0] * 2, [0.0] * 2, static_bytes=[100] * 2, held_bytes=[10] * 2,
        grad_bytes=[50] * 2, grad_temp_bytes=[7] * 2,
    )  # fmt: skip
    assert replay("gpipe", 2, 1, 2, costs).peak_bytes == (167, 167)
    no_temp = ChunkCosts(
        [1.0] * 2, [2.0] * 2, [0.0] * 2, static_bytes=[100] * 2, held_bytes=[10] * 2,
        grad_bytes=[5] * 2, grad_temp_bytes=[0] * 2,
    )  # fmt: skip
    assert replay("gpipe", 2, 1, 2, no_temp).peak_bytes == (120, 120)  # before any gradient


def test_a_weight_two_chunks_of_one_rank_share_counts_once() -> None:
    """A tied first and last unit: on one rank in a V (zbv), on two in a loop."""
    from pipeplan.planner.chunks import ChunkPlan
    from pipeplan.planner.synthetic import synthetic_profile
    from pipeplan.planner.types import Cluster, PlanOptions

    plain = synthetic_profile(8, batch_size=8, microbatch_sizes=[2], tied=True)
    split = {"backward_input_s": 1e-3, "backward_weight_s": 1e-3, "weight_held_bytes": 0}
    units = tuple(
        u.model_copy(update={"timings": {b: t.model_copy(update=split)
                                         for b, t in u.timings.items()}})
        for u in plain.units
    )  # fmt: skip
    profile = plain.model_copy(update={"units": units})
    tied = profile.shared_params[0].bytes
    cluster = Cluster.homogeneous(2, 1 << 40)
    starts = [0, 2, 4, 6]
    params = {}
    for fam in ("zbv", "zb-interleaved"):
        options = PlanOptions(schedule=fam, checkpoint="never", microbatches=4)
        plan = ChunkPlan(profile, cluster, options, fam, 2, 4)
        params[fam] = plan.costs_of(starts, [False] * 4).grad_bytes
    assert params["zb-interleaved"][0] - params["zbv"][0] == tied  # counted on chunk 3 only
    assert params["zbv"][3] == params["zb-interleaved"][3]
    assert sum(params["zb-interleaved"]) - sum(params["zbv"]) == tied
