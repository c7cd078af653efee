"""Planning for N devices: depth p times replicas N / p, against brute force."""

from __future__ import annotations

import itertools

import pytest
from _solver_strategies import with_split

from pipeplan.planner.collectives import collective_cost
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.types import Cluster, Link, Plan, PlanOptions, Profile
from pipeplan.planner.unitcosts import microbatch_choices
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.choose import solve
from pipeplan.solvers.devices import layout, plan_devices, replica_profile
from pipeplan.solvers.dp import solve_dp
from pipeplan.solvers.multichunk import schedule_floor

LINK = Link(bandwidth_Bps=2e8, latency_s=2e-4)


def _brute_force(
    profile: Profile, devices: int, memory: int, options: PlanOptions, batch: int | None = None
) -> float:
    """The best global throughput over every depth, mode, partition and m."""
    best = 0.0
    batch = batch or profile.batch_size
    for p in (p for p in range(1, devices + 1) if devices % p == 0 and p <= profile.n_units):
        d = devices // p
        if batch % d:
            continue
        share = replica_profile(profile, d, batch)
        for mode in ("replicate", "shard"):
            clus = Cluster.homogeneous(p, memory, LINK).model_copy(
                update={"data_parallel": d, "data_parallel_mode": mode}
            )
            for m in microbatch_choices(share, options, p):
                for cuts in itertools.combinations(range(1, profile.n_units), p - 1):
                    plan = evaluate(share, clus, options, cuts, m, solver="brute")
                    if plan.feasible:
                        best = max(best, plan.throughput * d)
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("squeeze", [None, 0.6, 0.4])
@pytest.mark.parametrize("batch", [None, 32])
def test_the_best_depth_is_the_brute_force_optimum(
    seed: int, squeeze: float | None, batch: int | None
) -> None:
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[1, 2, 4, 8], seed=seed, tied=True)
    options = PlanOptions()
    one = solve_dp(prof, Cluster.homogeneous(1, 2**40))
    memory = 2**40 if squeeze is None else int(one.stages[0].memory.total * squeeze)
    want = _brute_force(prof, 4, memory, options, batch)
    clus = Cluster.homogeneous(1, memory, LINK)
    choices = plan_devices(prof, 4, clus, options, solve_dp, global_batch=batch)
    assert {(c.stages, c.replicas, c.mode) for c in choices} == {
        (1, 4, "replicate"), (1, 4, "shard"), (2, 2, "replicate"), (2, 2, "shard"),
        (4, 1, "replicate"),
    }  # fmt: skip
    best = choices[0]
    if want == 0.0:
        assert best.plan is None
        return
    assert best.plan is not None
    assert best.throughput == pytest.approx(want, rel=1e-9)
    assert all(best.throughput >= c.throughput for c in choices)
    assert best.plan.layout == layout(best.stages, best.replicas)
    assert best.plan.cluster.data_parallel == best.replicas
    assert best.plan.cluster.data_parallel_mode == best.mode
    assert best.plan.batch_size * best.replicas == (batch or prof.batch_size)


def test_sharding_fits_where_replicas_do_not() -> None:
    """Adam's states dominate a stage: at a limit below a whole replica's state, only the
    sharded mode plans the shallow pipelines."""
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[1, 2, 4, 8], seed=0)
    whole = solve_dp(prof, Cluster.homogeneous(1, 2**40), PlanOptions(microbatches=8))
    memory = int(whole.stages[0].memory.total * 0.6)
    choices = plan_devices(prof, 4, Cluster.homogeneous(1, memory, LINK), PlanOptions(), solve_dp)
    by = {(c.stages, c.mode): c for c in choices}
    assert by[(1, "replicate")].plan is None and by[(1, "shard")].plan is not None
    shard = by[(1, "shard")].plan
    assert shard.stages[0].memory.optimizer < whole.stages[0].memory.optimizer / 3


def test_a_fixed_data_parallel_degree() -> None:
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[1, 2, 4, 8], seed=0)
    clus = Cluster.homogeneous(1, 2**40, LINK)
    choices = plan_devices(prof, 8, clus, PlanOptions(), solve_dp, replicas=2)
    assert {(c.stages, c.replicas) for c in choices} == {(4, 2)}
    with pytest.raises(InvalidRequestError, match="--dp 3 does not divide --devices 8"):
        plan_devices(prof, 8, clus, PlanOptions(), solve_dp, replicas=3)
    only = plan_devices(prof, 4, clus, PlanOptions(), solve_dp, modes=("shard",))
    assert {c.mode for c in only if c.replicas > 1} == {"shard"}


