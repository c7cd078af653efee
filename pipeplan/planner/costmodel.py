"""The closed-form cost model of a checkpointed GPipe pipeline.

Units u = 0..n-1 in order, p contiguous stages, batch B, m micro-batches of size b = B/m.  Stage
j covers units l..r (inclusive) and runs on device j (speed v_j, memory cap_j):

    F_j = sum_{u=l..r} f_u(b) / v_j + o      (+ the loss's forward on the last stage)
    B_j = sum_{u=l..r} g_u(b) / v_j + o      (+ the loss's backward on the last stage)

When the stage recomputes, f_u and g_u give way to the unit's measured checkpointed forward
and backward, less what one checkpoint call adds by itself, (c_F, c_B) =
``Profile.checkpoint_call_s``, and the stage pays that once (it makes one call):

    F_j = sum_u (fc_u(b) - c_F) / v_j + c_F / v_j + o,   B_j = sum_u (r_u(b) - c_B) / v_j + c_B / v_j + o

(fc_u defaults to f_u and r_u to f_u + g_u in profiles that lack them).  Then
    C_j = 2 * transfer(x_{r+1}(b))   (activations forward, their gradient back; 0 for j = p-1)
    c_j = F_j + B_j                  (the stage's compute)
    t_j = c_j + C_j
    U_j = U(w_j) / v_j               (the optimizer's update of the stage's parameters)
    D_j = sum_{i<j} (B_i + C_i / 2)  (the drain between stage j's last backward and the step's)
    R = max_j (U_j - D_j)            (the updates' tail; R >= U_0, D_0 = 0; see Tied gradients
                                      and Concurrent updates)
    T(m) = sum_j t_j + (m - 1) * (max_j (t_j - k c_j) + k * sum_j c_j) + R + c   (step time)

    M_j = w_j (1 + k)                    params and k optimizer states (w_j includes copies
                                         of shared parameters)
        + m x_l + m x_{r+1}              buffers: the inputs of every micro-batch (stage 0's
                                         share of the batch, a later stage's receive buffers,
                                         one per micro-batch: a recomputing stage stashes
                                         these) and the receive buffers of the output's
                                         gradient (x_n = 0)
        + W_j                            one backward's working gradients: [j > 0] x_l, the
                                         input's, and on the last stage 2 y, the loss's and
                                         the output's
        + max(q_j H_j + A_j,             the first backward: no gradient exists yet
              w_j + q'_j H_j + max(A_j, G_j))   a later one: the gradients exist

    H_j = x_{r+1} + [no recompute] sum_u a_u(b) + [j = p-1] (y + a_loss)
                                         held per micro-batch in flight until its backward:
                                         the stage's outputs, its activations, and on the last
                                         stage the model's outputs and the loss's saved tensors
    A_j = [recompute] sum_u a_u(b)       the activations a recomputing stage remakes
    G_j = [m > 1] max_u big_u            the largest parameter's gradient, made in a temporary
                                         before it is added to the held one
    q'_j = q_j for 1F1B with m > q_j (a forward follows each backward), else q_j - 1

with y the model's output bytes per micro-batch.  The gradients are set to ``None`` at the
start of every step, so the first backward runs before any exists: under GPipe the peak comes
either there, with every in-flight micro-batch's activations, or at a later backward, with the
gradients and one micro-batch fewer.  A recomputing stage's remade activations are freed as its
backward goes, before the temporary of the first unit's parameter (the embedding) appears, so
the two count as a max.  The optimizer's step adds nothing (fused Adam has no temporaries,
:mod:`pipeplan.planner.optim`).  ``benchmarks/memory`` measures it on 2 CPU ranks.

where U(w) is the plan's optimizer's step time over w parameter bytes, fitted to the profile's
measurements (:func:`pipeplan.planner.updates.update_cost`), q_j = m for GPipe and min(m, p - j) for
1F1B (micro-batches in flight on stage j), and
``transfer`` is :meth:`pipeplan.planner.types.Link.one_way_s`, c the engine's fixed cost per step
(``Cluster.step_overhead_s``: zeroing gradients, splitting the batch, collecting the loss; every
rank pays it at once, so the step pays it once) and o is the pipeline engine's
fixed cost per forward or backward operation (``Cluster.engine_overhead_s``, from calibration;
a 1-stage plan has its own).  A stage recomputes under the
policy ``always``; under ``except_last`` (torchgpipe's default) every stage but the last; under
``never`` none; under ``auto`` (the default) each stage whose activations would not fit its
device if it kept them (:func:`stage_recomputes`: exact, since keeping is never slower).

Contention.  On hosts where ranks share cores (two ranks on two vCPUs here), a stage computes
more slowly while other stages compute too.  The simulator slows every forward and backward by
the factor 1 + k a, a the number of *other* stages computing at that moment.  In a steady-state
slot the bottleneck stage b does c_b of work while every other stage j does its c_j beside it;
integrating the rates, the slot lasts c_b + k sum_{j != b} c_j of wall time.  Adding the
transfers, the slot is max_j (t_j - k c_j) + k sum_j c_j: a bottleneck over stages plus a sum,
so the DP stays exact.  For p identical stages GPipe's fill and drain have slots with 1, 2, ..,
p stages busy, (p - 1)(m - 1) "other stage" overlaps in all, and T(m) is the simulator's
makespan exactly; for p = 2 it is exact whenever one stage is the bottleneck of both the forward
and the backward slots.  A light stage contends only for its own work, not for the whole slot
(the flat factor before it charged k c_b whatever the light stage's size, which made the solvers
shun unbalanced plans that run faster).  k is 0, and T(m) the plain GPipe form, when m = 1 or
p = 1 (nothing overlaps), and on devices that share nothing.

Updates.  Each stage updates its parameters once per step, after its last backward.  Stage 0
runs the step's last backward, so its update U_0 ends the step; stage j's update starts D_j
earlier (the last micro-batch's gradient crosses every cut before it and runs the backward of
every stage there) and outlasts the step's end by U_j - D_j.  R is exact when those stages
wait for the gradient (they do in the drain unless an earlier stage is the backward bottleneck,
when R errs high).  A plan that puts most parameters on a late stage pays for it: the DP's
earlier form charged U_0 alone.

Tied gradients.  A parameter used on several stages (a tied embedding and LM head) has a copy
on each; after their last backward those stages sum its gradient with one all-reduce
(``Cluster.allreduce_s`` of its bytes, A) and only then update.  The all-reduce starts when
the last of them arrives: the earliest stage s, which finishes D_s before stage 0 does.  So a
holder j ends A - D_s + U_j after stage 0's last backward instead of U_j - D_j:

    R = max_j (ready_j + U_j),  ready_j = -D_j, then for each all-reduce (stage sets ascending,
        as the runtime runs them) ready_i = max_{i' in set} ready_i' + A for its stages i.

With one shared parameter this is  max(max_{j not holding} (U_j - D_j), A - D_s + max_{j
holding} U_j); the runtime's per-step "tied" span is this wait plus A.

Concurrent updates.  Updates that run at the same time slow each other (ranks sharing cores
and memory bandwidth; measured on two ranks of a 2-vCPU host, a 6.6 ms Adam step took 7.9 ms
beside a 12.1 ms one, which took 13.0 ms).  Egalitarian processor sharing fits: while a
updates are under way each progresses at rate 1 / (1 + kappa_u (a - 1)), kappa_u =
``Cluster.update_contention``.  Stage j's update is a job of U_j seconds released at ready_j,
and R = max(0, max_j E_j) with E_j its end under that sharing
(:func:`pipeplan.planner.updates.shared_ends`; E_j = ready_j + U_j when kappa_u = 0).  Two holders of a
tied parameter that start together after its all-reduce end at

    A - D_s + U_max + kappa_u U_min,

and two updates that do not overlap end as before.  Updates contend only with each other, not
with the backwards of the stages before them that run during the drain (a modelling choice:
only the contention between updates is measured, and a backward is neither slowed by an update
nor slows one).

T(m) equals the schedule simulator's makespan for identical stages, and for two stages whose
bottleneck is the same stage forward and backward; GPipe's makespan uses separate forward and
backward maxima, so T(m) is below it when the stages' backward/forward ratios differ enough to
move the bottleneck (see :mod:`pipeplan.planner.replay`).

The per-unit tables these formulas read (f_u, g_u, a_u, w_u, x_u and their prefix sums) are
built by :mod:`pipeplan.planner.unitcosts`; :mod:`pipeplan.planner.evaluate` turns a partition into the stages
and the Plan of this model.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from pipeplan.planner.collectives import StateFactors, state_factors
from pipeplan.planner.types import (
    Cluster,
    MemoryBreakdown,
    PlanOptions,
    Profile,
    TiedSync,
)
from pipeplan.planner.unitcosts import UnitCosts, microbatch_choices, unit_costs

__all__ = [
    "bubble_fraction",
    "contention",
    "in_flight",
    "lower_bound",
    "memory_parts",
    "recomputes",
    "stage_memory",
    "stage_params",
    "stage_recomputes",
    "stage_time",
    "step_time",
    "tied_syncs",
]


def recomputes(policy: str, j: int, p: int) -> bool:
    """Whether stage j of p recomputes its forward in the backward pass under a fixed policy
    (``auto`` decides per stage from its memory: :func:`stage_recomputes`)."""
    if policy == "auto":
        raise ValueError("the policy auto decides per stage: use stage_recomputes")
    return policy == "always" or (policy == "except_last" and j < p - 1)


def stage_params(costs: UnitCosts, l: int, r: int) -> int:
    """w_j: parameter bytes of a stage over units l..r, copies of shared parameters included."""
    return int(costs.Pw[r + 1] - costs.Pw[l]) + int(costs.shared_bytes(l, r))


def stage_recomputes(
    costs: UnitCosts, cluster: Cluster, options: PlanOptions, l: int, r: int, j: int
) -> bool:
    """Whether stage j over units l..r recomputes: the policy's rule, or under ``auto``
    whether keeping its activations would not fit its device.

    ``auto`` is exact and stage-local: a stage's choice changes only its own F_j, B_j and M_j,
    keeping is never slower (F_j and B_j are no larger: the tables clip the checkpointed times
    at the plain ones, :mod:`pipeplan.planner.unitcosts`), and T(m) never decreases when one
    stage's F_j or B_j grows (its sum and its bottleneck grow with them; the updates' tail R
    can shrink as a later stage's drain grows, but by no more than the drain does, which the
    sum has already charged).  So every stage that can keep should, and the rest recompute.
    """
    p = cluster.n_stages
    if options.checkpoint != "auto":
        return recomputes(options.checkpoint, j, p)
    w = stage_params(costs, l, r)
    state = state_factors(options.optimizer, cluster)
    keep = sum(memory_parts(costs, options, j, p, l, r, w, False, state=state).values())
    return bool(float(keep) > cluster.devices[j].memory_bytes)


def in_flight(schedule: str, j: int, p: int, m: int) -> int:
    """q_j: micro-batches whose inputs or activations stage j holds at once."""
    return m if schedule == "gpipe" else min(m, p - j)


def _comm(costs: UnitCosts, cluster: Cluster, cut: int) -> float:
    """Seconds to send x_cut forward and its gradient back (0 past the last unit)."""
    nbytes = float(costs.x[cut])
    if cut >= costs.n or nbytes <= 0:
        return 0.0
    return 2.0 * cluster.link.transfer_s(nbytes, int(costs.msgs[cut]))


def stage_time(
    costs: UnitCosts,
    cluster: Cluster,
    options: PlanOptions,
    l: int,
    r: int,
    j: int,
    recompute: bool | None = None,
) -> tuple[float, float, float]:
    """(F_j, B_j, C_j) of stage j covering units l..r, recomputing or not as ``recompute``
    says (default: :func:`stage_recomputes`)."""
    p = cluster.n_stages
    speed = cluster.devices[j].speed
    if recompute is None:
        recompute = stage_recomputes(costs, cluster, options, l, r, j)
    if recompute:
        F = (float(costs.Pfc[r + 1] - costs.Pfc[l]) + costs.call_f) / speed
        B = (float(costs.Pr[r + 1] - costs.Pr[l]) + costs.call_b) / speed
    else:
        F = float(costs.Pf[r + 1] - costs.Pf[l]) / speed
        B = float(costs.Pg[r + 1] - costs.Pg[l]) / speed
    F += cluster.engine_overhead_s
    B += cluster.engine_overhead_s
    if j == p - 1:  # the loss runs on the last stage, outside its recomputed region
        F += costs.loss_f / speed
        B += costs.loss_g / speed
    C = _comm(costs, cluster, r + 1) if j < p - 1 else 0.0
    return F, B, C


def memory_parts(
    costs: UnitCosts,
    options: PlanOptions,
    j: int,
    p: int,
    l: np.ndarray | int,
    r: np.ndarray | int,
    w: np.ndarray | float,
    recompute: bool | None = None,
    *,
    state: StateFactors,
) -> dict[str, np.ndarray]:
    """M_j by part at its peak, for stage j of p over units l..r holding ``w`` parameter bytes
    (shared copies included; arrays broadcast; see the module docstring), recomputing as
    ``recompute`` says (default: the fixed policy's rule), holding ``state`` bytes of training
    state per parameter byte (:func:`pipeplan.planner.collectives.state_factors`: replicated or
    FSDP-sharded over the data-parallel ranks).  The parts sum to M_j; ``grads`` is 0 where the
    peak comes before the first gradient exists.  The solvers' tables and
    :func:`stage_memory` both read it, so they agree on what fits."""
    l_arr, r_arr, w_arr = np.asarray(l), np.asarray(r), np.asarray(w, dtype=np.float64)
    m, q = costs.m, in_flight(options.schedule, j, p, costs.m)
    later = q if options.schedule == "1f1b" and m > q else q - 1
    x_in = costs.x[l_arr].astype(np.float64)
    x_out = costs.x[r_arr + 1].astype(np.float64)
    acts = costs.Pa[r_arr + 1] - costs.Pa[l_arr]
    rc = recomputes(options.checkpoint, j, p) if recompute is None else recompute
    last = j == p - 1
    held_acts = (0.0 if rc else acts) + (costs.loss_a if last else 0.0)  # per micro-batch
    held_out = x_out + (costs.out if last else 0.0)
    remade = acts if rc else 0.0 * acts
    temp = costs.largest_param(l_arr, r_arr) if m > 1 else 0.0 * acts
    first = q * (held_acts + held_out) + remade
    second = state.grads * w_arr + later * (held_acts + held_out) + np.maximum(remade, temp)
    at_first = first >= second
    n_held = np.where(at_first, q, later)
    parts = {
        "params": state.params * w_arr + 0.0 * acts,
        "grads": np.where(at_first, 0.0, state.grads * w_arr),
        "optimizer": state.optimizer * w_arr + 0.0 * acts,
        "stashed_inputs": m * x_in,
        "gradient_buffers": m * x_out,
        "activations": n_held * held_acts + np.where(at_first | (remade >= temp), remade, 0.0),
        "outputs": n_held * held_out,
        "transient": x_in * (j > 0)
        + (2 * costs.out if last else 0.0)
        + np.where(at_first | (remade >= temp), 0.0, temp),
    }
    if state.shard > 0 and costs.gloo:  # FSDP's reduction on gloo (collectives docstring):
        # it holds (2 + 2/d) w beside the optimizer and the buffers, where the backward held
        # (1 + 1/d) w of parameters, its gradients, activations, outputs and transients
        held = parts["grads"] + parts["activations"] + parts["outputs"] + parts["transient"]
        excess = (1.0 + state.shard) * w_arr - held
        parts["transient"] = parts["transient"] + np.maximum(excess, 0.0)
    return parts


def stage_memory(
    costs: UnitCosts,
    cluster: Cluster,
    options: PlanOptions,
    l: int,
    r: int,
    j: int,
    recompute: bool | None = None,
) -> MemoryBreakdown:
    """M_j of stage j covering units l..r, broken down at its peak (``recompute`` as in
    :func:`stage_time`)."""
    if recompute is None:
        recompute = stage_recomputes(costs, cluster, options, l, r, j)
    w = stage_params(costs, l, r)
    state = state_factors(options.optimizer, cluster)
    parts = memory_parts(costs, options, j, cluster.n_stages, l, r, w, recompute, state=state)
    ints = {key: int(v) for key, v in parts.items()}
    return MemoryBreakdown(**ints, total=sum(ints.values()))


def contention(cluster: Cluster, m: int) -> float:
    """k in effect: ``cluster.contention`` when stages overlap (p >= 2 and m >= 2), else 0."""
    return cluster.contention if cluster.n_stages > 1 and m > 1 else 0.0


def step_time(
    times: Sequence[float], m: int, busy: Sequence[float] = (), kappa: float = 0.0
) -> float:
    """sum_j t_j + (m - 1) (max_j (t_j - k c_j) + k sum_j c_j): T(m) before the updates' tail.

    ``busy`` holds c_j = F_j + B_j (the stage's time off the link); with ``kappa`` = 0 (the
    default) it is unused and the form is sum_j t_j + (m - 1) max_j t_j.
    """
    if not kappa or m <= 1 or len(times) < 2:
        return float(sum(times) + (m - 1) * max(times))
    slot = max(t - kappa * c for t, c in zip(times, busy, strict=True)) + kappa * sum(busy)
    return float(sum(times) + (m - 1) * slot)


def tied_syncs(
    shared: Sequence[tuple[int, Sequence[int] | np.ndarray]],
    cluster: Cluster,
    starts: Sequence[int],
) -> list[TiedSync]:
    """The all-reduces the partition with stages starting at ``starts`` needs: one per distinct
    set of two or more stages holding users of the same shared parameters, ascending.
    ``shared``: (bytes, user units) per shared parameter (``UnitCosts.shared``)."""
    groups: dict[tuple[int, ...], int] = {}
    for nbytes, users in shared:
        stages = tuple(sorted({bisect_right(starts, int(u)) - 1 for u in users}))
        if len(stages) > 1:
            groups[stages] = groups.get(stages, 0) + int(nbytes)
    return [
        TiedSync(stages=k, bytes=v, seconds=cluster.allreduce_s(v))
        for k, v in sorted(groups.items())
    ]


def bubble_fraction(
    times: Sequence[float], m: int, busy: Sequence[float] = (), kappa: float = 0.0
) -> float:
    """1 - (m * mean_j t_j) / T(m) (updates left out); (p - 1)/(m + p - 1) when all t_j are
    equal and k = 0."""
    total = step_time(times, m, busy, kappa)
    if total <= 0:
        return 0.0
    return float(1.0 - m * sum(times) / len(times) / total)


def lower_bound(profile: Profile, cluster: Cluster, options: PlanOptions) -> float:
    """A bound no partition beats: min over m of S_lb + (m - 1) max(S_lb / p, max_u t_u).

    t_u = (f_u + g_u) / s_max, replaced by the checkpointed (fc_u - c_F + r_u - c_B) / s_max
    under the policy ``always`` and by the smaller of the two under ``except_last`` and
    ``auto``;
    S_lb = sum_u t_u.  Communication, the engine's and the checkpoint calls' own costs are
    taken as free, but for the engine's fixed cost per step c, which every plan pays.
    """
    p = cluster.n_stages
    s_max = max(d.speed for d in cluster.devices)
    best = np.inf
    for m in microbatch_choices(profile, options):
        c = unit_costs(profile, m)
        plain, rc = c.f + c.g, np.diff(c.Pfc) + np.diff(c.Pr)
        least = np.minimum(plain, rc)
        per_unit = {"always": rc, "except_last": least, "never": plain, "auto": least}[
            options.checkpoint
        ] / s_max
        total = float(per_unit.sum())
        best = min(best, total + (m - 1) * max(total / p, float(per_unit.max())))
    return float(best) + cluster.step_overhead_s
