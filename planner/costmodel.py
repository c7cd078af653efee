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

    M_j = w_j * (2 + k)                            params, grads, k optimizer states
                                                   (w_j includes copies of shared parameters)
        + q_j * x_l(b)                             stashed stage inputs, when recomputing
        + sum_u a_u(b)        (recompute)          one micro-batch's activations
        | q_j * sum_u a_u(b)  (no recompute)       all in-flight micro-batches' activations
        (+ q_j * the loss's saved bytes on the last stage)

where U(w) is the plan's optimizer's step time over w parameter bytes, fitted to the profile's
measurements (:func:`planner.updates.update_cost`), q_j = m for GPipe and min(m, p - j) for
1F1B (micro-batches in flight on stage j), and
``transfer`` is :meth:`planner.types.Link.one_way_s`, c the engine's fixed cost per step
(``Cluster.step_overhead_s``: zeroing gradients, splitting the batch, collecting the loss; every
rank pays it at once, so the step pays it once) and o is the pipeline engine's
fixed cost per forward or backward operation (``Cluster.engine_overhead_s``, from calibration;
a 1-stage plan has its own).  A stage recomputes under the
policy ``always``; under ``except_last`` (torchgpipe's default) every stage but the last; under
``never`` none.

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
and R = max(0, max_j E_j) with E_j its end under that sharing (:func:`shared_ends`; E_j =
ready_j + U_j when kappa_u = 0).  Two holders of a tied parameter that start together after
its all-reduce end at

    A - D_s + U_max + kappa_u U_min,

and two updates that do not overlap end as before.  Updates contend only with each other, not
with the backwards of the stages before them that run during the drain (a modelling choice:
only the contention between updates is measured, and a backward is neither slowed by an update
nor slows one).

T(m) equals the schedule simulator's makespan for identical stages, and for two stages whose
bottleneck is the same stage forward and backward; GPipe's makespan uses separate forward and
backward maxima, so T(m) is below it when the stages' backward/forward ratios differ enough to
move the bottleneck (see :mod:`planner.simulate`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from planner.errors import InvalidRequestError
from planner.simulate import simulate
from planner.types import (
    OPTIMIZER_STATES,
    Cluster,
    MemoryBreakdown,
    Plan,
    PlanOptions,
    Profile,
    Stage,
    TiedSync,
)
from planner.updates import shared_ends, update_cost, update_tail

__all__ = [
    "UnitCosts",
    "bubble_fraction",
    "build_stages",
    "check_request",
    "contention",
    "evaluate",
    "holds_user",
    "in_flight",
    "lower_bound",
    "microbatch_choices",
    "recomputes",
    "shared_ends",
    "stage_memory",
    "stage_time",
    "step_time",
    "tied_syncs",
    "unit_costs",
    "update_tail",
]


@dataclass(frozen=True, slots=True)
class UnitCosts:
    """Per-unit arrays for one micro-batch count m (size b = B / m), plus prefix sums.

    ``x[k]`` is the bytes live before unit k for one micro-batch (``x[0]`` = model inputs,
    ``x[n] = 0``); ``msgs[k]`` the number of tensors crossing there.  ``P*`` arrays are prefix
    sums with a leading zero: sum over units l..r of f is ``Pf[r + 1] - Pf[l]``.
    """

    m: int
    b: int
    f: np.ndarray
    g: np.ndarray
    a: np.ndarray
    w: np.ndarray
    x: np.ndarray
    msgs: np.ndarray
    Pf: np.ndarray
    Pg: np.ndarray
    Pa: np.ndarray
    Pw: np.ndarray
    Pr: np.ndarray
    """Prefix sums of r_u - c_B: the backward under checkpointing (recompute included), less
    the checkpoint call's own cost."""
    Pfc: np.ndarray
    """Prefix sums of fc_u - c_F: the forward under checkpointing, less the call's own cost."""
    call_f: float = 0.0
    call_b: float = 0.0
    """c_F, c_B: one checkpoint call's own forward and backward seconds (once per recomputing
    stage)."""
    shared: tuple[tuple[int, np.ndarray], ...] = ()
    """(bytes, ascending user units) of every parameter used by several units."""
    loss_f: float = 0.0
    loss_g: float = 0.0
    """Forward and backward seconds of the loss on one micro-batch (last stage only)."""
    loss_a: float = 0.0
    """Bytes the loss saves for backward per micro-batch (kept for every one in flight)."""

    @property
    def n(self) -> int:
        return len(self.f)

    def compute_prefix(self, recompute: bool) -> np.ndarray:
        """Prefix sums of a unit's forward + backward on a stage that does or does not
        recompute (the checkpoint call's own cost left out)."""
        return self.Pfc + self.Pr if recompute else self.Pf + self.Pg

    def shared_bytes(self, l: np.ndarray | int, r: np.ndarray | int) -> np.ndarray:
        """Bytes of shared parameters a stage l..r holds but does not own (broadcasts).

        A stage holds a copy of a shared parameter when it contains one of its users; the
        bytes are already in ``w`` of the owner (the first user).
        """
        l_arr, r_arr = np.asarray(l), np.asarray(r)
        out = np.zeros(np.broadcast(l_arr, r_arr).shape)
        for nbytes, users in self.shared:
            owns = (l_arr <= users[0]) & (users[0] <= r_arr)
            out = out + nbytes * (holds_user(users, l_arr, r_arr) & ~owns)
        return out


def holds_user(users: np.ndarray, l: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Whether stages l..r contain one of ``users`` (ascending unit indices), elementwise."""
    first = np.searchsorted(users, l, side="left")  # first user >= l
    return (first < len(users)) & (users[np.minimum(first, len(users) - 1)] <= r)


def unit_costs(profile: Profile, m: int) -> UnitCosts:
    """Arrays of f, g, a, w, x for ``m`` micro-batches (b = B / m must be a profiled size)."""
    if m <= 0 or profile.batch_size % m:
        raise InvalidRequestError(
            f"micro-batch count {m} does not divide batch size {profile.batch_size}; "
            f"choose one of {sorted(microbatch_choices(profile, PlanOptions()))}"
        )
    b = profile.batch_size // m
    if b not in profile.microbatch_sizes:
        raise InvalidRequestError(
            f"micro-batch count {m} needs micro-batch size {b}, which was not profiled "
            f"(profiled: {list(profile.microbatch_sizes)}); re-profile with --microbatch-sizes"
        )
    f = np.array([u.timings[b].forward_s for u in profile.units], dtype=np.float64)
    g = np.array([u.timings[b].backward_s for u in profile.units], dtype=np.float64)
    timings = [u.timings[b] for u in profile.units]
    call_f, call_b = profile.checkpoint_call_s
    rb = [t.forward_s + t.backward_s if t.recompute_backward_s is None else t.recompute_backward_s
          for t in timings]  # fmt: skip
    rf = [t.forward_s if t.recompute_forward_s is None else t.recompute_forward_s for t in timings]
    r = np.maximum(np.array(rb, dtype=np.float64) - call_b, 0.0)
    fc = np.maximum(np.array(rf, dtype=np.float64) - call_f, 0.0)
    a = np.array([u.timings[b].saved_bytes for u in profile.units], dtype=np.float64)
    w = np.array([u.param_bytes for u in profile.units], dtype=np.float64)
    x = np.zeros(len(f) + 1)
    msgs = np.zeros(len(f) + 1)
    x[0] = profile.input_bytes_per_sample * b
    msgs[0] = 1
    for cut in profile.cuts:
        x[cut.after + 1] = cut.bytes_per_sample * b
        msgs[cut.after + 1] = len(cut.tensors)

    def prefix(v: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(v)])

    shared = tuple((sp.bytes, np.array(sp.units, dtype=np.int64)) for sp in profile.shared_params)
    loss = profile.loss.get(b)
    return UnitCosts(
        m,
        b,
        f,
        g,
        a,
        w,
        x,
        msgs,
        prefix(f),
        prefix(g),
        prefix(a),
        prefix(w),
        prefix(r),
        prefix(fc),
        call_f,
        call_b,
        shared,
        loss_f=loss.forward_s if loss else 0.0,
        loss_g=loss.backward_s if loss else 0.0,
        loss_a=float(loss.saved_bytes) if loss else 0.0,
    )


def microbatch_choices(profile: Profile, options: PlanOptions) -> list[int]:
    """Micro-batch counts m to consider: the user's, or every m whose size B/m was profiled."""
    if options.microbatches is not None:
        return [options.microbatches]
    return sorted({profile.batch_size // b for b in profile.microbatch_sizes})


def recomputes(policy: str, j: int, p: int) -> bool:
    """Whether stage j of p recomputes its forward in the backward pass."""
    return policy == "always" or (policy == "except_last" and j < p - 1)


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
    costs: UnitCosts, cluster: Cluster, options: PlanOptions, l: int, r: int, j: int
) -> tuple[float, float, float]:
    """(F_j, B_j, C_j) of stage j covering units l..r."""
    p = cluster.n_stages
    speed = cluster.devices[j].speed
    if recomputes(options.checkpoint, j, p):
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


def stage_memory(
    costs: UnitCosts, cluster: Cluster, options: PlanOptions, l: int, r: int, j: int
) -> MemoryBreakdown:
    """M_j of stage j covering units l..r, broken down."""
    p = cluster.n_stages
    q = in_flight(options.schedule, j, p, costs.m)
    w = int(costs.Pw[r + 1] - costs.Pw[l]) + int(costs.shared_bytes(l, r))
    acts = int(costs.Pa[r + 1] - costs.Pa[l])
    k = OPTIMIZER_STATES[options.optimizer]
    if recomputes(options.checkpoint, j, p):
        stash, act = q * int(costs.x[l]), acts
    else:
        stash, act = 0, q * acts
    if j == p - 1:
        act += q * int(costs.loss_a)
    total = w * (2 + k) + stash + act
    return MemoryBreakdown(
        params=w, grads=w, optimizer=k * w, stashed_inputs=stash, activations=act, total=total
    )


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


def check_request(profile: Profile, cluster: Cluster, options: PlanOptions) -> None:
    """Reject requests no solver can satisfy, with the numbers and the fix."""
    n, p = profile.n_units, cluster.n_stages
    if p > n:
        raise InvalidRequestError(
            f"{p} stages but the profile has only {n} units; use --stages {n} or fewer, "
            f"or profile with a finer --granularity"
        )
    if options.microbatches is not None:
        unit_costs(profile, options.microbatches)  # raises with the fix
    for unit, stage in options.pinned.items():
        if not 0 <= unit < n or not 0 <= stage < p:
            raise InvalidRequestError(
                f"pin {unit}->{stage} is out of range (units 0..{n - 1}, stages 0..{p - 1})"
            )
    if options.max_units is not None and options.max_units * p < n:
        raise InvalidRequestError(
            f"max_units {options.max_units} x {p} stages < {n} units; raise --max-units"
        )
    if options.min_units * p > n:
        raise InvalidRequestError(
            f"min_units {options.min_units} x {p} stages > {n} units; lower --min-units"
        )


def build_stages(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    boundaries: Sequence[int],
    m: int,
) -> list[Stage]:
    """Evaluate every stage of the partition whose stages start at 0 and at ``boundaries``."""
    n, p = profile.n_units, cluster.n_stages
    starts = [0, *boundaries]
    if len(starts) != p or any(b <= a for a, b in pairwise(starts)) or starts[-1] >= n:
        raise InvalidRequestError(
            f"boundaries {list(boundaries)} do not split {n} units into {p} non-empty stages"
        )
    costs = unit_costs(profile, m)
    update = update_cost(profile, options.optimizer)
    stages = []
    for j, l in enumerate(starts):
        r = (starts[j + 1] if j + 1 < p else n) - 1
        F, B, C = stage_time(costs, cluster, options, l, r, j)
        mem = stage_memory(costs, cluster, options, l, r, j)
        dev = cluster.devices[j]
        stages.append(
            Stage(
                index=j,
                device=dev.name,
                first_unit=l,
                last_unit=r,
                unit_names=tuple(u.name for u in profile.units[l : r + 1]),
                recompute=recomputes(options.checkpoint, j, p),
                forward_s=F,
                backward_s=B,
                comm_s=C,
                time_s=F + B + C,
                update_s=update.seconds(mem.params) / dev.speed,
                memory=mem,
                memory_limit=dev.memory_bytes,
                feasible=mem.total <= dev.memory_bytes,
            )
        )
    return stages


def lower_bound(profile: Profile, cluster: Cluster, options: PlanOptions) -> float:
    """A bound no partition beats: min over m of S_lb + (m - 1) max(S_lb / p, max_u t_u).

    t_u = (f_u + g_u) / s_max, replaced by the checkpointed (fc_u - c_F + r_u - c_B) / s_max
    under the policy ``always`` and by the smaller of the two under ``except_last``;
    S_lb = sum_u t_u.  Communication, the engine's and the checkpoint calls' own costs are
    taken as free, but for the engine's fixed cost per step c, which every plan pays.
    """
    p = cluster.n_stages
    s_max = max(d.speed for d in cluster.devices)
    best = np.inf
    for m in microbatch_choices(profile, options):
        c = unit_costs(profile, m)
        plain, rc = c.f + c.g, np.diff(c.Pfc) + np.diff(c.Pr)
        per_unit = {"always": rc, "except_last": np.minimum(plain, rc), "never": plain}[
            options.checkpoint
        ] / s_max
        total = float(per_unit.sum())
        best = min(best, total + (m - 1) * max(total / p, float(per_unit.max())))
    return float(best) + cluster.step_overhead_s


def _simulated(
    stages: Sequence[Stage],
    m: int,
    schedule: str,
    kappa: float,
    syncs: Sequence[TiedSync],
    step_overhead_s: float,
    update_contention: float = 0.0,
) -> float:
    return simulate(
        [s.forward_s for s in stages],
        [s.backward_s for s in stages],
        [s.comm_s for s in stages],
        m,
        schedule=schedule,
        contention=kappa,
        update_s=[s.update_s for s in stages],
        syncs=[(s.stages, s.seconds) for s in syncs],
        step_overhead_s=step_overhead_s,
        update_contention=update_contention,
    ).makespan_s


def evaluate(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    boundaries: Sequence[int],
    m: int,
    *,
    solver: str,
    status: str | None = None,
    gap: float | None = None,
    solve_time_s: float | None = None,
) -> Plan:
    """The Plan of a given partition and micro-batch count under this cost model."""
    stages = build_stages(profile, cluster, options, boundaries, m)
    times = [s.time_s for s in stages]
    busy = [s.forward_s + s.backward_s for s in stages]
    kappa = contention(cluster, m)
    shared = [(sp.bytes, sp.units) for sp in profile.shared_params]
    syncs = tied_syncs(shared, cluster, [s.first_unit for s in stages])
    T = (
        step_time(times, m, busy, kappa)
        + update_tail(
            [s.update_s for s in stages],
            [s.backward_s for s in stages],
            [s.comm_s for s in stages],
            syncs,
            cluster.update_contention,
        )
        + cluster.step_overhead_s
    )
    feasible = all(s.feasible for s in stages)
    if status is None:
        status = "heuristic"
    if not feasible:
        status = "infeasible"
    return Plan(
        model=profile.model,
        model_kwargs=profile.model_kwargs,
        profile_fingerprint=profile.fingerprint,
        graph_fingerprint=profile.graph_fingerprint,
        tracer=profile.tracer,
        granularity=profile.granularity,
        dtype=profile.dtype,
        profiled_threads=profile.device.threads if profile.device.kind == "cpu" else None,
        batch_size=profile.batch_size,
        microbatches=m,
        microbatch_size=profile.batch_size // m,
        schedule=options.schedule,
        checkpoint=options.checkpoint,
        optimizer=options.optimizer,
        cluster=cluster,
        stages=tuple(stages),
        tied_syncs=tuple(syncs),
        step_time_s=T,
        simulated_step_time_s=_simulated(
            stages,
            m,
            options.schedule,
            kappa,
            syncs,
            cluster.step_overhead_s,
            cluster.update_contention,
        ),
        bubble_fraction=bubble_fraction(times, m, busy, kappa),
        throughput=profile.batch_size / T if T > 0 else 0.0,
        feasible=feasible,
        solver=solver,
        status=status,  # type: ignore[arg-type]
        gap=gap,
        lower_bound_s=lower_bound(profile, cluster, options),
        solve_time_s=solve_time_s,
    )