def test_each_stage_pays_the_ring_all_reduce_of_its_gradients_before_its_update() -> None:
    prof = synthetic_profile(4, batch_size=8, microbatch_sizes=[2, 4], seed=1)
    share = replica_profile(prof, 2)
    assert (share.batch_size, share.microbatch_sizes) == (4, (2, 4))
    one = Cluster.homogeneous(2, 2**40, LINK)
    two = one.model_copy(update={"data_parallel": 2})
    alpha, beta = collective_cost(two, "all_reduce")
    assert alpha == pytest.approx(2 * 1 / 2 / 2e8) and beta == pytest.approx(2 * 2e-4)
    base = evaluate(share, one, PlanOptions(), [2], 2, solver="t")
    dp = evaluate(share, two, PlanOptions(), [2], 2, solver="t")
    for a, b in zip(base.stages, dp.stages, strict=True):
        assert b.update_s == pytest.approx(a.update_s + alpha * a.memory.params + beta)
    assert dp.step_time_s > base.step_time_s
    assert collective_cost(one, "all_reduce") == (0.0, 0.0)


def test_bad_requests() -> None:
    prof = synthetic_profile(4, batch_size=6, microbatch_sizes=[1, 2, 3, 6], seed=1)
    clus = Cluster.homogeneous(1, 2**40)
    with pytest.raises(InvalidRequestError, match="--devices 0"):
        plan_devices(prof, 0, clus, PlanOptions(), solve_dp)
    mixed = Cluster.homogeneous(2, 2**40)
    mixed = mixed.model_copy(
        update={"devices": (mixed.devices[0], mixed.devices[1].model_copy(update={"speed": 2.0}))}
    )
    with pytest.raises(InvalidRequestError, match="identical devices"):
        plan_devices(prof, 2, mixed, PlanOptions(), solve_dp)
    choices = {c.stages: c for c in plan_devices(prof, 8, clus, PlanOptions(), solve_dp)}
    assert "global batch 6 does not split over 4 data-parallel ranks" in choices[2].reason
    with pytest.raises(InvalidRequestError, match="global batch 0 must be at least 1"):
        replica_profile(prof, 1, 0)
    with pytest.raises(InvalidRequestError, match="no profiled micro-batch size divides"):
        replica_profile(prof.model_copy(update={"microbatch_sizes": (2, 3, 6)}), 1, 5)
    assert "more stages than the 4 units" in choices[8].reason
    assert choices[8].throughput == 0.0


def test_a_floor_skips_pairs_that_cannot_win_and_keeps_the_best() -> None:
    """With the schedule solver's floor, pairs whose bound is no less than the best step found
    are not searched (they get the quick plan); the best pair is the one found without it."""
    prof = with_split(
        synthetic_profile(8, batch_size=16, microbatch_sizes=[1, 2, 4], seed=3, heavy_ends=True)
    )
    clus = Cluster.homogeneous(1, 2**40, LINK)
    options = PlanOptions(schedule="auto")
    full = plan_devices(prof, 4, clus, options, solve, global_batch=32)
    calls: list[tuple[int, str]] = []

    def counted(pr: Profile, cl: Cluster, op: PlanOptions) -> Plan:
        calls.append((cl.n_stages, cl.data_parallel_mode))
        return solve(pr, cl, op)

    pruned = plan_devices(
        prof, 4, clus, options, counted, global_batch=32, floor=schedule_floor, quick=solve_dp
    )
    assert pruned[0].plan is not None and full[0].plan is not None
    assert pruned[0].throughput == pytest.approx(full[0].throughput, rel=1e-12)
    floors = {
        (c.stages, c.mode): schedule_floor(
            replica_profile(prof, c.replicas, 32),
            clus.model_copy(
                update={
                    "devices": clus.devices * c.stages,
                    "data_parallel": c.replicas,
                    "data_parallel_mode": c.mode,
                }
            ),
            options,
        )
        for c in pruned
    }
    best = full[0].plan.simulated_step_time_s or full[0].plan.step_time_s
    assert 0 < len(calls) < len(pruned)  # some pairs were skipped, and not all
    for c in pruned:
        if (c.stages, c.mode) not in calls:  # skipped: its floor could not beat the best
            assert floors[(c.stages, c.mode)] >= best * (1 - 1e-12)


