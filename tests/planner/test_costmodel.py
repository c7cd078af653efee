"""The closed form against the schedule simulator, and the memory model's terms."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.planner.costmodel import in_flight, recomputes, step_time
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.simulate import operation_order, simulate, simulate_plan
from pipeplan.planner.synthetic import synthetic_profile
from pipeplan.planner.types import Cluster, Link, PlanOptions, TiedSync
from pipeplan.planner.updates import shared_ends, update_tail

floats = st.floats(1e-4, 1.0, allow_nan=False)
schedules = st.sampled_from(["gpipe", "1f1b"])


def identical_stages(
    min_stages: int, max_stages: int, max_microbatches: int
) -> tuple[st.SearchStrategy[float], ...]:
    """Strategies of identical stages' forward F and backward B, the stages p, and m."""
    return floats, floats, st.integers(min_stages, max_stages), st.integers(1, max_microbatches)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(floats, min_size=1, max_size=6),
    st.floats(0.5, 4.0),
    st.lists(st.floats(0.0, 0.2), min_size=6, max_size=6),
    st.integers(1, 12),
)
def test_closed_form_equals_simulator_with_equal_ratios(
    fwd: list[float], ratio: float, comm: list[float], m: int
) -> None:
    # Stage j's forward op is F_j + C_j/2 and its backward op B_j + C_j/2; equal ratios of the
    # two make the closed form exact.
    p = len(fwd)
    c = comm[:p]
    c[-1] = 0.0
    f_op = [f + ci / 2 for f, ci in zip(fwd, c)]
    back = [ratio * fo - ci / 2 for fo, ci in zip(f_op, c)]
    if min(back) < 0:
        return
    times = [f + b + ci for f, b, ci in zip(fwd, back, c)]
    tl = simulate(fwd, back, c, m)
    assert tl.makespan_s == pytest.approx(step_time(times, m), rel=1e-9)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(floats, floats, st.floats(0, 0.2)), min_size=1, max_size=6),
    st.integers(1, 12),
)
def test_closed_form_bounds_simulator(stages: list[tuple[float, float, float]], m: int) -> None:
    fwd = [s[0] for s in stages]
    back = [s[1] for s in stages]
    comm = [s[2] for s in stages[:-1]] + [0.0]
    times = [f + b + c for f, b, c in zip(fwd, back, comm)]
    sim = simulate(fwd, back, comm, m).makespan_s
    closed = step_time(times, m)
    assert closed <= sim * (1 + 1e-9)
    # ...and the simulator's makespan is the GPipe formula with separate maxima.
    f_op = [f + c / 2 for f, c in zip(fwd, comm)]
    b_op = [b + c / 2 for b, c in zip(back, comm)]
    assert sim == pytest.approx(sum(times) + (m - 1) * (max(f_op) + max(b_op)), rel=1e-9)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(*identical_stages(1, 6, 12), st.floats(0.0, 1.0), schedules)
def test_closed_form_equals_simulator_with_contention(
    f: float, b: float, p: int, m: int, kappa: float, schedule: str
) -> None:
    # Identical stages, no transfers: p + m - 1 slots on the fill/drain path, and each of the
    # (p - 1)(m - 1) times a stage computes beside another costs k of its work (GPipe; 1F1B has
    # the same critical path).
    tl = simulate([f] * p, [b] * p, [0.0] * p, m, contention=kappa, schedule=schedule)
    closed = step_time([f + b] * p, m, [f + b] * p, kappa)
    assert tl.makespan_s == pytest.approx(closed, rel=1e-9)
    if p > 1 and m > 1:
        expected = (f + b) * (p + m - 1 + kappa * (p - 1) * (m - 1))
        assert closed == pytest.approx(expected, rel=1e-12)
    else:
        assert closed == pytest.approx((f + b) * (p + m - 1), rel=1e-12)


