"""Plan for N devices: pipeline depth p, tensor-parallel degree t, d = N / (p t) data-parallel
ranks, in either data-parallel mode.

A user has N identical devices, K per node (``Cluster.devices_per_node``), and a global batch
B (``global_batch``; the profile's batch when not given).  For every tensor-parallel degree t
asked (``tensor_parallels``; :func:`tensor_degrees` finds them: the divisors of K that divide
N and every split dimension of the model), every depth p dividing N / t (and p <= units) and
every data-parallel mode (``replicate``: whole copies; ``shard``: FSDP2,
:mod:`pipeplan.planner.collectives`), the d = N / (p t) ranks of each stage take B / d of the
batch each; the family, v, m, the cuts and the recomputation are chosen for that share by a
solver (:func:`pipeplan.solvers.choose.solve`, every schedule family under ``auto``) on the
per-rank profile of t-way tensor parallelism (:func:`pipeplan.solvers.tensor_parallel.tp_profile`,
made once per t) and a cluster whose ``tensor_parallel`` is t and ``data_parallel`` d in that
mode.  The profile's per-micro-batch measurements are reused: m = B / (d b) for a profiled
micro-batch size b that divides B / d.  The replicas run at once and the gradient collectives
close the step (in each stage's update tail), so the global step takes the replica's T, and
the throughput is B / T.

The per-(p, t, mode) optimum is the solver's; the choice over p, t and the mode is an
enumeration (:func:`plan_devices` returns every triple, best first).  Exact wherever the solver
is; with ``floor`` and ``refine`` the search is spent on the triples that can win (below).

Layout: the device mesh (dp, pp, tp), tp innermost, as torchtitan and Megatron-LM order it:
replica r's pipeline rank j (its stage, or its chunks) runs on global ranks (r p + j) t ..
(r p + j) t + t - 1 (``Plan.layout`` holds the first of each).  Node n holds ranks n K ..
n K + K - 1, and the links each axis uses (:func:`axis_links`):

    tp      always inside a node (t divides K): ``intra_node_link``;
    pp      neighbours j, j + 1 of a replica are t ranks apart; all of them share a node when
            p t divides K, and then use ``intra_node_link``; otherwise some pair crosses nodes
            and the pipeline is priced on ``link`` (the slower link bounds its steady state);
    dp      a stage's d peers are p t ranks apart; they share a node only when N <= K
            (``intra_node_link``), otherwise the ring crosses nodes: ``replica_link``
            (``link`` when not given).

Without ``devices_per_node`` one node holds every device; without ``intra_node_link`` every
axis uses the links as given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pipeplan.planner.errors import InfeasiblePlanError, InvalidRequestError
from pipeplan.planner.types import OPTIMIZER_STATES, Cluster, Device, Plan, PlanOptions, Profile
from pipeplan.solvers.tensor_parallel import check_tensor_parallel, is_annotated, tp_profile

__all__ = [
    "MODES",
    "DeviceChoice",
    "Mode",
    "axis_links",
    "layout",
    "plan_devices",
    "replica_profile",
    "tensor_degrees",
]

Solver = Callable[[Profile, Cluster, PlanOptions], Plan]
Floor = Callable[[Profile, Cluster, PlanOptions], float]


Mode = Literal["replicate", "shard"]

#: The data-parallel modes :func:`plan_devices` tries by default.
MODES: tuple[Mode, ...] = ("replicate", "shard")


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """One (pipeline depth, tensor-parallel degree, data-parallel mode): its plan, or why it
    has none (``stages`` 0: no depth of that degree was planned)."""

    stages: int
    replicas: int
    plan: Plan | None
    reason: str = ""
    """Why there is no plan (empty when there is one)."""
    mode: Mode = "replicate"
    tensor_parallel: int = 1
    """t: the ranks each pipeline rank's blocks are split over."""

    @property
    def throughput(self) -> float:
        """Global samples per second (0 without a plan)."""
        return 0.0 if self.plan is None else self.plan.throughput * self.replicas


def layout(stages: int, replicas: int, tensor_parallel: int = 1) -> tuple[tuple[int, ...], ...]:
    """First global rank of each replica's pipeline ranks: replica r's rank j on ranks
    (r * stages + j) * t .. + t - 1.

    >>> layout(2, 3)
    ((0, 1), (2, 3), (4, 5))
    >>> layout(2, 2, 4)
    ((0, 4), (8, 12))
    """
    t = tensor_parallel
    return tuple(tuple((r * stages + j) * t for j in range(stages)) for r in range(replicas))