def test_refine_searches_only_the_best_seeded_pairs_again() -> None:
    """With ``refine`` = 1, every pair is first planned from the seeds alone (search_work 0);
    then only the pair with the fastest such plan is searched with the request's budget, and
    its plan is the one a full search of that pair alone gives."""
    prof = with_split(
        synthetic_profile(8, batch_size=16, microbatch_sizes=[1, 2, 4], seed=3, heavy_ends=True)
    )
    clus = Cluster.homogeneous(1, 2**40, LINK)
    options = PlanOptions(schedule="auto", search_work=20_000)
    calls: list[tuple[int, str, int | None]] = []

    def counted(pr: Profile, cl: Cluster, op: PlanOptions) -> Plan:
        calls.append((cl.n_stages, cl.data_parallel_mode, op.search_work))
        return solve(pr, cl, op)

    got = plan_devices(prof, 4, clus, options, counted, global_batch=32, refine=1)
    seeded = [c for c in calls if c[2] == 0]
    again = [c for c in calls if c[2] == 20_000]
    assert len(seeded) + len(again) == len(calls) and len(seeded) == len(got) - 0
    assert len(again) == 1
    p, mode, _ = again[0]
    (pair,) = [c for c in got if (c.stages, c.mode) == (p, mode)]
    share = replica_profile(prof, pair.replicas, 32)
    alone = solve(share, pair.plan.cluster, options)  # type: ignore[union-attr]
    assert pair.plan is not None
    assert pair.plan.simulated_step_time_s == pytest.approx(alone.simulated_step_time_s, rel=1e-12)
    # the refined pair was the best seeded one, and nothing beats the refined best
    light = plan_devices(
        prof, 4, clus, options.model_copy(update={"search_work": 0}), solve, global_batch=32
    )
    fastest = min((c for c in light if c.plan), key=lambda c: c.plan.simulated_step_time_s)  # type: ignore[union-attr]
    assert (fastest.stages, fastest.mode) == (p, mode)
    assert got[0].throughput >= fastest.throughput * (1 - 1e-12)


def test_refine_with_as_many_pairs_searches_each_once() -> None:
    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[1, 2, 4], seed=1)
    clus = Cluster.homogeneous(1, 2**40, LINK)
    options = PlanOptions(schedule="auto", search_work=5_000)
    works: list[int | None] = []

    def counted(pr: Profile, cl: Cluster, op: PlanOptions) -> Plan:
        works.append(op.search_work)
        return solve(pr, cl, op)

    got = plan_devices(prof, 2, clus, options, counted, replicas=2, refine=2)
    assert works == [5_000, 5_000]  # one depth, two modes: each searched once, fully
    assert [c.plan is not None for c in got] == [True, True]


def _split(prof: Profile) -> Profile:
    """Every unit but the first split over t ranks (heads 4: t in 1, 2, 4)."""
    from pipeplan.planner.types import UnitTensorParallel

    units = tuple(
        u if u.index == 0 else u.model_copy(update={"tensor_parallel": UnitTensorParallel(
            styles={"q": "colwise", "o": "rowwise"}, divisors={"heads": 4},
            sharded_param_bytes=int(0.9 * u.param_bytes), sharded_flop_fraction=0.8,
            sharded_saved_fraction=0.5, allreduces=2, allreduce_bytes_per_sample=4000)})
        for u in prof.units
    )  # fmt: skip
    return prof.model_copy(update={"units": units})