def test_contention_slows_only_overlapping_compute() -> None:
    # Two stages, stage 1 three times longer: stage 1 is slowed only while stage 0 computes.
    k = 0.5
    tl = simulate([1.0, 3.0], [0.0, 0.0], [0.0, 0.0], 2, contention=k)
    f1 = [e for e in tl.events if e.stage == 1 and e.kind == "forward"]
    # stage 0: F0 [0, 1], F1 [1, 1 + 1.5] (slowed: stage 1 computes); stage 1: F0 starts at 1,
    # does 1 unit of work by 2.5 at rate 2/3, then runs alone: ends at 2.5 + 2 = 4.5.
    assert f1[0].start_s == pytest.approx(1.0)
    assert f1[0].end_s == pytest.approx(4.5)
    assert simulate([1.0, 3.0], [0.0, 0.0], [0.0, 0.0], 2).makespan_s == pytest.approx(7.0)
    assert tl.makespan_s == pytest.approx(7.5)


def test_contention_is_free_without_overlap() -> None:
    assert simulate([1.0, 2.0], [2.0, 3.0], [0.1, 0.0], 1, contention=0.7).makespan_s == (
        pytest.approx(simulate([1.0, 2.0], [2.0, 3.0], [0.1, 0.0], 1).makespan_s)
    )
    assert simulate([1.0], [2.0], [0.0], 8, contention=0.7).makespan_s == pytest.approx(24.0)


def test_uniform_stages_bubble_formula() -> None:
    p, m = 4, 8
    tl = simulate([1.0] * p, [2.0] * p, [0.0] * p, m)
    assert tl.makespan_s == pytest.approx((m + p - 1) * 3.0)
    assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_same_makespan_as_gpipe_for_uniform_stages() -> None:
    g = simulate([1.0] * 3, [2.0] * 3, [0.0] * 3, 6, schedule="gpipe").makespan_s
    f = simulate([1.0] * 3, [2.0] * 3, [0.0] * 3, 6, schedule="1f1b").makespan_s
    assert f == pytest.approx(g)