def axis_links(cluster: Cluster, stages: int, tensor_parallel: int, replicas: int) -> Cluster:
    """``cluster`` with its ``link`` (the pipeline's) and ``replica_link`` (the data-parallel
    peers') set for p = ``stages``, t, d = ``replicas`` under the layout of the module
    docstring: the intra-node link where every pair of peers shares a node, else as given.

    >>> from pipeplan.planner.types import Link
    >>> c = Cluster.homogeneous(1, 2**30, Link(bandwidth_Bps=1e9)).model_copy(update={
    ...     "devices_per_node": 8, "intra_node_link": Link(bandwidth_Bps=8e9)})
    >>> [axis_links(c, p, 2, d).link.bandwidth_Bps for p, d in ((4, 1), (2, 2), (3, 1))]
    [8000000000.0, 8000000000.0, 1000000000.0]
    >>> axis_links(c, 4, 2, 2).replica_link.bandwidth_Bps  # 16 devices: the peers cross nodes
    1000000000.0
    """
    intra = cluster.intra_node_link
    if intra is None:
        return cluster
    k = cluster.devices_per_node
    ranks = stages * tensor_parallel
    pp = intra if k is None or (ranks <= k and k % ranks == 0) else cluster.link
    dp = intra if k is None or ranks * replicas <= k else cluster.replica_link or cluster.link
    return cluster.model_copy(update={"link": pp, "replica_link": dp})


def tensor_degrees(
    profile: Profile, devices: int, cluster: Cluster, tensor_parallel: int | None = None
) -> tuple[tuple[int, ...], tuple[tuple[int, str], ...]]:
    """The tensor-parallel degrees to plan N = ``devices`` with, and those skipped with why.

    ``tensor_parallel`` t fixed: (t,) after checking it (t <= K, t | N, t divides every split
    dimension: :class:`InvalidRequestError` naming the value otherwise).  ``None``: every
    divisor t of K = ``cluster.devices_per_node`` that divides N (only 1 without K or when no
    unit of the profile splits); a t that does not divide a split dimension is skipped with
    the reason.

    >>> from pipeplan.profiler.synthetic import synthetic_profile
    >>> c = Cluster.homogeneous(1, 2**30).model_copy(update={"devices_per_node": 8})
    >>> tensor_degrees(synthetic_profile(3), 16, c)
    ((1,), ())
    """
    k = cluster.devices_per_node
    if tensor_parallel is not None:
        t = tensor_parallel
        if t < 1:
            raise InvalidRequestError(f"--tensor-parallel {t} must be at least 1")
        if k is not None and t > k:
            raise InvalidRequestError(
                f"--tensor-parallel {t} is larger than --devices-per-node {k}: tensor-parallel "
                f"groups stay inside a node; give a divisor of {k}"
            )
        if k is not None and k % t:
            raise InvalidRequestError(
                f"--tensor-parallel {t} does not divide --devices-per-node {k}; give a divisor "
                f"of {k}"
            )
        if devices % t:
            raise InvalidRequestError(
                f"--devices {devices} is not a multiple of --tensor-parallel {t}; give a "
                f"multiple of {t}"
            )
        check_tensor_parallel(profile, t)
        return (t,), ()
    if k is None or not is_annotated(profile):
        return (1,), ()
    ok: list[int] = []
    skipped: list[tuple[int, str]] = []
    for t in (t for t in range(1, k + 1) if k % t == 0 and devices % t == 0):
        try:
            check_tensor_parallel(profile, t)
        except InvalidRequestError as exc:
            skipped.append((t, str(exc).split(";")[0]))
            continue
        ok.append(t)
    return tuple(ok), tuple(skipped)


def replica_profile(profile: Profile, replicas: int, global_batch: int | None = None) -> Profile:
    """The profile of one replica's share: batch B / d (B the ``global_batch``, else the
    profile's), the profiled micro-batch sizes that divide it.

    Raises :class:`InvalidRequestError` when d does not divide B or no profiled size divides
    B / d."""
    batch = profile.batch_size if global_batch is None else global_batch
    if batch < 1:
        raise InvalidRequestError(f"global batch {batch} must be at least 1 sample")
    if batch % replicas:
        raise InvalidRequestError(
            f"global batch {batch} does not split over {replicas} data-parallel ranks; give a "
            f"multiple of {replicas}"
        )
    share = batch // replicas
    sizes = tuple(b for b in profile.microbatch_sizes if share % b == 0)
    if not sizes:
        raise InvalidRequestError(
            f"no profiled micro-batch size divides the replica's batch {share} (profiled: "
            f"{list(profile.microbatch_sizes)}); give a global batch that d times one of them "
            "divides, or profile --microbatch-sizes that divide it"
        )
    return profile.model_copy(update={"batch_size": share, "microbatch_sizes": sizes})


