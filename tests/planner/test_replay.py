"""The step simulator: torch's action lists replayed, against the old event loop, and memory."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from _event_loop_oracle import simulate
from _one_chunk import one_chunk

from pipeplan.planner.costmodel import step_time
from pipeplan.planner.families import FAMILIES, Action, action_order, check
from pipeplan.planner.replay import ChunkCosts, ReplayEvent, peak_memory, replay, replay_plan
from pipeplan.planner.updates import update_tail


def _rows(events: Sequence[ReplayEvent]) -> dict[tuple[int, str, int], list[float]]:
    """(rank, kind, micro-batch) -> the starts and ends of its events, in time order."""
    out: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for e in events:
        out.setdefault((e.rank, e.kind, e.microbatch), []).append((e.start_s, e.end_s))
    return {key: [t for span in sorted(spans) for t in span] for key, spans in out.items()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k", [0.0, 0.35])
@pytest.mark.parametrize("kappa_u", [0.0, 0.2])
def test_replay_equals_the_old_event_loop(schedule: str, k: float, kappa_u: float) -> None:
    """The replay of torch's GPipe and 1F1B lists is the discrete-event loop pipeplan had
    before it (tests/planner/_event_loop_oracle.py), event for event to 1e-12: with
    contention k (the two integrate the same rates between events), updates that share the
    host (kappa_u), tied all-reduces, the step's fixed cost and recompute labels."""
    rng = random.Random(3)
    for p, m in [(2, 2), (3, 5), (4, 8), (3, 3)]:
        F = [rng.uniform(1, 3) for _ in range(p)]
        B = [rng.uniform(2, 5) for _ in range(p)]
        C = [rng.uniform(0, 1) for _ in range(p - 1)] + [0.0]
        U = [rng.uniform(0, 2) for _ in range(p)]
        R = [rng.choice([0.0, 0.5 * B[j]]) for j in range(p)]
        syncs = [((0, p - 1), 0.3), ((0, 1), 0.2)]
        want = simulate(
            F, B, C, m, schedule=schedule, recompute_s=R, update_s=U, syncs=syncs,
            step_overhead_s=0.1, contention=k, update_contention=kappa_u,
        )  # fmt: skip
        got = replay(
            schedule, p, 1, m, ChunkCosts(F, B, C, update_s=U, recompute_s=R), syncs=syncs,
            step_overhead_s=0.1, contention=k, update_contention=kappa_u,
        )  # fmt: skip
        assert got.makespan_s == pytest.approx(want.makespan_s, rel=1e-12)
        mine, theirs = _rows(got.events), _rows(want.events)
        assert mine.keys() == theirs.keys()
        for key, spans in theirs.items():
            assert mine[key] == pytest.approx(spans, rel=1e-12), key
        for r in range(p):
            computed = [e for e in want.events if e.rank == r and e.kind in
                        ("forward", "recompute", "backward")]  # fmt: skip
            assert got.busy_s(r) == pytest.approx(sum(e.end_s - e.start_s for e in computed))


def test_contention_slows_only_overlapping_compute() -> None:
    # Two stages, stage 1 three times longer: stage 1 is slowed only while stage 0 computes.
    k = 0.5
    tl = one_chunk([1.0, 3.0], [0.0, 0.0], [0.0, 0.0], 2, contention=k)
    f1 = [e for e in tl.events if e.rank == 1 and e.kind == "forward"]
    # stage 0: F0 [0, 1], F1 [1, 1 + 1.5] (slowed: stage 1 computes); stage 1: F0 starts at 1,
    # does 1 unit of work by 2.5 at rate 2/3, then runs alone: ends at 2.5 + 2 = 4.5.
    assert f1[0].start_s == pytest.approx(1.0)
    assert f1[0].end_s == pytest.approx(4.5)
    assert one_chunk([1.0, 3.0], [0.0, 0.0], [0.0, 0.0], 2).makespan_s == pytest.approx(7.0)
    assert tl.makespan_s == pytest.approx(7.5)


def test_contention_is_free_without_overlap() -> None:
    assert one_chunk([1.0, 2.0], [2.0, 3.0], [0.1, 0.0], 1, contention=0.7).makespan_s == (
        pytest.approx(one_chunk([1.0, 2.0], [2.0, 3.0], [0.1, 0.0], 1).makespan_s)
    )
    assert one_chunk([1.0], [2.0], [0.0], 8, contention=0.7).makespan_s == pytest.approx(24.0)


def test_1f1b_same_makespan_as_gpipe_for_uniform_stages() -> None:
    g = one_chunk([1.0] * 3, [2.0] * 3, [0.0] * 3, 6, schedule="gpipe").makespan_s
    f = one_chunk([1.0] * 3, [2.0] * 3, [0.0] * 3, 6, schedule="1f1b").makespan_s
    assert g == pytest.approx((6 + 3 - 1) * 3.0) and f == pytest.approx(g)