def test_operation_orders_exact() -> None:
    assert operation_order("gpipe", 0, 3, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert operation_order("1f1b", 0, 3, 4) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("F", 3),
        ("B", 1),
        ("B", 2),
        ("B", 3),
    ]
    assert operation_order("1f1b", 2, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_policies_and_in_flight() -> None:
    assert [recomputes("except_last", j, 3) for j in range(3)] == [True, True, False]
    assert [recomputes("always", j, 3) for j in range(3)] == [True] * 3
    assert [recomputes("never", j, 3) for j in range(3)] == [False] * 3
    assert [in_flight("gpipe", j, 3, 8) for j in range(3)] == [8, 8, 8]
    assert [in_flight("1f1b", j, 3, 8) for j in range(3)] == [3, 2, 1]


def test_stage_terms_by_hand() -> None:
    call_f, call_b = 3e-5, 5e-5
    prof = synthetic_profile(
        4, batch_size=8, microbatch_sizes=[2, 8], seed=1, checkpoint_call_s=(call_f, call_b)
    )
    cl = Cluster.homogeneous(2, 2**40, Link(bandwidth_Bps=1e9, latency_s=1e-5))
    opts = PlanOptions(checkpoint="except_last", optimizer="adam")
    plan = evaluate(prof, cl, opts, [2], 4, solver="t")
    b = 2
    u = prof.units
    s0, s1 = plan.stages
    t = [unit.timings[b] for unit in u]
    f0 = t[0].forward_s + t[1].forward_s
    g0 = t[0].backward_s + t[1].backward_s
    cut = prof.cuts[1]
    comm = 2 * (len(cut.tensors) * 1e-5 + cut.bytes_per_sample * b / 1e9)
    # Stage 0 recomputes: the checkpointed forward and backward, with one call's own cost
    # charged once for the stage, not once per unit.
    fc0 = t[0].recompute_forward_s + t[1].recompute_forward_s
    assert fc0 > f0 + 2 * call_f * 0.999
    assert s0.forward_s == pytest.approx(fc0 - call_f)
    r0 = t[0].recompute_backward_s + t[1].recompute_backward_s
    assert r0 > g0 + f0 * 0.999  # checkpointing costs at least the recomputed forward
    assert s0.backward_s == pytest.approx(r0 - call_b)
    # Stage 1 does not: the plain forward and backward.
    assert s1.forward_s == pytest.approx(t[2].forward_s + t[3].forward_s)
    assert s1.backward_s == pytest.approx(t[2].backward_s + t[3].backward_s)
    assert s0.comm_s == pytest.approx(comm)
    assert s1.comm_s == 0.0 and not s1.recompute
    # Memory at each stage's peak, by hand (GPipe, m = 4, Adam: k = 2).
    w = [u[0].param_bytes + u[1].param_bytes, u[2].param_bytes + u[3].param_bytes]
    a = [u[0].timings[b].saved_bytes + u[1].timings[b].saved_bytes,
         u[2].timings[b].saved_bytes + u[3].timings[b].saved_bytes]  # fmt: skip
    big = [max(v.largest_param_bytes for v in pair) for pair in (u[:2], u[2:])]
    x0, x, y = (
        prof.input_bytes_per_sample * b,
        cut.bytes_per_sample * b,
        u[3].timings[b].output_bytes,
    )
    loss_a = prof.loss[b].saved_bytes if b in prof.loss else 0
    # Stage 0 recomputes: it holds its 4 outputs; at the first backward it remakes one
    # micro-batch's activations, at a later one the gradients exist, 3 outputs are held, and
    # the larger of the remade activations and the largest parameter's temporary.
    first0 = 4 * x + a[0]
    later0 = w[0] + 3 * x + max(a[0], big[0])
    m0 = s0.memory
    assert (m0.params, m0.optimizer) == (w[0], 2 * w[0])
    assert (m0.stashed_inputs, m0.gradient_buffers) == (4 * x0, 4 * x)  # inputs, receive buffers
    assert m0.total == 3 * w[0] + 4 * x0 + 4 * x + max(first0, later0)
    assert m0.grads == (0 if first0 >= later0 else w[0])
    # Stage 1 keeps every micro-batch's activations and outputs (the model's, y); its backward
    # works on the input's gradient and the loss's and output's (2 y).
    held = a[1] + loss_a + y
    first1, later1 = 4 * held, w[1] + 3 * held + big[1]
    m1 = s1.memory
    assert (m1.stashed_inputs, m1.gradient_buffers) == (4 * x, 0)
    assert m1.total == 3 * w[1] + 4 * x + x + 2 * y + max(first1, later1)
    assert m1.outputs == (4 if first1 >= later1 else 3) * y
    one = evaluate(prof, cl, opts, [2], 1, solver="t").stages[1].memory  # no accumulation
    assert one.transient == cut.bytes_per_sample * 8 + 2 * u[3].timings[8].output_bytes
    for s in (s0, s1):
        m = s.memory
        parts = (m.params, m.grads, m.optimizer, m.stashed_inputs, m.activations,
                 m.gradient_buffers, m.outputs, m.transient)  # fmt: skip
        assert m.total == sum(parts)
    times = [s0.time_s, s1.time_s]
    assert plan.step_time_s == pytest.approx(sum(times) + 3 * max(times))
    assert plan.throughput == pytest.approx(8 / plan.step_time_s)
    # The plan's own simulation is bounded below by its closed form.
    assert simulate_plan(plan).makespan_s >= plan.step_time_s * (1 - 1e-12)


def test_shared_parameter_held_by_every_stage_that_uses_it() -> None:
    prof = synthetic_profile(6, batch_size=8, tied=True, seed=5)
    (sp,) = prof.shared_params
    assert sp.units == (0, 5) and sp.bytes == prof.units[0].param_bytes
    cl = Cluster.homogeneous(3, 2**40)
    plan = evaluate(prof, cl, PlanOptions(optimizer="sgd"), [2, 4], 2, solver="t")
    own = [
        sum(u.param_bytes for u in prof.units[s.first_unit : s.last_unit + 1]) for s in plan.stages
    ]
    # The owner (stage 0) counts it once; the head's stage holds a copy; the middle stage none.
    assert [s.memory.params for s in plan.stages] == [own[0], own[1], own[2] + sp.bytes]
    last = plan.stages[2].memory
    held = last.stashed_inputs + last.activations + last.outputs + last.transient
    assert last.total == (own[2] + sp.bytes) + last.grads + held
    # A single stage holding both users keeps one copy.
    one = evaluate(prof, Cluster.homogeneous(1, 2**40), PlanOptions(), [], 2, solver="t")
    assert one.stages[0].memory.params == sum(u.param_bytes for u in prof.units)


def test_engine_overhead_charged_per_operation() -> None:
    prof = synthetic_profile(4, batch_size=8, seed=1)
    base = evaluate(prof, Cluster.homogeneous(2, 2**40), PlanOptions(), [2], 4, solver="t")
    slow = evaluate(
        prof, Cluster.homogeneous(2, 2**40, op_overhead_s=1e-3), PlanOptions(), [2], 4, solver="t"
    )
    for a, b in zip(base.stages, slow.stages):
        assert b.forward_s == pytest.approx(a.forward_s + 1e-3)
        assert b.backward_s == pytest.approx(a.backward_s + 1e-3)
    assert slow.step_time_s == pytest.approx(base.step_time_s + (2 + 3) * 2e-3)


def test_loss_charged_to_the_last_stage() -> None:
    prof = synthetic_profile(4, batch_size=8, seed=1, loss=True)
    b = 2
    loss = prof.loss[b]
    cl = Cluster.homogeneous(2, 2**40)
    opts = PlanOptions(checkpoint="never")
    plain = evaluate(prof.model_copy(update={"loss": {}}), cl, opts, [2], 4, solver="t")
    with_loss = evaluate(prof, cl, opts, [2], 4, solver="t")
    first, last = with_loss.stages
    assert first.forward_s == plain.stages[0].forward_s  # not on the first stage
    assert last.forward_s == pytest.approx(plain.stages[1].forward_s + loss.forward_s)
    assert last.backward_s == pytest.approx(plain.stages[1].backward_s + loss.backward_s)
    # Its saved tensors stay alive for every micro-batch in flight.
    # at the peak: 4 of them at the first backward, 3 at a later one (the gradients exist).
    a1 = sum(u.timings[b].saved_bytes for u in prof.units[2:])
    n_held = 4 if last.memory.grads == 0 else 3
    assert last.memory.activations == n_held * (a1 + loss.saved_bytes)
    assert plain.stages[1].memory.activations in (4 * a1, 3 * a1)


def test_plan_records_simulated_makespan() -> None:
    prof = synthetic_profile(6, batch_size=8, seed=3)
    plan = evaluate(prof, Cluster.homogeneous(3, 2**40), PlanOptions(), [2, 4], 4, solver="t")
    assert plan.simulated_step_time_s == pytest.approx(simulate_plan(plan).makespan_s)
    assert plan.simulated_step_time_s >= plan.step_time_s * (1 - 1e-12)


def test_recompute_falls_back_to_forward_plus_backward() -> None:
    prof = synthetic_profile(4, batch_size=8, microbatch_sizes=[2], seed=1)
    bare = prof.model_copy(
        update={
            "units": tuple(
                u.model_copy(
                    update={
                        "timings": {
                            b: t.model_copy(update={"recompute_backward_s": None})
                            for b, t in u.timings.items()
                        }
                    }
                )
                for u in prof.units
            )
        }
    )
    plan = evaluate(
        bare, Cluster.homogeneous(2, 2**40), PlanOptions(checkpoint="always"), [2], 4, solver="t"
    )
    f0 = sum(x.timings[2].forward_s for x in bare.units[:2])
    g0 = sum(x.timings[2].backward_s for x in bare.units[:2])
    assert plan.stages[0].backward_s == pytest.approx(f0 + g0)


def test_update_charged_by_parameter_bytes_and_ends_the_step() -> None:
    prof = synthetic_profile(6, batch_size=8, seed=2, tied=True, update_s_per_byte=2e-9)
    cl = Cluster.homogeneous(3, 2**40)
    base = prof.model_copy(update={"update_s": {}})
    for opt in ("sgd", "momentum", "adam"):
        options = PlanOptions(optimizer=opt)
        plan = evaluate(prof, cl, options, [2, 4], 4, solver="t")
        plain = evaluate(base, cl, options, [2, 4], 4, solver="t")
        rate = prof.update_s[opt] / sum(u.param_bytes for u in prof.units)
        # U_j = u w_j, the head's copy of the tied weight included; stage 0's ends the step.
        assert [s.update_s for s in plan.stages] == pytest.approx(
            [rate * s.memory.params for s in plan.stages], rel=1e-12
        )
        assert plan.stages[2].update_s > rate * sum(u.param_bytes for u in prof.units[4:])
        # The tied weight's holders (stages 0 and 2) sum its gradient (free on this link) once
        # stage 0 is done, so stage 2 updates after stage 0's last backward, not D_2 before it.
        assert [(s.stages, s.seconds) for s in plan.tied_syncs] == [((0, 2), 0.0)]
        s0, s1, s2 = plan.stages
        tail = max(s0.update_s, s2.update_s, s1.update_s - s0.backward_s - s0.comm_s / 2)
        assert plan.step_time_s == pytest.approx(plain.step_time_s + tail)
        assert plan.simulated_step_time_s is not None and plain.simulated_step_time_s is not None
        assert plan.simulated_step_time_s >= plain.simulated_step_time_s + tail
    one = evaluate(prof, Cluster.homogeneous(1, 2**40), PlanOptions(), [], 2, solver="t")
    assert one.stages[0].update_s == pytest.approx(prof.update_s["adam"], rel=1e-12)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(*identical_stages(1, 5, 8), st.floats(0.0, 1.0), st.floats(0.0, 5.0), schedules)
def test_closed_form_equals_simulator_with_updates(
    f: float, b: float, p: int, m: int, kappa: float, u: float, schedule: str
) -> None:
    # Identical stages: stage 0's update starts last, every other stage's ends before it.
    tl = simulate([f] * p, [b] * p, [0.0] * p, m, contention=kappa, schedule=schedule,
                  update_s=[u] * p)  # fmt: skip
    closed = step_time([f + b] * p, m, [f + b] * p, kappa) + u
    assert tl.makespan_s == pytest.approx(closed, rel=1e-9)
    if u > 0:
        assert [e.stage for e in tl.events if e.kind == "optimizer"] == list(range(p))


def test_a_late_stage_update_longer_than_the_drain_sets_the_makespan() -> None:
    # p = 2, m = 1, F = B = 1: stage 1 ends its backward at 3, stage 0 at 4.  Stage 1's update
    # of 5 outlasts stage 0's backward and update (1): the step ends at 3 + 5 = 8, and the
    # closed form's tail R = max(U_0, U_1 - B_0) = 4 says so.
    tl = simulate([1.0, 1.0], [1.0, 1.0], [0.0, 0.0], 1, update_s=[1.0, 5.0])
    assert tl.makespan_s == pytest.approx(8.0)
    assert update_tail([1.0, 5.0], [1.0, 1.0], [0.0, 0.0]) == pytest.approx(4.0)
    assert step_time([2.0, 2.0], 1) + 4.0 == pytest.approx(8.0)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(floats, min_size=4, max_size=4),
    st.integers(1, 12),
    st.floats(0.0, 1.0),
    st.lists(st.floats(0.0, 20.0), min_size=2, max_size=2),
    st.sampled_from([0.0, 0.0, 0.5, 7.0]),
)
def test_two_stage_closed_form_equals_simulator(
    fb: list[float], m: int, kappa: float, upd: list[float], tied: float
) -> None:
    # Two stages, stage 1 the bottleneck forward and backward: T(m) is the simulator's
    # makespan, with contention (a light stage slows the heavy one only for its own work),
    # with any updates (stage 1's starts B_0 before stage 0's) and with a tied parameter's
    # all-reduce (both wait for stage 0, then sum for ``tied`` seconds, then update).
    f0, f1 = sorted(fb[:2])
    b0, b1 = sorted(fb[2:])
    syncs = [TiedSync(stages=(0, 1), bytes=1, seconds=tied)] if tied else []
    pairs = [((0, 1), tied)] if tied else []
    tl = simulate([f0, f1], [b0, b1], [0.0, 0.0], m, contention=kappa, update_s=upd, syncs=pairs)
    closed = step_time([f0 + b0, f1 + b1], m, [f0 + b0, f1 + b1], kappa) + update_tail(
        upd, [b0, b1], [0.0, 0.0], syncs
    )
    assert tl.makespan_s == pytest.approx(closed, rel=1e-9)
    if tied:
        assert closed == pytest.approx(
            step_time([f0 + b0, f1 + b1], m, [f0 + b0, f1 + b1], kappa) + tied + max(upd)
        )
    # Stage 0 the bottleneck instead: the pipeline part is still exact, the tail errs high.
    tl = simulate([f1, f0], [b1, b0], [0.0, 0.0], m, contention=kappa, update_s=upd, syncs=pairs)
    closed = step_time([f1 + b1, f0 + b0], m, [f1 + b1, f0 + b0], kappa)
    assert closed + update_tail(upd, [b1, b0], [0.0, 0.0], syncs) >= tl.makespan_s * (1 - 1e-9)
    assert closed <= tl.makespan_s * (1 + 1e-9)