def plan_devices(
    profile: Profile,
    devices: int,
    cluster: Cluster,
    options: PlanOptions,
    solver: Solver,
    global_batch: int | None = None,
    modes: Sequence[Mode] = MODES,
    replicas: int | None = None,
    floor: Floor | None = None,
    quick: Solver | None = None,
    refine: int = 0,
    tensor_parallels: Sequence[int] = (1,),
    skipped: Sequence[tuple[int, str]] = (),
) -> list[DeviceChoice]:
    """Every depth p dividing ``devices`` / t for each t of ``tensor_parallels`` (only p =
    devices / (t ``replicas``) when that is given) in each of ``modes``: the best plan of
    d = devices / (p t) data-parallel ranks per stage, best throughput first (then replicate
    before shard, then fewer stages, then smaller t; triples without a plan last).  With d = 1
    the modes coincide, and only ``replicate`` is planned.  Each t of ``skipped`` (t, why),
    :func:`tensor_degrees`' second answer, gets one row without a plan.

    ``cluster`` describes one device (its first) and the links: each triple gets p copies of
    that device, ``tensor_parallel`` t, ``data_parallel`` d in the mode, the links of
    :func:`axis_links`, and the cluster's engine terms; the profile is the per-rank one of
    :func:`pipeplan.solvers.tensor_parallel.tp_profile`, made once per t.

    With ``floor`` (a lower bound on the step of every plan ``solver`` could return, e.g.
    :func:`pipeplan.solvers.multichunk.schedule_floor`), the triples are solved in increasing
    order of their floor, and a triple whose floor is no less than the best step found so far
    is not searched: every triple has the same global batch, so it cannot have the best
    throughput.  Such a triple gets ``quick``'s plan (e.g. the DP's one-chunk plan) for the
    frontier, or none; the best triple is the same as without ``floor``.  The floors are per
    rank of the per-rank profile, so they bound every t alike.

    In the mesh search (any t > 1 asked), a ``replicate`` triple is not planned where
    ``shard`` dominates it (:func:`_shard_dominates`: modelled collectives, an optimizer with
    states): its best plan can only be slower, so the best triple is the same.

    With ``refine`` = r > 0 (for the schedule solver, whose local search is what costs), the
    search is spent where it can matter.  First every triple is planned from the search's seeds
    alone (``options.search_work`` = 0: the DP's plans, the balanced and min-max cuts, every
    (family, v, m) scored, and the exhaustive enumeration where it is small); then the r
    triples with the fastest such plans, whose floor is still below the best step, are searched
    again with ``options``' budget.  The search of one triple costs about as much as the seeds
    of all of them (7B profile, 512 devices: 20 pairs), so the planning time is about (r + 1)
    searches instead of one per triple.  The other triples keep their seeds' plan, which their
    status and gap describe.
    """
    if devices < 1:
        raise InvalidRequestError(f"--devices {devices} must be at least 1")
    for t in tensor_parallels:
        if devices % t:
            raise InvalidRequestError(
                f"--devices {devices} is not a multiple of --tensor-parallel {t}; give a "
                f"multiple of {t}"
            )
        if replicas is not None and (replicas < 1 or (devices // t) % replicas):
            raise InvalidRequestError(
                f"--dp {replicas} does not divide --devices {devices}"
                + (f" / --tensor-parallel {t}" if t > 1 else "")
                + f"; give a divisor of {devices // t}"
            )
    if not cluster.uniform_speed or len({d.memory_bytes for d in cluster.devices}) > 1:
        raise InvalidRequestError(
            "--devices needs identical devices; give the cluster one speed and one memory size"
        )
    device = cluster.devices[0]
    out: list[DeviceChoice] = [DeviceChoice(0, 0, None, why, "replicate", t) for t, why in skipped]
    todo: list[tuple[float, int, int, Profile, Cluster, Mode]] = []
    mesh = tuple(tensor_parallels) != (1,)
    for t in tensor_parallels:
        per_rank = tp_profile(profile, cluster.model_copy(update={"tensor_parallel": t}))
        n = devices // t
        depths = [p for p in range(1, n + 1) if n % p == 0]
        if replicas is not None:
            depths = [n // replicas]
        for p in depths:
            d = n // p
            for mode in modes if d > 1 else modes[:1]:
                if (
                    mesh
                    and mode == "replicate"
                    and "shard" in modes
                    and _shard_dominates(cluster, options, d)
                ):
                    out.append(DeviceChoice(p, d, None, _DOMINATED, mode, t))
                    continue
                got = _request(per_rank, p, t, d, mode, device, cluster, options, global_batch)
                if isinstance(got, str):
                    out.append(DeviceChoice(p, d, None, got, mode, t))
                    continue
                share, clus = got
                bound = floor(share, clus, options) if floor is not None else 0.0
                todo.append((bound, p, t, share, clus, mode))
    best = float("inf")
    if not 0 < refine < len(todo):  # every triple would be searched: search each once
        refine = 0
    first = options.model_copy(update={"search_work": 0}) if refine else options
    searched: list[tuple[float, int, float, Profile, Cluster, Mode]] = []
    for bound, p, t, share, clus, mode in sorted(todo, key=lambda x: (x[0], x[1], x[2], x[5])):
        use = solver if bound < best else quick
        skip = f"bound {bound:.4g} s >= best {best:.4g} s"
        choice = _solve(share, clus, first, use, p, mode, skip)
        if use is solver and choice.plan is not None:
            best = min(best, _step(choice.plan))
            searched.append((_step(choice.plan), len(out), bound, share, clus, mode))
        out.append(choice)
    for _, at, bound, share, clus, mode in sorted(searched, key=lambda x: (x[0], x[1]))[:refine]:
        if bound >= best:
            continue
        again = _solve(share, clus, options, solver, out[at].stages, mode, "")
        if again.plan is not None and _step(again.plan) <= _step(out[at].plan):  # type: ignore[arg-type]
            out[at] = again
            best = min(best, _step(again.plan))
    order = {m: k for k, m in enumerate(MODES)}
    return sorted(
        out,
        key=lambda c: (
            c.plan is None,
            c.reason == _DOMINATED,  # a pair's other reason says more
            -c.throughput,
            order[c.mode],
            c.stages,
            c.tensor_parallel,
        ),
    )


_DOMINATED = "not searched: shard holds less and its collectives cost no more"


def _shard_dominates(cluster: Cluster, options: PlanOptions, d: int) -> bool:
    """Whether ``shard`` is never slower and never holds more than ``replicate`` for every
    plan of d > 1 ranks: the collectives are the modelled rings (RS + AG cost what AR does,
    and U(w / d) <= U(w)), and the optimizer keeps s >= 1 states per parameter, so that
    1 + 1/d + 1 + s/d <= 2 + s (:func:`pipeplan.planner.collectives.state_factors`)."""
    return d > 1 and not cluster.collectives and OPTIMIZER_STATES[options.optimizer] >= 1


def _step(plan: Plan) -> float:
    """The step a plan is ranked by: its simulated step where it has one."""
    return plan.simulated_step_time_s or plan.step_time_s


def _request(
    profile: Profile,
    p: int,
    t: int,
    d: int,
    mode: Mode,
    device: Device,
    cluster: Cluster,
    options: PlanOptions,
    global_batch: int | None,
) -> tuple[Profile, Cluster] | str:
    """The replica's per-rank profile and the cluster of one (p, t, d, mode), or why it has
    no plan."""
    if p > profile.n_units:
        return f"more stages than the {profile.n_units} units"
    cuts = options.allowed_cuts
    if cuts is not None and len(cuts) < p - 1:
        return f"only {len(cuts)} allowed cut(s) (--for)"
    try:
        share = replica_profile(profile, d, global_batch)
    except InvalidRequestError as exc:
        return str(exc).split(";")[0]
    clus = axis_links(cluster, p, t, d).model_copy(
        update={
            "devices": tuple(device.model_copy(update={"name": f"dev{j}"}) for j in range(p)),
            "data_parallel": d,
            "data_parallel_mode": mode,
            "tensor_parallel": t,
        }
    )
    return share, clus


def _solve(
    share: Profile,
    clus: Cluster,
    options: PlanOptions,
    solver: Solver | None,
    p: int,
    mode: Mode,
    skipped: str,
) -> DeviceChoice:
    d, t = clus.data_parallel, clus.tensor_parallel
    if solver is None:
        return DeviceChoice(p, d, None, f"not searched: {skipped}", mode, t)
    try:
        plan = solver(share, clus, options)
    except (InfeasiblePlanError, InvalidRequestError) as exc:
        return DeviceChoice(p, d, None, str(exc).split(";")[0], mode, t)
    if not plan.feasible:
        return DeviceChoice(p, d, None, "no partition fits in memory", mode, t)
    where = layout(plan.pipeline_ranks, d, t)
    return DeviceChoice(p, d, plan.model_copy(update={"layout": where}), "", mode, t)