def test_a_late_stage_update_longer_than_the_drain_sets_the_makespan() -> None:
    # p = 2, m = 1, F = B = 1: stage 1 ends its backward at 3, stage 0 at 4.  Stage 1's update
    # of 5 outlasts stage 0's backward and update (1): the step ends at 3 + 5 = 8, and the
    # closed form's tail R = max(U_0, U_1 - B_0) = 4 says so.
    tl = one_chunk([1.0, 1.0], [1.0, 1.0], [0.0, 0.0], 1, update_s=[1.0, 5.0])
    assert tl.makespan_s == pytest.approx(8.0)
    assert update_tail([1.0, 5.0], [1.0, 1.0], [0.0, 0.0]) == pytest.approx(4.0)
    assert step_time([2.0, 2.0], 1) + 4.0 == pytest.approx(8.0)


def test_a_plans_replay_labels_recompute_and_waits_for_the_step_set_up() -> None:
    from pipeplan.planner.evaluate import evaluate
    from pipeplan.planner.types import Cluster, PlanOptions
    from pipeplan.profiler.synthetic import synthetic_profile

    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[2], seed=5)
    cluster = Cluster.homogeneous(3, 2**40, op_overhead_s=2e-4, contention=0.3)
    cluster = cluster.model_copy(update={"step_overhead_s": 1.5e-3})
    plan = evaluate(prof, cluster, PlanOptions(checkpoint="except_last"), [2, 4], 4, solver="t")
    timeline = replay_plan(plan)
    assert min(e.start_s for e in timeline.events) == pytest.approx(1.5e-3)
    assert timeline.makespan_s == pytest.approx(plan.simulated_step_time_s, rel=1e-12)
    assert (timeline.p, timeline.m) == (3, 4)
    remade = {(e.rank, e.microbatch) for e in timeline.events if e.kind == "recompute"}
    assert remade == {(j, i) for j in (0, 1) for i in range(4)}  # the last stage keeps
    for e in timeline.events:
        if e.kind == "recompute":
            assert e.end_s - e.start_s >= plan.stages[e.rank].forward_s * (1 - 1e-9)  # or slowed
    assert not any(e.kind == "recompute" for e in replay_plan(plan, timeline=False).events)


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
        starts = [e.start_s for e in slow.events if e.rank == r and e.stage >= 0]
        assert starts == sorted(starts)
    one = replay(family, p, v, 1, costs, contention=0.5)
    assert one.makespan_s == replay(family, p, v, 1, costs).makespan_s


@pytest.mark.parametrize(
    ("family", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2), ("loopedbfs", 3)]
)
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


def _walked_peaks(order: Sequence[Sequence[Action]], c: ChunkCosts) -> tuple[int, ...]:
    """The memory rules of the module's docstring, one action at a time (the oracle)."""
    peaks = []
    for acts in order:
        live = peak = 0
        made: set[int] = set()
        for a in acts:
            s = a.stage
            extra = c.grad_temp_bytes[s] if s in made else c.grad_temp_first_bytes[s]
            if a.kind == "F":
                live += c.held_bytes[s]
                peak = max(peak, live)
            elif a.kind == "B" or (a.kind == "W" and s == 0):
                peak = max(peak, live + c.transient_bytes[s] + extra)
                live -= c.held_bytes[s]
                if s not in made:
                    made.add(s)
                    live += c.grad_bytes[s]
                    peak = max(peak, live)
            elif a.kind == "I" and s > 0:
                peak = max(peak, live + c.transient_bytes[s])
                live += c.weight_held_bytes[s] - c.held_bytes[s]
                peak = max(peak, live)
            elif a.kind == "W":
                if s not in made:
                    made.add(s)
                    live += c.grad_bytes[s]
                peak = max(peak, live + extra)
                live -= c.weight_held_bytes[s]
        peaks.append(sum(c.static_bytes[s] for s in {a.stage for a in acts}) + peak)
    return tuple(peaks)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peak_memory_equals_a_walk_of_each_action(family: str) -> None:
    """The vectorised walk (prefix sums per rank) against the rules applied one by one, on
    random bytes, zeros included, at several p, v and m."""
    rng = random.Random(family)
    for p, m in [(1, 1), (2, 3), (3, 4), (4, 8), (8, 16)]:
        for v in FAMILIES[family].v[:2]:
            if check(family, p, v, m) is not None:
                continue
            n = p * v
            for _ in range(3):
                col = [
                    [rng.choice([0, rng.randint(1, 10**9)]) for _ in range(n)] for _ in "0123456"
                ]
                costs = ChunkCosts(
                    [1.0] * n, [2.0] * n, [0.0] * n, static_bytes=col[0], held_bytes=col[1],
                    weight_held_bytes=col[2], transient_bytes=col[3], grad_bytes=col[4],
                    grad_temp_bytes=col[5], grad_temp_first_bytes=col[6],
                )  # fmt: skip
                walked = _walked_peaks(action_order(family, p, v, m), costs)
                assert peak_memory(family, p, v, m, costs) == walked, (p, v, m)
