"""What a request to plan tensor parallelism adds (:func:`pipeplan.api.plan_request`): the
node size, the intra-node link and sequence parallelism on the cluster, and the tensor-parallel
annotation of a profile whose units carry none (:mod:`pipeplan.planner.tp_costs`)."""

from __future__ import annotations

from typing import Any

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.io import parse_duration, parse_rate
from pipeplan.planner.types import Cluster, Link, Profile

__all__ = ["annotated", "resolve_degrees", "single_degree_note", "with_nodes"]


def resolve_degrees(
    profile: Profile, cluster: Cluster, devices: int | None, tensor_parallel: int | None
) -> tuple[Profile, tuple[int, ...], tuple[tuple[int, str], ...]]:
    """The profile (:func:`annotated` where tensor parallelism is asked), the degrees t to plan
    and those skipped with why (:func:`pipeplan.solvers.devices.tensor_degrees`); t = 1 alone
    without ``devices``.  Sequence parallelism without a t > 1 is refused."""
    from pipeplan.solvers.devices import tensor_degrees

    degrees: tuple[int, ...] = (1,)
    skipped: tuple[tuple[int, str], ...] = ()
    if devices is not None:
        t = tensor_parallel
        if (t or 1) > 1 or (t is None and cluster.devices_per_node is not None):
            profile = annotated(profile)
        degrees, skipped = tensor_degrees(profile, devices, cluster, t)
    if cluster.sequence_parallel and max(degrees) == 1:
        raise InvalidRequestError("--sequence-parallel needs --tensor-parallel above 1")
    return profile, degrees, skipped


def single_degree_note(
    profile: Profile, cluster: Cluster, devices: int | None, degrees: tuple[int, ...]
) -> str | None:
    """One line when a search for ``devices`` would weigh t > 1 (the cluster has
    ``devices_per_node``) but only t = 1 is planned because the profile's units do not split:
    the profile's reason."""
    from pipeplan.planner.tp_costs import is_annotated

    if devices is None or cluster.devices_per_node is None or degrees != (1,):
        return None
    if is_annotated(profile):
        return None
    why = profile.tensor_parallel_note or "no unit of the profile has a split"
    return f"tensor parallel 1 only: {why}"


def with_nodes(
    cluster: Cluster,
    devices_per_node: int | None,
    sequence_parallel: bool,
    intra_bandwidth: float | str | None,
    intra_latency: float | str | None,
) -> Cluster:
    """``cluster`` with the request's node size, intra-node link and sequence parallelism
    (each option overriding the cluster file's field)."""
    update: dict[str, Any] = {"sequence_parallel": sequence_parallel or cluster.sequence_parallel}
    if devices_per_node is not None:
        update["devices_per_node"] = devices_per_node
    if intra_bandwidth is not None or intra_latency is not None:
        base = cluster.intra_node_link or cluster.link
        update["intra_node_link"] = Link(
            bandwidth_Bps=(
                parse_rate(intra_bandwidth)
                if isinstance(intra_bandwidth, str)
                else intra_bandwidth
                if intra_bandwidth is not None
                else base.bandwidth_Bps
            ),
            latency_s=(
                parse_duration(intra_latency)
                if isinstance(intra_latency, str)
                else intra_latency
                if intra_latency is not None
                else base.latency_s
            ),
        )
    return cluster.model_copy(update=update)


def annotated(profile: Profile) -> Profile:
    """``profile`` with each unit's tensor-parallel split, when none has one yet and nothing
    was said about it (``tensor_parallel_note``): its model built on ``meta`` and annotated
    by :func:`pipeplan.profiler.tp_annotate.annotate_profile`.  A model that cannot be built
    here plans t = 1, and the note says why."""
    from pipeplan.planner.tp_costs import is_annotated

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