def test_a_one_stage_plan_pays_the_solo_engine_cost() -> None:
    # calibrate measures the engine alone on one rank; a 1-stage plan pays that o, a pipeline
    # of several ranks the one measured with transfers and peers.
    prof = synthetic_profile(4, batch_size=8, microbatch_sizes=[2], seed=3)
    base = Cluster.homogeneous(2, 2**40, op_overhead_s=5e-4)
    solo = base.model_copy(update={"solo_op_overhead_s": 1e-4})
    options = PlanOptions(checkpoint="never")
    one = [c.model_copy(update={"devices": c.devices[:1]}) for c in (base, solo)]
    plain, alone = (evaluate(prof, c, options, [], 4, solver="t") for c in one)
    assert plain.stages[0].forward_s - alone.stages[0].forward_s == pytest.approx(4e-4)
    assert plain.step_time_s - alone.step_time_s == pytest.approx(2 * 4 * 4e-4)
    two = [evaluate(prof, c, options, [2], 4, solver="t").step_time_s for c in (base, solo)]
    assert two[0] == two[1]


def test_the_engine_fixed_cost_per_step_is_paid_once() -> None:
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[2], seed=5)
    base = Cluster.homogeneous(3, 2**40, op_overhead_s=2e-4, contention=0.3)
    fixed = base.model_copy(update={"step_overhead_s": 1.5e-3})
    a, b = (evaluate(prof, c, PlanOptions(), [2, 4], 4, solver="t") for c in (base, fixed))
    assert b.step_time_s == pytest.approx(a.step_time_s + 1.5e-3, rel=1e-12)
    assert a.simulated_step_time_s is not None and b.simulated_step_time_s is not None
    assert b.simulated_step_time_s == pytest.approx(a.simulated_step_time_s + 1.5e-3, rel=1e-9)
    timeline = simulate_plan(b)  # the first operation waits for the step's set-up
    assert min(e.start_s for e in timeline.events) == pytest.approx(1.5e-3)
    assert timeline.makespan_s == pytest.approx(b.simulated_step_time_s)


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
    schedules,
)
def test_contended_tail_equals_simulator(
    stages: list[tuple[float, float, float, float]],
    sets: list[tuple[set[int], float]],
    kappa_u: float,
    kappa: float,
    schedule: str,
) -> None:
    # One micro-batch: every stage's last backward ends exactly D_j before stage 0's, so the
    # step is sum_j t_j plus the tail, and the simulator's updates (integrated between events)
    # must end where the closed form's shared virtual time puts them.  Every cut has its own
    # transfer: D_j counts the gradient's trip across each cut before stage j.
    p = len(stages)
    fwd = [s[0] for s in stages]
    back = [s[1] for s in stages]
    comm = [s[2] for s in stages[:-1]] + [0.0]
    upd = [s[3] * (1 + j) / p for j, s in enumerate(stages)]
    syncs = [TiedSync(stages=tuple(sorted(st_)), bytes=1, seconds=a) for st_, a in sets
             if max(st_) < p]  # fmt: skip
    pairs = [(s.stages, s.seconds) for s in syncs]
    tl = simulate(fwd, back, comm, 1, schedule=schedule, contention=kappa, update_s=upd,
                  syncs=pairs, update_contention=kappa_u)  # fmt: skip
    times = [f + b + c for f, b, c in zip(fwd, back, comm)]
    closed = step_time(times, 1) + update_tail(upd, back, comm, syncs, kappa_u)
    assert tl.makespan_s == pytest.approx(closed, rel=1e-9, abs=1e-12)
    ops = [e for e in tl.events if e.kind == "optimizer"]
    assert [e.stage for e in ops] == [j for j in range(p) if upd[j] > 0]
    # Each update lasts at least its work, and at most 1 + kappa_u (p - 1) times it.
    for e in ops:
        u = upd[e.stage]
        assert u * (1 - 1e-9) <= e.end_s - e.start_s <= u * (1 + kappa_u * (p - 1)) + 1e-9


