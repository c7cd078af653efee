"""The data-parallel axis's cost model: collectives, the update tail and the training state."""

from __future__ import annotations

import pytest

from pipeplan.planner.collectives import collective_cost, state_factors
from pipeplan.planner.costmodel import stage_memory, stage_params
from pipeplan.planner.types import Cluster, Link, PlanOptions
from pipeplan.planner.unitcosts import unit_costs
from pipeplan.planner.updates import update_cost
from pipeplan.profiler.synthetic import synthetic_profile

LINK = Link(bandwidth_Bps=1e9, latency_s=2e-5, overhead_s=1e-5)


def _cluster(d: int, mode: str = "replicate", **extra: object) -> Cluster:
    return Cluster.homogeneous(2, 2**40, LINK).model_copy(
        update={"data_parallel": d, "data_parallel_mode": mode, **extra}
    )


@pytest.mark.parametrize("d", [2, 4, 16])
def test_ring_collectives(d: int) -> None:
    """Thakur et al.'s ring: all-reduce is a reduce-scatter then an all-gather."""
    c = _cluster(d)
    a = 30e-6  # latency + overhead per message
    assert collective_cost(c, "all_reduce") == pytest.approx(
        (2 * (d - 1) / d / 1e9, 2 * (d - 1) * a)
    )
    for kind in ("reduce_scatter", "all_gather"):
        assert collective_cost(c, kind) == pytest.approx(((d - 1) / d / 1e9, (d - 1) * a))
    assert collective_cost(_cluster(1), "all_reduce") == (0.0, 0.0)


def test_the_replicas_own_link_is_used() -> None:
    c = _cluster(4, replica_link=Link(bandwidth_Bps=1e8))
    assert collective_cost(c, "all_gather") == pytest.approx((0.75 / 1e8, 0.0))


def test_a_measured_collective_is_rescaled_to_d_ranks() -> None:
    """Measured at 2 ranks: per byte (d - 1) / d over 1 / 2, per message (d - 1) over 1."""
    c = _cluster(8, collectives={"all_gather": (2e-9, 1e-4)}, collective_ranks=2)
    assert collective_cost(c, "all_gather") == pytest.approx((2e-9 * (7 / 8) / 0.5, 7e-4))
    assert collective_cost(c.model_copy(update={"data_parallel": 2}), "all_gather") == (2e-9, 1e-4)
    # a kind not measured is the ring on the link
    assert collective_cost(c, "reduce_scatter") == pytest.approx((7 / 8 / 1e9, 7 * 30e-6))


@pytest.mark.parametrize(("optimizer", "s"), [("sgd", 0), ("momentum", 1), ("adam", 2)])
@pytest.mark.parametrize("d", [1, 2, 8])
def test_state_factors(optimizer: str, s: int, d: int) -> None:
    assert state_factors(optimizer, _cluster(d)).total == 2 + s
    sharded = state_factors(optimizer, _cluster(d, "shard"))
    if d == 1:  # one rank shards nothing
        assert sharded == state_factors(optimizer, _cluster(1))
    else:
        assert (sharded.params, sharded.grads, sharded.optimizer) == pytest.approx(
            (1 + 1 / d, 1.0, s / d)
        )


def test_update_tail_per_mode() -> None:
    """replicate: AR(w) + U(w); shard: RS(w) + U(w / d) + AG(w)."""
    prof = synthetic_profile(6, batch_size=8, update_s_per_byte=3e-9)
    w = 5e6
    base = update_cost(prof, "adam").seconds(w)
    assert base > 0
    d = 4
    ar = collective_cost(_cluster(d), "all_reduce")
    rs = collective_cost(_cluster(d, "shard"), "reduce_scatter")
    ag = collective_cost(_cluster(d, "shard"), "all_gather")
    replicated = update_cost(prof, "adam", _cluster(d)).seconds(w)
    sharded = update_cost(prof, "adam", _cluster(d, "shard")).seconds(w)
    assert replicated == pytest.approx(ar[0] * w + ar[1] + base)
    expected = rs[0] * w + rs[1] + update_cost(prof, "adam").seconds(w / d) + ag[0] * w + ag[1]
    assert sharded == pytest.approx(expected)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_stage_memory_per_mode(optimizer: str) -> None:
    """A stage's parameters, gradients and optimizer states follow the state factors; the
    activations and buffers do not depend on the mode."""
    prof = synthetic_profile(6, batch_size=8)
    costs = unit_costs(prof, 4)
    options = PlanOptions(optimizer=optimizer, checkpoint="never")  # type: ignore[arg-type]
    w = stage_params(costs, 0, 2)
    rep = stage_memory(costs, _cluster(4), options, 0, 2, 0)
    sh = stage_memory(costs, _cluster(4, "shard"), options, 0, 2, 0)
    s = {"sgd": 0, "adam": 2}[optimizer]
    assert (rep.params, rep.optimizer) == (w, s * w)
    assert (sh.params, sh.optimizer) == (int(1.25 * w), int(s * w / 4))
    assert sh.grads in (0, w) and rep.grads in (0, w)
    rest = ("stashed_inputs", "gradient_buffers", "outputs")
    assert [getattr(rep, k) for k in rest] == [getattr(sh, k) for k in rest]
    assert (sh.total < rep.total) == (optimizer == "adam")  # SGD has no state to shard


@pytest.mark.parametrize(("kind", "d"), [("cpu", 2), ("cpu", 4), ("cuda", 2)])
def test_a_parameter_heavy_sharded_stage_peaks_at_its_reduction(kind: str, d: int) -> None:
    """After its last backward a sharded stage holds its shard, a flat copy of its gradients
    and the reduce-scatter's output (1 / d + max(2, 1 + 1 / d + g) per parameter byte, g = 1
    on gloo) beside the optimizer's states and the buffers; on a parameter-heavy stage that
    is the peak on gloo, and never above the backward's on nccl."""
    prof = synthetic_profile(6, batch_size=8)
    prof = prof.model_copy(update={
        "device": prof.device.model_copy(update={"kind": kind}),
        "units": tuple(u.model_copy(update={"param_bytes": 64 << 20}) for u in prof.units),
    })  # fmt: skip
    costs = unit_costs(prof, 4)
    assert costs.gloo == (kind == "cpu")
    options = PlanOptions(optimizer="adam", checkpoint="never")
    w = stage_params(costs, 0, 2)
    sh = stage_memory(costs, _cluster(d, "shard"), options, 0, 2, 0)
    buffers = sh.stashed_inputs + sh.gradient_buffers
    reduce = (1 / d + max(2.0, 1 + 1 / d + (kind == "cpu")) + 2 / d) * w + buffers
    if kind == "cpu":  # the reduction sets the peak: what it adds is charged as transient
        assert sh.total == pytest.approx(reduce, rel=1e-6) and sh.transient > 0
    else:
        assert sh.total >= reduce
    rep = stage_memory(costs, _cluster(d), options, 0, 2, 0)
    assert rep.total == sum(rep.model_dump(exclude={"total"}).values())  # replicate: no term
