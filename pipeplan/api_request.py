"""The request a plan is solved from: the cluster, the options, the target's cuts and families,
the devices' frontier (``pipeplan plan`` and :func:`pipeplan.plan` both build one).

Every check of a plan request is made here or in the packages below, once, so a Python caller
gets the same checks and messages as the command line.  :mod:`pipeplan.api` re-exports the
public names.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

from pipeplan.planner.errors import InfeasiblePlanError, InvalidRequestError
from pipeplan.planner.io import (
    calibration_file,
    load_cluster,
    load_profile,
    parse_bytes,
    parse_duration,
    parse_rate,
)
from pipeplan.planner.types import Cluster, Link, Plan, PlanOptions, Profile

if TYPE_CHECKING:
    from pipeplan.solvers.devices import DeviceChoice

__all__ = [
    "PlanRequest",
    "calibration",
    "make_cluster",
    "plan_request",
    "target_allowed_cuts",
    "target_families",
]

PathLike = str | os.PathLike[str]


def calibration(kind: str = "cpu") -> tuple[Cluster, Path] | None:
    """This machine's latest ``pipeplan calibrate`` for devices of ``kind`` and its file
    (:func:`pipeplan.planner.io.calibration_file`), or ``None`` if it was never calibrated."""
    path = calibration_file(kind)
    return (load_cluster(path), path) if path.is_file() else None


def make_cluster(
    stages: int | None = None,
    memory: int | str | None = None,
    *,
    bandwidth: float | str | None = None,
    latency: float | str | None = None,
    cluster: Cluster | PathLike | None = None,
    calibrated: Cluster | None = None,
) -> Cluster:
    """The devices to plan for: ``cluster`` (a Cluster or its file; ``memory`` overrides each
    device's), or ``stages`` identical devices of ``memory`` bytes (``16 * 2**30`` or
    ``"16GiB"``).  Those are joined by links of ``bandwidth`` (bytes/s or ``"10GB/s"``) and
    ``latency`` (seconds or ``"5us"``) if either is given, else by the links, engine costs and
    contention of ``calibrated`` (a ``pipeplan calibrate`` result, :func:`calibration`), else
    by free links."""
    mem = parse_bytes(memory) if isinstance(memory, str) else memory
    if cluster is not None:
        clus = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
        if stages is not None and stages != clus.n_stages:
            raise InvalidRequestError(
                f"--stages {stages} contradicts the cluster's {clus.n_stages} devices; drop "
                "--stages"
            )
        if mem is not None:
            devices = tuple(d.model_copy(update={"memory_bytes": mem}) for d in clus.devices)
            clus = clus.model_copy(update={"devices": devices})
        return clus
    if stages is None or mem is None:
        raise InvalidRequestError("give --stages and --memory, or a --cluster file")
    if stages < 1:
        raise InvalidRequestError(f"--stages {stages} must be at least 1")
    if calibrated is not None and bandwidth is None and latency is None:
        devices = Cluster.homogeneous(stages, mem).devices
        return calibrated.model_copy(update={"devices": devices, "data_parallel": 1})
    link = Link(
        bandwidth_Bps=parse_rate(bandwidth) if isinstance(bandwidth, str) else bandwidth,
        latency_s=parse_duration(latency) if isinstance(latency, str) else (latency or 0.0),
    )
    return Cluster.homogeneous(stages, mem, link)


def _check_target(target: str) -> None:
    from pipeplan.export import TARGETS

    if target not in TARGETS:
        raise InvalidRequestError(f"--for {target!r} is not one of {', '.join(TARGETS)}")


def target_allowed_cuts(profile: Profile, target: str) -> tuple[int, ...]:
    """The units a stage may start at when ``target`` (torchtitan, megatron, deepspeed, fqns)
    runs the plan: :func:`pipeplan.export.snap.target_cuts` on the profile's unit names, for
    ``PlanOptions.allowed_cuts`` (``pipeplan plan --for``).  Raises
    :class:`~pipeplan.planner.errors.InvalidRequestError` for a target that cannot name the
    model."""
    from pipeplan.export import target_cuts

    _check_target(target)
    if profile.granularity == "node":
        raise InvalidRequestError(
            "the profile's units are graph nodes (--granularity node), not modules, so no "
            "framework can name them; profile with --granularity auto"
        )
    return target_cuts([u.name for u in profile.units], target)  # type: ignore[arg-type]


def target_families(target: str, schedule: str) -> tuple[str, ...]:
    """The schedule families ``target`` runs as planned (:data:`pipeplan.export.TARGET_FAMILIES`),
    for ``PlanOptions.families``; :class:`~pipeplan.planner.errors.InvalidRequestError` when
    ``schedule`` names a family it does not run."""
    from pipeplan.export import TARGET_FAMILIES

    _check_target(target)
    families = TARGET_FAMILIES[target]  # type: ignore[index]
    if schedule != "auto" and schedule not in families:
        raise InvalidRequestError(
            f"--schedule {schedule} is not what {target} runs ({', '.join(families)}); "
            "choose one of those, or auto"
        )
    return families


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """A request to plan, checked and resolved once (:func:`plan_request`); every solve of it
    reads these."""

    profile: Profile
    cluster: Cluster
    """The devices to plan for; with ``devices``, the one device every depth copies, and the
    links."""
    options: PlanOptions
    solver: str = "dp"
    devices: int | None = None
    """N devices: every pipeline depth p dividing N is planned, with N / p data-parallel
    replicas (``None``: the cluster's stages)."""
    calibration: Path | None = None
    """The ``pipeplan calibrate`` file whose links, engine costs and contention the cluster
    carries (``None``: none is charged)."""
    global_batch: int | None = None
    """B, the samples of one step over every data-parallel rank (``None``: the profile's)."""
    modes: tuple[str, ...] = ("replicate", "shard")
    """The data-parallel modes the frontier weighs (:mod:`pipeplan.planner.collectives`)."""
    replicas: int | None = None
    """d fixed (``--dp``); ``None``: every divisor of ``devices``."""
    tensor_parallels: tuple[int, ...] = (1,)
    """The tensor-parallel degrees t the frontier plans
    (:func:`pipeplan.solvers.devices.tensor_degrees`)."""
    skipped_tensor_parallels: tuple[tuple[int, str], ...] = ()
    """Degrees left out, with why (t does not divide a split dimension)."""

    @property
    def tensor_parallel_note(self) -> str | None:
        """One line when the search would weigh t > 1 (``devices_per_node`` given) but the
        profile's units do not split: the profile's reason."""
        from pipeplan.solvers.tensor_parallel import is_annotated

        if (
            self.devices is None
            or self.cluster.devices_per_node is None
            or self.tensor_parallels != (1,)
            or is_annotated(self.profile)
        ):
            return None
        why = self.profile.tensor_parallel_note or "no unit of the profile has a split"
        return f"tensor parallel 1 only: {why}"

    def solve(self) -> Plan:
        """The best plan: :func:`pipeplan.solvers.choose.solve` on the cluster, or with
        ``devices`` the fastest depth of the :meth:`frontier` (:meth:`best`)."""
        if self.devices is not None:
            return self.best(self.frontier())
        from pipeplan.solvers.choose import solve

        return solve(self.profile, self.cluster, self.options, self.solver)

    def frontier(self) -> list[DeviceChoice]:
        """With ``devices``: every depth, its plan or why it has none, best first
        (:func:`pipeplan.solvers.devices.plan_devices`)."""
        from functools import partial

        from pipeplan.solvers.choose import ONE_CHUNK, solve
        from pipeplan.solvers.devices import plan_devices

        if self.devices is None:
            raise InvalidRequestError("a request for --stages has no frontier; give --devices")
        # many meshes, each planned: the final gap's bounds are left out (they change no plan)
        solver = partial(solve, solver=self.solver, final_gap=False)
        floor = quick = None
        # the schedule solver's local search is searched again only on the two best depths
        refine = 2 if self.solver == "dp" and self.options.schedule not in ONE_CHUNK else 0
        if self.solver == "dp" and self.options.schedule == "auto":
            # search the pairs that can still win; the rest get the DP's one-chunk plan
            from pipeplan.solvers.multichunk import schedule_floor

            floor = schedule_floor
            one = self.options.model_copy(update={"families": ("gpipe", "1f1b")})
            if self.tensor_parallels == (1,):  # the mesh's many triples go unplanned instead
                quick = partial(_solve_as, options=one, solver=self.solver)
        return plan_devices(
            self.profile,
            self.devices,
            self.cluster,
            self.options,
            solver,
            global_batch=self.global_batch,
            modes=self.modes,  # type: ignore[arg-type]
            replicas=self.replicas,
            floor=floor,
            quick=quick,
            refine=refine,
            tensor_parallels=self.tensor_parallels,
            skipped=self.skipped_tensor_parallels,
        )

    def best(self, choices: Sequence[DeviceChoice]) -> Plan:
        """The first of the :meth:`frontier`'s ``choices`` (the fastest);
        :class:`~pipeplan.planner.errors.InfeasiblePlanError` naming every depth's reason
        when none has a plan."""
        if choices[0].plan is None:
            reasons = "; ".join(
                f"p={c.stages}{f' t={c.tensor_parallel}' if c.tensor_parallel > 1 else ''} "
                f"{c.mode}: {c.reason}"
                for c in choices
            )
            raise InfeasiblePlanError(f"no depth fits {self.devices} devices: {reasons}")
        return choices[0].plan


def _solve_as(profile: Profile, cluster: Cluster, _: PlanOptions, *, options: PlanOptions,
              solver: str) -> Plan:  # fmt: skip
    """:func:`pipeplan.solvers.choose.solve` with ``options`` in place of the request's."""
    from pipeplan.solvers.choose import solve

    return solve(profile, cluster, options, solver)


#: ``data_parallel`` choices and the modes each lets the frontier weigh.
DATA_PARALLEL = {"auto": ("replicate", "shard"), "replicate": ("replicate",), "shard": ("shard",)}


def _plan_options(options: dict[str, Any]) -> PlanOptions:
    """``PlanOptions(**options)``, its first error an InvalidRequestError that names the option
    (as the command line spells it) and the choices it takes."""
    try:
        return PlanOptions(**options)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        if first["type"] == "literal_error" and len(first["loc"]) == 1:
            allowed = get_args(PlanOptions.model_fields[where].annotation)
            raise InvalidRequestError(
                f"--{where} {first['input']!r} is not one of {', '.join(allowed)}"
            ) from None
        raise InvalidRequestError(f"plan option {where}: {first['msg']}") from None


def plan_request(
    profile: Profile | PathLike,
    *,
    stages: int | None = None,
    memory: int | str | None = None,
    cluster: Cluster | PathLike | None = None,
    devices: int | None = None,
    bandwidth: float | str | None = None,
    latency: float | str | None = None,
    solver: str = "dp",
    calibrated: bool = True,
    target: str | None = None,
    global_batch_size: int | None = None,
    data_parallel: str = "auto",
    dp: int | None = None,
    devices_per_node: int | None = None,
    tensor_parallel: int | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    intra_bandwidth: float | str | None = None,
    intra_latency: float | str | None = None,
    **options: Any,
) -> PlanRequest:
    """A request to plan ``profile`` (a Profile or its file), checked: what :func:`plan` solves
    and ``pipeplan plan`` solves and prints (the calibration it charges, the depths of
    ``devices``).

    The devices are ``stages`` of ``memory`` each, or ``cluster`` (:func:`make_cluster`, with
    ``bandwidth`` and ``latency``); with ``calibrated`` and without ``cluster``, ``bandwidth``
    or ``latency``, they take their links and engine costs from this machine's ``pipeplan
    calibrate`` for the profile's device kind, when there is one (:func:`calibration`).  With
    ``devices`` N instead of ``stages``, every pipeline depth p dividing N is planned with
    N / p data-parallel replicas (:meth:`PlanRequest.frontier`).  ``solver`` is ``dp``
    (exact), ``cpsat``, or a baseline (``uniform``, ``params``, ``torchgpipe``).  ``options``
    are :class:`~pipeplan.planner.types.PlanOptions` fields: ``microbatches`` (``None``:
    chosen), ``checkpoint``, ``schedule`` (default ``auto``: the family, chunks per rank,
    cuts, m and recomputation chosen together, :mod:`pipeplan.solvers.choose`),
    ``optimizer``, ``pinned``, ``min_units``, ``max_units``, ``time_limit_s``, ...  With
    ``target`` (``torchtitan``, ``megatron``, ``deepspeed``, ``fqns``) only the cuts that
    framework can make and the schedules it runs are planned (:func:`target_allowed_cuts`,
    :func:`target_families`).  ``global_batch_size`` B is the step's samples over every
    data-parallel rank (default: the profile's batch; the profile's per-micro-batch times are
    reused, m = B / (d b)).  ``data_parallel`` is how each stage's d ranks hold its state:
    ``replicate``, ``shard`` (FSDP2) or ``auto`` (both weighed); ``dp`` fixes d (with
    ``stages`` p, the plan runs p x d devices).

    Tensor parallelism (:mod:`pipeplan.solvers.tensor_parallel`): ``devices_per_node`` K
    (default: the cluster file's) with ``devices`` weighs every tensor-parallel degree t
    dividing K as well (:func:`pipeplan.solvers.devices.tensor_degrees`); ``tensor_parallel``
    fixes t (with ``stages`` p alone, the plan runs p x t devices); ``sequence_parallel``
    splits the norms' sequence too, ``loss_parallel`` has the loss read a vocabulary-split
    head's logits split.  ``intra_bandwidth`` and ``intra_latency`` are the
    intra-node link's (default: the cluster file's ``intra_node_link``, else ``bandwidth`` and
    ``latency``).  A profile whose units carry no split is annotated first
    (:func:`_annotated`), when its model can be built.  Raises
    :class:`~pipeplan.planner.errors.InvalidRequestError` for a request no solver plans.
    """
    from pipeplan.solvers.choose import check_solver

    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    options.setdefault("schedule", "auto")
    if target is not None:
        options["families"] = target_families(target, options["schedule"])
        options["allowed_cuts"] = target_allowed_cuts(prof, target)
    opts = _plan_options(options)
    check_solver(opts, solver)
    if data_parallel not in DATA_PARALLEL:
        raise InvalidRequestError(
            f"--data-parallel {data_parallel!r} is not one of {', '.join(DATA_PARALLEL)}"
        )
    if global_batch_size is not None and global_batch_size < 1:
        raise InvalidRequestError(f"--global-batch-size {global_batch_size} must be positive")
    if dp is not None and dp < 1:
        raise InvalidRequestError(f"--dp {dp} must be at least 1")
    if devices is not None and stages is not None:
        raise InvalidRequestError("--devices chooses the stage count; drop --stages")
    if devices_per_node is not None and devices_per_node < 1:
        raise InvalidRequestError(f"--devices-per-node {devices_per_node} must be at least 1")
    t_fixed = tensor_parallel
    if t_fixed is not None and t_fixed < 1:
        raise InvalidRequestError(f"--tensor-parallel {t_fixed} must be at least 1")
    if stages is not None and (dp is not None or (t_fixed or 1) > 1):
        # p stages x d ranks x t: one depth of p d t devices
        devices, stages, dp = stages * (dp or 1) * (t_fixed or 1), None, dp or 1
    if devices is None and global_batch_size is not None:  # one pipeline takes the whole batch
        from pipeplan.solvers.devices import replica_profile

        prof = replica_profile(prof, 1, global_batch_size)
    links = cluster is not None or bandwidth is not None or latency is not None
    found = calibration(prof.device.kind) if calibrated and not links else None
    clus = make_cluster(
        stages if devices is None else (None if cluster is not None else 1),
        memory,
        bandwidth=bandwidth,
        latency=latency,
        cluster=cluster,
        calibrated=found[0] if found else None,
    )
    clus = _with_nodes(
        clus, devices_per_node, sequence_parallel, loss_parallel, intra_bandwidth, intra_latency
    )
    wanted = "--sequence-parallel" if sequence_parallel else "--loss-parallel"
    degrees: tuple[int, ...] = (1,)
    skipped: tuple[tuple[int, str], ...] = ()
    if devices is None and (sequence_parallel or loss_parallel):
        raise InvalidRequestError(f"{wanted} needs --tensor-parallel above 1")
    if devices is not None:
        from pipeplan.solvers.devices import tensor_degrees

        if (t_fixed or 1) > 1 or (t_fixed is None and clus.devices_per_node is not None):
            prof = _annotated(prof)
        degrees, skipped = tensor_degrees(prof, devices, clus, t_fixed)
        if (sequence_parallel or loss_parallel) and max(degrees) == 1:
            raise InvalidRequestError(f"{wanted} needs --tensor-parallel above 1")
        if loss_parallel:
            from pipeplan.solvers.tensor_parallel import check_loss_parallel

            check_loss_parallel(prof)
    return PlanRequest(
        prof,
        clus,
        opts,
        solver,
        devices,
        found[1] if found else None,
        global_batch=global_batch_size,
        modes=DATA_PARALLEL[data_parallel],
        replicas=dp,
        tensor_parallels=degrees,
        skipped_tensor_parallels=skipped,
    )


def _with_nodes(
    cluster: Cluster,
    devices_per_node: int | None,
    sequence_parallel: bool,
    loss_parallel: bool,
    intra_bandwidth: float | str | None,
    intra_latency: float | str | None,
) -> Cluster:
    """``cluster`` with the request's node size, intra-node link, sequence and loss
    parallelism (each option overriding the cluster file's field)."""
    update: dict[str, Any] = {
        "sequence_parallel": sequence_parallel or cluster.sequence_parallel,
        "loss_parallel": loss_parallel or cluster.loss_parallel,
    }
    if devices_per_node is not None:
        update["devices_per_node"] = devices_per_node
    if intra_bandwidth is not None or intra_latency is not None:
        base = cluster.intra_node_link or cluster.link
        update["intra_node_link"] = Link(
            bandwidth_Bps=_given(intra_bandwidth, parse_rate, base.bandwidth_Bps),
            latency_s=_given(intra_latency, parse_duration, base.latency_s),
        )
    return cluster.model_copy(update=update)


def _given(value: float | str | None, parse: Any, default: Any) -> Any:
    """``value`` parsed where it is text, as it is where a number, ``default`` where absent."""
    if value is None:
        return default
    return parse(value) if isinstance(value, str) else value


def _annotated(profile: Profile) -> Profile:
    """``profile`` with each unit's tensor-parallel split, when none has one yet and nothing
    was said about it (``tensor_parallel_note``): its model built on ``meta`` and annotated
    by :func:`pipeplan.profiler.tp_annotate.annotate_profile`.  A model that cannot be built
    here plans t = 1, and the note says why."""
    from pipeplan.solvers.tensor_parallel import is_annotated

    if is_annotated(profile) or profile.tensor_parallel_note is not None:
        return profile
    return _annotate(profile)


def _annotate(profile: Profile) -> Profile:
    """:func:`pipeplan.profiler.tp_annotate.annotate_profile` on the profile's model, built on
    ``meta``; a model that cannot be built here gets a ``tensor_parallel_note`` saying so."""
    from pipeplan.intake.model import load_model
    from pipeplan.planner.errors import PipeplanError

    try:
        spec = load_model(profile.model, dict(profile.model_kwargs), meta=True)
        from pipeplan.profiler.tp_annotate import annotate_profile

        return annotate_profile(profile, spec)
    except PipeplanError as exc:
        why = str(exc).split(";")[0].splitlines()[0]
        note = f"the model {profile.model} could not be annotated here ({why})"
        return profile.model_copy(update={"tensor_parallel_note": note})
