"""The closed form against the step simulator (the replay), and the memory model's terms."""

from __future__ import annotations

import itertools
import random

import pytest
from _one_chunk import one_chunk
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipeplan.planner.costmodel import in_flight, recomputes, step_time
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.replay import replay_plan
from pipeplan.planner.types import Cluster, Link, PlanOptions, TiedSync
from pipeplan.planner.updates import update_tail
from pipeplan.profiler.synthetic import synthetic_profile

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
    tl = one_chunk(fwd, back, c, m)
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
    sim = one_chunk(fwd, back, comm, m).makespan_s
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
    assume(schedule == "gpipe" or m >= p)  # torch's 1F1B runs m >= p
    tl = one_chunk([f] * p, [b] * p, [0.0] * p, m, contention=kappa, schedule=schedule)
    closed = step_time([f + b] * p, m, [f + b] * p, kappa)
    assert tl.makespan_s == pytest.approx(closed, rel=1e-9)
    if p > 1 and m > 1:
        expected = (f + b) * (p + m - 1 + kappa * (p - 1) * (m - 1))
        assert closed == pytest.approx(expected, rel=1e-12)
    else:
        assert closed == pytest.approx((f + b) * (p + m - 1), rel=1e-12)


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
    assert replay_plan(plan).makespan_s >= plan.step_time_s * (1 - 1e-12)


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
    assume(schedule == "gpipe" or m >= p)  # torch's 1F1B runs m >= p
    tl = one_chunk([f] * p, [b] * p, [0.0] * p, m, contention=kappa, schedule=schedule,
                  update_s=[u] * p)  # fmt: skip
    closed = step_time([f + b] * p, m, [f + b] * p, kappa) + u
    assert tl.makespan_s == pytest.approx(closed, rel=1e-9)
    if u > 0:
        assert [e.rank for e in tl.events if e.kind == "optimizer"] == list(range(p))


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
    tl = one_chunk([f0, f1], [b0, b1], [0.0, 0.0], m, contention=kappa, update_s=upd, syncs=pairs)
    closed = step_time([f0 + b0, f1 + b1], m, [f0 + b0, f1 + b1], kappa) + update_tail(
        upd, [b0, b1], [0.0, 0.0], syncs
    )
    assert tl.makespan_s == pytest.approx(closed, rel=1e-9)
    if tied:
        assert closed == pytest.approx(
            step_time([f0 + b0, f1 + b1], m, [f0 + b0, f1 + b1], kappa) + tied + max(upd)
        )
    # Stage 0 the bottleneck instead: the pipeline part is still exact, the tail errs high.
    tl = one_chunk([f1, f0], [b1, b0], [0.0, 0.0], m, contention=kappa, update_s=upd, syncs=pairs)
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
