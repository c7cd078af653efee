"""A partition evaluated into a Plan: the closed form's step beside the simulated one."""

from __future__ import annotations

import pytest

from pipeplan.planner.evaluate import evaluate, stage_record
from pipeplan.planner.replay import replay_plan
from pipeplan.planner.types import Cluster, Link, PlanOptions
from pipeplan.profiler.synthetic import synthetic_profile


def test_plan_records_simulated_makespan() -> None:
    prof = synthetic_profile(6, batch_size=8, seed=3)
    plan = evaluate(prof, Cluster.homogeneous(3, 2**40), PlanOptions(), [2, 4], 4, solver="t")
    assert plan.simulated_step_time_s == replay_plan(plan, timeline=False).makespan_s
    assert plan.simulated_step_time_s == pytest.approx(replay_plan(plan).makespan_s, rel=1e-12)
    assert plan.simulated_step_time_s >= plan.step_time_s * (1 - 1e-12)
    # torch's 1F1B class refuses fewer micro-batches than stages: no simulated step
    one_f = evaluate(prof, Cluster.homogeneous(3, 2**40), PlanOptions(schedule="1f1b"), [2, 4], 2,
                     solver="t")  # fmt: skip
    assert one_f.simulated_step_time_s is None and one_f.step_time_s > 0


def test_the_engine_fixed_cost_per_step_is_paid_once() -> None:
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[2], seed=5)
    base = Cluster.homogeneous(3, 2**40, op_overhead_s=2e-4, contention=0.3)
    fixed = base.model_copy(update={"step_overhead_s": 1.5e-3})
    a, b = (evaluate(prof, c, PlanOptions(), [2, 4], 4, solver="t") for c in (base, fixed))
    assert b.step_time_s == pytest.approx(a.step_time_s + 1.5e-3, rel=1e-12)
    assert a.simulated_step_time_s is not None and b.simulated_step_time_s is not None
    assert b.simulated_step_time_s == pytest.approx(a.simulated_step_time_s + 1.5e-3, rel=1e-9)


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
        assert replay_plan(plan).makespan_s == pytest.approx(plan.step_time_s, rel=1e-9)
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


def test_stage_record_is_the_one_builder_of_a_stage() -> None:
    prof = synthetic_profile(6, batch_size=8, seed=3)
    cluster = Cluster.homogeneous(3, 2**30)
    plan = evaluate(prof, cluster, PlanOptions(), [2, 4], 4, solver="t")
    for s, dev in zip(plan.stages, cluster.devices, strict=True):
        times = (s.forward_s, s.backward_s, s.comm_s)
        args = (prof, s.index, dev, s.first_unit, s.last_unit, s.recompute, times, s.update_s)
        assert stage_record(*args, s.memory, s.memory.total) == s
        over = stage_record(*args, s.memory, dev.memory_bytes + 1, (1.0, 2.0))
        assert not over.feasible and (over.backward_input_s, over.backward_weight_s) == (1.0, 2.0)