INTRA = Link(bandwidth_Bps=2e9, latency_s=2e-5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("squeeze", [None, 0.5, 0.3])
def test_the_best_mesh_is_the_brute_force_optimum(seed: int, squeeze: float | None) -> None:
    """8 devices, 4 per node: every (p, t, d, mode), partition and m, each on the per-rank
    profile and the links of its layout, against plan_devices' best."""
    from pipeplan.solvers.devices import axis_links, tensor_degrees
    from pipeplan.solvers.tensor_parallel import tp_profile

    prof = _split(synthetic_profile(5, batch_size=8, microbatch_sizes=[1, 2, 4, 8], seed=seed))
    one = solve_dp(prof, Cluster.homogeneous(1, 2**40))
    memory = 2**40 if squeeze is None else int(one.stages[0].memory.total * squeeze)
    base = Cluster.homogeneous(1, memory, LINK).model_copy(
        update={"devices_per_node": 4, "intra_node_link": INTRA}
    )
    degrees, skipped = tensor_degrees(prof, 8, base)
    assert degrees == (1, 2, 4) and skipped == ()
    options = PlanOptions()
    best, where = 0.0, None
    for t in degrees:
        per = tp_profile(prof, base.model_copy(update={"tensor_parallel": t}))
        for p in (p for p in range(1, 8 // t + 1) if (8 // t) % p == 0 and p <= prof.n_units):
            d = 8 // (t * p)
            share = replica_profile(per, d)
            for mode in ("replicate", "shard"):
                clus = axis_links(base, p, t, d).model_copy(update={
                    "devices": Cluster.homogeneous(p, memory).devices, "data_parallel": d,
                    "data_parallel_mode": mode, "tensor_parallel": t})  # fmt: skip
                for m in microbatch_choices(share, options, p):
                    for cuts in itertools.combinations(range(1, prof.n_units), p - 1):
                        plan = evaluate(share, clus, options, cuts, m, solver="brute")
                        if plan.feasible and plan.throughput * d > best:
                            best, where = plan.throughput * d, (p, t, d)
    choices = plan_devices(prof, 8, base, options, solve_dp, tensor_parallels=degrees)
    assert {c.tensor_parallel for c in choices} == {1, 2, 4}
    # Adam on modelled rings: shard dominates, so replicate is not planned (the brute force
    # above weighs both, and agrees on the best)
    assert all(c.plan is None and "shard holds less" in c.reason
               for c in choices if c.mode == "replicate" and c.replicas > 1)  # fmt: skip
    top = choices[0]
    assert top.plan is not None and where is not None
    assert top.throughput == pytest.approx(best, rel=1e-9)
    t = top.tensor_parallel
    assert top.plan.cluster.tensor_parallel == t
    assert top.plan.layout == layout(top.stages, top.replicas, t)
    assert top.stages * top.replicas * t == 8
    if squeeze is not None:  # splitting the parameters is what fits the shallow pipelines
        assert t > 1


def test_each_axis_uses_the_link_its_peers_share() -> None:
    from pipeplan.solvers.devices import axis_links

    inter = Link(bandwidth_Bps=1e9)
    dp_link = Link(bandwidth_Bps=5e8)
    c = Cluster.homogeneous(1, 2**30, inter).model_copy(
        update={"devices_per_node": 8, "intra_node_link": INTRA, "replica_link": dp_link}
    )
    # (p, t, d) -> (pipeline link, data-parallel link): the pipeline's p t ranks fill whole
    # nodes (p t divides 8) or cross them; the replicas share a node only when N <= 8
    cases = {(2, 4, 1): (INTRA, INTRA), (2, 2, 2): (INTRA, INTRA), (4, 2, 2): (INTRA, dp_link),
             (3, 2, 1): (inter, INTRA), (8, 2, 1): (inter, dp_link), (1, 8, 4): (INTRA, dp_link)}  # fmt: skip
    for (p, t, d), (pp, dp) in cases.items():
        got = axis_links(c, p, t, d)
        assert (got.link, got.replica_link) == (pp, dp), (p, t, d)
    no_nodes = c.model_copy(update={"devices_per_node": None})
    assert axis_links(no_nodes, 4, 4, 4).link == INTRA  # one node holds every device
    plain = c.model_copy(update={"intra_node_link": None})
    assert axis_links(plain, 2, 2, 2) is plain


def test_tensor_degrees_and_their_bad_values() -> None:
    from pipeplan.solvers.devices import tensor_degrees

    prof = _split(synthetic_profile(5, batch_size=8, microbatch_sizes=[1, 2], seed=0))
    c = Cluster.homogeneous(1, 2**30).model_copy(update={"devices_per_node": 8})
    degrees, skipped = tensor_degrees(prof, 16, c)
    assert degrees == (1, 2, 4)
    assert skipped == (
        (8, "--tensor-parallel 8 does not divide the model's heads (4, unit unit1)"),
    )
    assert tensor_degrees(prof, 16, c, 2) == ((2,), ())
    for t, devices, message in (
        (16, 32, "--tensor-parallel 16 is larger than --devices-per-node 8"),
        (3, 24, "--tensor-parallel 3 does not divide --devices-per-node 8"),
        (4, 6, "--devices 6 is not a multiple of --tensor-parallel 4"),
        (8, 16, r"--tensor-parallel 8 does not divide the model's heads \(4"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            tensor_degrees(prof, devices, c, t)
    plain = synthetic_profile(5, batch_size=8, microbatch_sizes=[1, 2], seed=0)
    assert tensor_degrees(plain, 16, c) == ((1,), ())  # nothing splits: t = 1 alone
    choices = plan_devices(prof, 16, c, PlanOptions(), solve_dp, tensor_parallels=degrees,
                           skipped=skipped)  # fmt: skip
    row = next(x for x in choices if x.tensor_parallel == 8)
    assert (row.stages, row.plan) == (0, None) and "heads" in row.reason
