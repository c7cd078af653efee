"""Megatron-style tensor parallelism as a per-rank profile: what one of t ranks of a stage runs.

Megatron-LM (Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism", 2019; with sequence parallelism, Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", 2022) splits each transformer block's
attention and MLP over t ranks of one node: the opening projections column-wise, the closing
ones row-wise, each sub-block closed by one all-reduce of its output in the forward and one of
its input's gradient in the backward.  Every rank of the group runs the same per-rank program,
so a stage of t ranks is priced as one device running the per-rank profile
:func:`tp_profile` returns; every solver then plans that profile unchanged.

Per unit u with an annotation (``Unit.tensor_parallel``: sharded FLOP share phi, sharded saved
share sigma, sharded parameter bytes w_s, k row-wise projections whose outputs, X bytes per
sample in all, are all-reduced in the forward, and k_c column-wise ones, n = k + k_c split
projections), at micro-batch size b, the collectives a ring over the t ranks on the
intra-node link (``Cluster.intra_node_link``, else ``link``) with the formulas of
:mod:`pipeplan.planner.collectives` (alpha per byte, beta per message):

    c_F        = alpha_AR X b + k beta_AR + n o_tp              (without sequence parallelism)
    c_B        = alpha_AR X b k_c / k + k_c beta_AR + n o_tp
               (with it, c_F: each all-reduce is a reduce-scatter and an all-gather, the same
                bytes on a ring; c_B gains the k row-wise outputs' all-gathers, the backward of
                their reduce-scatters, as :mod:`pipeplan.intake.tp_sequence` runs them; and
                the host cost of its collectives, k o_sp in c_F and 2 k o_sp in c_B)
    s          = 1 - phi + phi / t                             the per-rank share of compute
    forward    = f s + c_F
    backward   = g s + c_B                   (the input gradients' all-reduces)
    I, W       = I s + c_B,  W s             (the all-reduces belong to I: zero-bubble split)
    recompute  = fc s + c_F (forward),  r s + c_F + c_B (backward: the recomputed forward's too)
    params     = (w - w_s) + w_s / t
    saved      = a (1 - sigma + sigma / t); with sequence parallelism a (1 - sigma - q +
                 (sigma + q) / t), q the share that only per-token ops save (the norms and
                 residuals between the sub-blocks; their output that the column-wise projections
                 save is gathered, whole); ``weight_held_bytes`` and ``peak_bytes`` scale the
                 same way, and a unit whose output is a row-wise one's keeps 1 / t of it
    largest    = max(big / t, min(big, w - w_s))       (the largest parameter is sharded, or
                 one of the whole ones: an upper bound either way)

The backward's count is torch's, which the runtime runs (``parallelize_module`` with
``ColwiseParallel`` per projection): each column-wise projection all-reduces its own input's
gradient (query, key and value: three; gate and up: two), where Megatron sums the shared input's
gradient first and all-reduces once per sub-block.  o_tp (``Cluster.tp_op_overhead_s``) is the
host work torch's DTensor adds per split projection and pass, beyond the compute and the
collective, and o_sp (``Cluster.tp_sequence_overhead_s``) sequence parallelism's per
collective (a gather in the forward; the reduce-scatter's all-gather and the norm weights'
all-reduce in the backward), which ``pipeplan calibrate`` measures
(:mod:`pipeplan.runtime.tp_overhead`; 0 where not measured).

The solvers divide a profile's seconds by each device's ``speed`` (a device faster than the
profiled host), but a collective's seconds are the link's and the host cost is the host's: the
per-rank profile stores c_F and c_B times the fastest device's speed, so that a rank pays them
as they are (and at least them on a slower device of a mixed cluster, an upper bound).

A unit's measured ``tp_timings[t][b]`` (collectives included) is used as it stands where
present and it measured what the plan runs (the measurement runs without sequence parallelism,
and a head with its logits gathered, not loss-parallel); otherwise the times above are
modelled from its unsharded ``timings[b]``.  A unit without an annotation is run whole by
every rank: its times and bytes are unchanged.  The tensors crossing a cut are unchanged (each
rank sends the whole activation to its peer in the next stage), except with sequence parallelism, where each hidden state (a tensor of a row-wise
projection's output size per sample, X / k) crosses as the rank's 1 / t of the sequence.
A cut's tensors that t ranks hold split by heads (``Cut.tp_gather_bytes_per_sample``: inside
a sub-block, or T5's position bias) are all-gathered before they are sent and their gradient
reduce-scattered: charged as that many more bytes on the stage link, which bounds the
all-gather's bandwidth term, (t - 1) / t of them on the intra-node link, from above on a link
no faster than it; its t - 1 latencies are not charged.
With ``loss_parallel`` a vocabulary-split head's logits are not gathered (its c_F loses the
all-gather; the unit's output is 1 / t), and the loss's compute and bytes are 1 / t, plus three
all-reduces of one float per token in its forward.
Left whole, an upper bound: the loss (without ``loss_parallel``), tied parameters' copies, the
optimizer step's curve (evaluated at the per-rank bytes, which the smaller parameters make
cheaper, as a rank updates only its shard).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pipeplan.planner.collectives import Collective, ring_cost
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import Cluster, Cut, Profile, Timing, Unit, UnitTensorParallel

__all__ = [
    "check_loss_parallel",
    "check_tensor_parallel",
    "collective_s",
    "is_annotated",
    "source_note",
    "tp_profile",
]


def is_annotated(profile: Profile) -> bool:
    """Whether any unit of ``profile`` splits over tensor-parallel ranks."""
    return any(u.tensor_parallel is not None for u in profile.units)


def check_loss_parallel(profile: Profile) -> None:
    """Raise :class:`InvalidRequestError` unless a unit of ``profile`` holds a head split over
    the vocabulary (a ``colwise_gather`` style), whose logits the loss can read split."""
    if not any(
        "colwise_gather" in u.tensor_parallel.styles.values()
        for u in profile.units
        if u.tensor_parallel is not None
    ):
        raise InvalidRequestError(
            "--loss-parallel needs a head split over the vocabulary (an untied output "
            "projection the model's layout splits), and this profile has none; plan without "
            "--loss-parallel"
        )


def check_tensor_parallel(profile: Profile, t: int) -> None:
    """Raise :class:`InvalidRequestError` when ``profile`` cannot run t-way tensor parallel:
    no unit splits (the profile's note, or why), or t does not divide a split dimension (the
    first such, by name)."""
    if t == 1:
        return
    if not is_annotated(profile):
        why = profile.tensor_parallel_note or "no unit of the profile has a tensor-parallel split"
        raise InvalidRequestError(f"--tensor-parallel {t}: {why}; plan --tensor-parallel 1")
    for u in profile.units:
        for dim, size in (u.tensor_parallel.divisors if u.tensor_parallel else {}).items():
            if size % t:
                raise InvalidRequestError(
                    f"--tensor-parallel {t} does not divide the model's {dim} ({size}, unit "
                    f"{u.name}); give a divisor of {size}"
                )


def collective_s(
    cluster: Cluster, nbytes: float, count: int, kind: Literal["reduce", "gather"] = "reduce"
) -> float:
    """c: seconds of ``count`` tensor-parallel collectives over ``nbytes`` in all on the
    cluster's t ranks, on the intra-node link; 0 for t = 1 or nothing to move.  ``reduce``:
    all-reduces summing them (reduce-scatter and all-gather pairs with
    ``sequence_parallel``); ``gather``: all-gathers making them whole (a vocabulary-split
    head's logits)."""
    t = cluster.tensor_parallel
    if t == 1 or count == 0:
        return 0.0
    link = cluster.intra_node_link or cluster.link
    if kind == "gather":
        kinds: tuple[Collective, ...] = ("all_gather",)
    elif cluster.sequence_parallel:
        kinds = ("reduce_scatter", "all_gather")
    else:
        kinds = ("all_reduce",)
    out = 0.0
    for name in kinds:
        alpha, beta = ring_cost(link, t, name)
        out += alpha * nbytes + beta * count
    return out


def _scale(nbytes: int | None, share: float) -> int | None:
    return None if nbytes is None else round(nbytes * share)


def _modelled(timing: Timing, ann: UnitTensorParallel, b: int, cluster: Cluster) -> Timing:
    """One annotated unit's per-rank timing at size b, from its unsharded one (docstring)."""
    t = cluster.tensor_parallel
    s = 1.0 - ann.sharded_flop_fraction + ann.sharded_flop_fraction / t
    split = ann.sharded_saved_fraction
    if cluster.sequence_parallel:
        split = min(1.0, split + ann.sequence_saved_fraction)
    keep = 1.0 - split + split / t
    per = ann.allreduce_bytes_per_sample * b / max(ann.allreduces, 1)  # one all-reduce's
    cols = sum(style == "colwise" for style in ann.styles.values())
    heads = sum(style == "colwise_gather" for style in ann.styles.values())
    hidden = cluster.sequence_parallel and ann.allreduces > 0 and not heads  # ends row-wise
    hidden = hidden or (cluster.loss_parallel and heads > 0)  # the logits, split
    host = cluster.tp_op_overhead_s * len(ann.styles)
    # sequence parallelism's collectives, per row-wise projection: 1 forward, 2 backward
    seq = cluster.tp_sequence_overhead_s * ann.allreduces if cluster.sequence_parallel else 0.0
    # the solvers divide a profile's seconds by the device's speed, not a link's: stored times
    # the fastest device's speed, each rank pays c (at least c on a slower device)
    speed = max(d.speed for d in cluster.devices)
    gather = (
        0.0
        if cluster.loss_parallel  # the loss reads the logits split
        else collective_s(cluster, ann.allgather_bytes_per_sample * b, heads, "gather")
    )
    head_in = collective_s(cluster, ann.gather_input_bytes_per_sample * b, heads)
    c = (collective_s(cluster, per * ann.allreduces, ann.allreduces) + gather + host + seq) * speed
    rows = ann.allreduces if cluster.sequence_parallel else 0  # reduce-scatters' backward
    cb = (
        collective_s(cluster, per * cols, cols)
        + collective_s(cluster, per * rows, rows, "gather")
        + head_in
        + host
        + 2 * seq
    ) * speed

    def opt(x: float | None, extra: float) -> float | None:
        return None if x is None else x * s + extra

    return timing.model_copy(
        update={
            "forward_s": timing.forward_s * s + c,
            "backward_s": timing.backward_s * s + cb,
            "forward_spread_s": timing.forward_spread_s * s,
            "backward_spread_s": timing.backward_spread_s * s,
            "recompute_forward_s": opt(timing.recompute_forward_s, c),
            "recompute_backward_s": opt(timing.recompute_backward_s, c + cb),
            "backward_input_s": opt(timing.backward_input_s, cb),
            "backward_weight_s": opt(timing.backward_weight_s, 0.0),
            "saved_bytes": _scale(timing.saved_bytes, keep),
            "weight_held_bytes": _scale(timing.weight_held_bytes, keep),
            "peak_bytes": _scale(timing.peak_bytes, keep),
            "output_bytes": _scale(timing.output_bytes, 1.0 / t) if hidden else timing.output_bytes,
        }
    )


def _measured(unit: Unit, cluster: Cluster) -> dict[int, Timing]:
    """The unit's ``tp_timings`` at the cluster's t where they measured what the plan runs:
    none under sequence parallelism, and none for a vocabulary-split head under loss
    parallelism (the measurement splits the units without either)."""
    head = (
        unit.tensor_parallel is not None
        and "colwise_gather" in unit.tensor_parallel.styles.values()
    )
    if cluster.sequence_parallel or (cluster.loss_parallel and head):
        return {}
    return unit.tp_timings.get(cluster.tensor_parallel, {})


def _unit(unit: Unit, cluster: Cluster) -> Unit:
    ann = unit.tensor_parallel
    if ann is None:
        return unit
    t = cluster.tensor_parallel
    measured = _measured(unit, cluster)
    timings = {
        b: measured[b] if b in measured else _modelled(timing, ann, b, cluster)
        for b, timing in unit.timings.items()
    }
    whole = unit.param_bytes - min(ann.sharded_param_bytes, unit.param_bytes)
    big = unit.largest_param_bytes
    return unit.model_copy(
        update={
            "timings": timings,
            "param_bytes": whole + round((unit.param_bytes - whole) / t),
            "largest_param_bytes": max(round(big / t), min(big, whole)),
        }
    )


def _sequence_cut(cut: Cut, hidden: set[int], t: int) -> Cut:
    """``cut`` with each hidden state (``hidden``: a row-wise output's bytes per sample) at
    1 / t, the rank's share of the sequence it sends under sequence parallelism."""
    tensors = tuple(
        x.model_copy(update={"bytes_per_sample": round(x.bytes_per_sample / t)})
        if x.bytes_per_sample in hidden
        else x
        for x in cut.tensors
    )
    if tensors == cut.tensors:
        return cut
    less = sum(x.bytes_per_sample for x in cut.tensors) - sum(x.bytes_per_sample for x in tensors)
    return cut.model_copy(
        update={"tensors": tensors, "bytes_per_sample": max(cut.bytes_per_sample - less, 0)}
    )


def tp_profile(profile: Profile, cluster: Cluster) -> Profile:
    """The profile one of t = ``cluster.tensor_parallel`` ranks of a stage runs (module
    docstring); ``profile`` itself for t = 1.  Raises :class:`InvalidRequestError` when t does
    not divide a split dimension or nothing splits (:func:`check_tensor_parallel`)."""
    t = cluster.tensor_parallel
    if t == 1:
        return profile
    check_tensor_parallel(profile, t)
    units = tuple(_unit(u, cluster) for u in profile.units)
    cuts = tuple(
        c.model_copy(update={"bytes_per_sample": c.bytes_per_sample + c.tp_gather_bytes_per_sample})
        if c.tp_gather_bytes_per_sample
        else c
        for c in profile.cuts
    )
    if cluster.sequence_parallel:
        hidden = {
            round(u.tensor_parallel.allreduce_bytes_per_sample / u.tensor_parallel.allreduces)
            for u in profile.units
            if u.tensor_parallel is not None and u.tensor_parallel.allreduces
        }
        cuts = tuple(_sequence_cut(c, hidden, t) for c in cuts)
    loss = profile.loss
    if cluster.loss_parallel:
        loss = {b: _split_loss(timing, units, b, cluster) for b, timing in loss.items()}
    return profile.model_copy(update={"units": units, "cuts": cuts, "loss": loss})


def _split_loss(timing: Timing, units: Sequence[Unit], b: int, cluster: Cluster) -> Timing:
    """The loss on 1 / t of the vocabulary (torch's ``loss_parallel``): its compute and
    bytes divided by t, plus the forward's three all-reduces of one float per token (the
    maximum, the sum of exponentials, the target's logit)."""
    t, speed = cluster.tensor_parallel, max(d.speed for d in cluster.devices)
    heads = [u.tensor_parallel for u in units if u.tensor_parallel is not None]
    per_token = max(
        (
            a.allgather_bytes_per_sample / size
            for a in heads
            for name, style in a.styles.items()
            if style == "colwise_gather"
            for dim, size in a.divisors.items()
            if dim.startswith(name.rsplit(".", 1)[-1])
        ),
        default=0.0,
    )
    c = collective_s(cluster, 3 * per_token * b, 3) * speed

    def part(x: float | None) -> float | None:
        return None if x is None else x / t

    return timing.model_copy(
        update={
            "forward_s": timing.forward_s / t + c,
            "backward_s": timing.backward_s / t,
            "backward_input_s": part(timing.backward_input_s),
            "backward_weight_s": part(timing.backward_weight_s),
            "saved_bytes": _scale(timing.saved_bytes, 1.0 / t),
            "output_bytes": _scale(timing.output_bytes, 1.0 / t),
            "peak_bytes": _scale(timing.peak_bytes, 1.0 / t),
        }
    )


def source_note(profile: Profile, cluster: Cluster) -> str:
    """One line: how the per-rank profile of the cluster's t-way tensor parallelism was made
    (how many split units measured at t, how many modelled, how many run whole)."""
    t = cluster.tensor_parallel
    if t == 1:
        return profile.tensor_parallel_note or "tensor parallel 1"
    split = [u for u in profile.units if u.tensor_parallel is not None]
    measured = sum(all(b in _measured(u, cluster) for b in profile.microbatch_sizes) for u in split)
    whole = profile.n_units - len(split)
    return (
        f"tensor parallel {t}: {len(split)} units split ({measured} measured at t = {t}, "
        f"{len(split) - measured} modelled from the unsharded times), {whole} run whole"
    )