@settings(max_examples=100, deadline=None, derandomize=True)
@given(*identical_stages(2, 5, 8), st.floats(0.0, 5.0), st.floats(0.1, 1.0), schedules)
def test_identical_stages_with_contended_updates_equal_simulator(
    f: float, b: float, p: int, m: int, u: float, kappa_u: float, schedule: str
) -> None:
    # Identical stages, no compute contention (it would stretch the drain's backwards):
    # stage j's update starts j b before stage 0's and overlaps the ones after it when u > b;
    # the closed form's tail is the simulator's.
    tl = simulate([f] * p, [b] * p, [0.0] * p, m, schedule=schedule, update_s=[u] * p,
                  update_contention=kappa_u)  # fmt: skip
    closed = step_time([f + b] * p, m)
    tail = update_tail([u] * p, [b] * p, [0.0] * p, kappa_u=kappa_u)
    assert tl.makespan_s == pytest.approx(closed + tail, rel=1e-9)
    if u > b:  # stage 0's update overlaps stage 1's: slower than alone
        assert tail > u


def test_evaluate_charges_update_contention_as_the_simulator_does() -> None:
    # One micro-batch (exact drains), three stages whose updates outlast the drain, and a tied
    # weight on stages 0 and 2, which update together after its all-reduce.
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[8], seed=4, tied=True,
                             update_s_per_byte=3e-8)  # fmt: skip
    link = Link(bandwidth_Bps=1e9, latency_s=1e-5)
    for kappa_u in (0.0, 0.3):
        cl = Cluster.homogeneous(3, 2**40, link, op_overhead_s=1e-4, update_contention=kappa_u)
        plan = evaluate(prof, cl, PlanOptions(), [2, 4], 1, solver="t")
        assert plan.simulated_step_time_s == pytest.approx(plan.step_time_s, rel=1e-9)
        assert simulate_plan(plan).makespan_s == pytest.approx(plan.step_time_s, rel=1e-9)
        if kappa_u == 0.0:
            plain = plan.step_time_s
    s0, _, s2 = plan.stages
    (sync,) = plan.tied_syncs
    assert sync.stages == (0, 2)
    assert min(s0.update_s, s2.update_s) > 0
    # At least the two holders' shared stretch: kappa_u times the shorter of them.
    assert plan.step_time_s >= plain + 0.3 * min(s0.update_s, s2.update_s) * (1 - 1e-9)
    assert plan.step_time_s <= plain + 0.3 * sum(s.update_s for s in plan.stages) + 1e-12
    # Old cluster files (no update_contention) read as 0; new ones keep it.
    data = cl.model_dump(mode="json", by_alias=True)
    assert Cluster.model_validate(data).update_contention == 0.3
    del data["update_contention"]
    assert Cluster.model_validate(data).update_contention == 0.0


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.integers(0, 10**6),
    st.integers(2, 8),
    st.integers(1, 5),
    st.sampled_from([1, 2, 8]),
    schedules,
    st.sampled_from([0.0, 3e-8]),
    st.booleans(),
    st.sampled_from([0.0, 0.4, 1.5]),
    st.sampled_from([0.0, 0.3]),
    st.floats(0.0, 1.0),
)
def test_auto_is_the_best_per_stage_choice(
    seed: int,
    n: int,
    p: int,
    m: int,
    schedule: str,
    update: float,
    tied: bool,
    kappa: float,
    kappa_u: float,
    tightness: float,
) -> None:
    """For any partition and m, keeping where it fits and recomputing elsewhere gives the least
    step time over all 2^p per-stage choices that fit (the rule's exactness, which the solvers'
    tables rely on), and never more than the best fixed policy."""
    p = min(p, n)
    prof = synthetic_profile(n, batch_size=8, seed=seed, tied=tied, loss=True,
                             update_s_per_byte=update, checkpoint_call_s=(3e-5, 6e-5))  # fmt: skip
    cuts = sorted(random.Random(seed).sample(range(1, n), p - 1))
    big = Cluster.homogeneous(p, 2**50, Link(bandwidth_Bps=1e9), op_overhead_s=1e-4)
    big = big.model_copy(update={"contention": kappa, "update_contention": kappa_u})
    opts = PlanOptions.model_validate({"checkpoint": "auto", "schedule": schedule,
                                       "microbatches": m})  # fmt: skip
    keep = evaluate(prof, big, opts, cuts, m, solver="t", recompute=[False] * p)
    rc = evaluate(prof, big, opts, cuts, m, solver="t", recompute=[True] * p)
    lo = min(s.memory.total for s in rc.stages)
    hi = max(s.memory.total for s in keep.stages)
    cap = int(lo + tightness * (hi - lo))  # from nothing keeping to everything keeping
    clus = big.model_copy(
        update={"devices": tuple(d.model_copy(update={"memory_bytes": cap}) for d in big.devices)}
    )
    auto = evaluate(prof, clus, opts, cuts, m, solver="t")
    fitting = []
    for choice in itertools.product((False, True), repeat=p):
        plan = evaluate(prof, clus, opts, cuts, m, solver="t", recompute=choice)
        if plan.feasible:
            fitting.append(plan.step_time_s)
    assert auto.feasible == bool(fitting)
    if fitting:
        assert auto.step_time_s <= min(fitting) * (1 + 1e-12)
        for policy in ("always", "except_last", "never"):
            fixed = evaluate(prof, clus, opts.model_copy(update={"checkpoint": policy}), cuts, m,
                             solver="t")  # fmt: skip
            if fixed.feasible:
                assert auto.step_time_s <= fixed.step_time_s * (1 + 1e-12)
    assert [s.recompute for s in auto.stages] == [
        s.memory.total > cap for s in keep.stages
    ]  # exactly the stages that cannot keep recompute
