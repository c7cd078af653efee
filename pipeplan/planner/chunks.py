"""A partition into p v chunks under a schedule family, evaluated by replaying torch's order.

Chunk s covers units l..r and runs on rank q = ``rank_of_stage(family, p, v)[s]`` (speed
v_q, engine overhead o per action).  With the tables of :mod:`pipeplan.planner.unitcosts`:

    F_s = sum f_u / v_q + o             (fc_u - c_F, plus c_F once, when it recomputes)
    B_s = sum g_u / v_q + o             (r_u - c_B, plus c_B once, when it recomputes)
    I_s = sum i_u / v_q + o,  W_s = sum w_u / v_q + o     (profiles that measured I and W; a
                                        recomputing chunk runs its whole backward as I:
                                        I_s = B_s, W_s = 0, see pipeplan.runtime.engine)
    C_s = 2 transfer(x_{r+1})           (paid in the replay only across ranks)

(the loss's forward and backward on the last chunk, its backward in I).  Memory, per chunk:

    w_s       = parameter bytes of units l..r, a parameter shared by several chunks of one rank
                counted once, on the highest of them (whose backward runs first)
    static_s  = w_s (1 + k) + m x_l + m x_{r+1}      params, k optimizer states, the inputs
                                                     and the output-gradient buffers
    grad_s    = w_s                                  the gradients, made by the chunk's first
                                                     B (or W); set to None at each step start
    temp_s    = [m > 1] max(0, big_s - [recompute] sum a_u)   a later B or W makes the largest
                parameter's gradient (big_s bytes) in a temporary before adding it to the held
                one (beside a recomputing chunk's remade activations, as in the closed form);
                a chunk whose shared parameter a higher chunk of its rank already made the
                gradient of pays it from its first backward on (temp_first_s)
    held_s    = x_{r+1} + [no recompute] sum a_u + [last] (y + a_loss)   per micro-batch
    weight_held_s = held_s + sum d_u - [last] (y + a_loss)    alive from I until W: torch's
                    I (``stage_backward_input``) keeps the graph (``retain_graph=True``) and
                    the intermediate gradients d_u that W reads (the profile's
                    ``weight_held_bytes``); it detaches the outputs, which frees the loss's
                    part on the last chunk (0 for a recomputing chunk: its I is the whole
                    backward)
    transient_s = [recompute] sum a_u + [s > 0] x_l + [last] 2 y

and :func:`pipeplan.planner.replay.replay` gives the step time and each rank's peak.  The
bound :func:`work_bound` holds for every family, v and partition.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeplan.planner.collectives import state_factors
from pipeplan.planner.costmodel import stage_params, tied_syncs
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.families import FAMILIES, rank_of_stage
from pipeplan.planner.replay import ChunkCosts, Replay, replay
from pipeplan.planner.types import Cluster, PlanOptions, Profile
from pipeplan.planner.unitcosts import microbatch_choices, tables, unit_costs
from pipeplan.planner.updates import update_cost

__all__ = [
    "ChunkPlan",
    "family_bound",
    "has_split_backward",
    "refuse_split",
    "score",
    "work_bound",
]


def has_split_backward(profile: Profile) -> bool:
    """Whether every unit's every timing measured I and W (``pipeplan profile`` does)."""
    return tables(profile).memo("split_backward", lambda: _measured_split(profile))


def _measured_split(profile: Profile) -> bool:
    return all(
        t.backward_input_s is not None and t.backward_weight_s is not None
        for u in profile.units
        for t in u.timings.values()
    )


def refuse_split(profile: Profile, family: str) -> None:
    """The one line for a zero-bubble family on a profile without I and W."""
    if FAMILIES[family].split_backward and not has_split_backward(profile):
        raise InvalidRequestError(
            f"schedule {family} splits the backward into I and W, which this profile did not "
            "measure; re-profile with this version's pipeplan profile (either --method)"
        )


class ChunkPlan:
    """The chunk costs of one (family, v, m) for any cuts and recomputation: the tables once."""

    def __init__(
        self, profile: Profile, cluster: Cluster, options: PlanOptions, family: str, v: int, m: int
    ) -> None:
        self.profile, self.cluster, self.options = profile, cluster, options
        self.family, self.v, self.m, self.p = family, v, m, cluster.n_stages
        self.costs = unit_costs(profile, m)
        self.owner = rank_of_stage(family, self.p, v)
        self.update = update_cost(profile, options.optimizer, cluster)
        self.state = state_factors(options.optimizer, cluster)  # training state per byte
        self.split = FAMILIES[family].split_backward
        self._memo: dict[tuple[int, int, int, bool, int, float], tuple[float | int, ...]] = {}
        b = profile.batch_size // m
        if self.split:
            refuse_split(profile, family)
            ts = [u.timings[b] for u in profile.units]
            self.Pi = np.concatenate([[0.0], np.cumsum([t.backward_input_s for t in ts])])
            self.Pw = np.concatenate([[0.0], np.cumsum([t.backward_weight_s for t in ts])])
            held = [
                t.saved_bytes if t.weight_held_bytes is None else t.weight_held_bytes for t in ts
            ]
            self.Ph = np.concatenate([[0.0], np.cumsum(held)])

    def costs_of(self, starts: Sequence[int], recompute: Sequence[bool]) -> ChunkCosts:
        n, k = self.costs.n, len(starts)
        copies = self._rank_copies(starts)
        rows = [
            self._chunk(
                s, l, (starts[s + 1] if s + 1 < k else n) - 1, bool(recompute[s]), k, copies[s]
            )
            for s, l in enumerate(starts)
        ]
        F, B, C, I, W, U, static, held, wheld, trans, grads, temp, temp_first = (
            list(col) for col in zip(*rows, strict=True)
        )
        return ChunkCosts(
            F, B, C, I if self.split else None, W if self.split else None, U,
            static, held, wheld, trans, grads, temp, temp_first,
        )  # fmt: skip

    def _rank_copies(self, starts: Sequence[int]) -> list[float]:
        """Per chunk: the bytes of shared parameters it holds that a higher chunk of its rank
        also holds (the same tensor there: counted on the highest)."""
        out = [0.0] * len(starts)
        for nbytes, users in self.costs.shared:
            holders = sorted({int(np.searchsorted(starts, u, side="right")) - 1 for u in users})
            for s in holders:
                if any(self.owner[t] == self.owner[s] for t in holders if t > s):
                    out[s] += nbytes
        return out

    def _chunk(
        self, s: int, l: int, r: int, rc: bool, k: int, copies: float
    ) -> tuple[float | int, ...]:
        """Chunk s over units l..r (of k), ``copies`` bytes of its shared parameters counted on
        a higher chunk of its rank: F, B, C, I, W, U, static, held, weight-held and transient
        bytes, gradient bytes and the gradient temporaries, once per key (a search asks for
        the same chunks often)."""
        key = (s, l, r, rc, k, copies)
        got = self._memo.get(key)
        if got is not None:
            return got
        c = self.costs
        o = self.cluster.engine_overhead_s
        state = self.state
        speed = self.cluster.devices[self.owner[s]].speed
        last = s == k - 1
        if rc:
            f = float(c.Pfc[r + 1] - c.Pfc[l]) + c.call_f
            g = float(c.Pr[r + 1] - c.Pr[l]) + c.call_b
        else:
            f, g = float(c.Pf[r + 1] - c.Pf[l]), float(c.Pg[r + 1] - c.Pg[l])
        f += c.loss_f if last else 0.0
        g += c.loss_g if last else 0.0
        i_s = w_s = 0.0
        if self.split:
            w = float(self.Pw[r + 1] - self.Pw[l])
            i = float(self.Pi[r + 1] - self.Pi[l]) + (c.loss_g if last else 0.0)
            if rc:  # the runtime runs the whole backward as I (pipeplan.runtime.engine)
                i, w = g, 0.0
            i_s, w_s = max(i, 0.0) / speed + o, w / speed + (0.0 if rc else o)
        x_in, x_out = float(c.x[l]), float(c.x[r + 1])
        comm = (
            2.0 * self.cluster.link.transfer_s(x_out, int(c.msgs[r + 1]))
            if not last and x_out > 0
            else 0.0
        )
        params = stage_params(c, l, r) - copies
        acts = float(c.Pa[r + 1] - c.Pa[l])
        remade = acts if rc else 0.0
        big = float(c.largest_param(l, r)) if self.m > 1 else 0.0
        h = x_out + (0.0 if rc else acts) + ((c.out + c.loss_a) if last else 0.0)
        d = float(self.Ph[r + 1] - self.Ph[l]) if self.split else 0.0
        row = (
            f / speed + o,
            g / speed + o,
            comm,
            i_s,
            w_s,
            self.update.seconds(params) / speed,
            int(params * (state.params + state.optimizer) + self.m * (x_in + x_out)),
            int(h),
            0 if rc or not self.split else int(h + d - ((c.out + c.loss_a) if last else 0.0)),
            int((acts if rc else 0.0) + (x_in if s > 0 else 0.0) + (2 * c.out if last else 0.0)),
            int(params * state.grads),
            int(max(0.0, big - remade)),
            int(max(0.0, min(copies, big) - remade)),
        )
        self._memo[key] = row
        return row

    def replay(
        self,
        starts: Sequence[int],
        recompute: Sequence[bool],
        timeline: bool = False,
        costs: ChunkCosts | None = None,
        peaks: tuple[int, ...] | None = None,
    ) -> Replay:
        """The replay of one partition (its compute events only with ``timeline``); ``costs``
        and ``peaks`` when the caller has them for the same cuts and flags."""
        shared = [(sp.bytes, sp.units) for sp in self.profile.shared_params]
        syncs = tied_syncs(shared, self.cluster, list(starts)) if shared else []
        return replay(
            self.family,
            self.p,
            self.v,
            self.m,
            costs if costs is not None else self.costs_of(starts, recompute),
            syncs=[(t.stages, t.seconds) for t in syncs],
            step_overhead_s=self.cluster.step_overhead_s,
            update_contention=self.cluster.update_contention,
            contention=self.cluster.contention,
            timeline=timeline,
            peaks=peaks,
        )

    def fits(self, rep: Replay) -> bool:
        return all(
            peak <= self.cluster.devices[q].memory_bytes for q, peak in enumerate(rep.peak_bytes)
        )


def score(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    family: str,
    v: int,
    m: int,
    starts: Sequence[int],
    recompute: Sequence[bool],
) -> Replay:
    """The replay of one partition: step time and per-rank peaks."""
    return ChunkPlan(profile, cluster, options, family, v, m).replay(starts, recompute, True)


def _least(profile: Profile, m: int) -> tuple[np.ndarray, float]:
    """s_u at m (the least of f + g, the recomputing pair and f + i + w) and the loss's f + g."""
    c = unit_costs(profile, m)
    least = np.minimum(c.f + c.g, np.diff(c.Pfc) + np.diff(c.Pr))
    if has_split_backward(profile):
        ts = [u.timings[profile.batch_size // m] for u in profile.units]
        iw = np.array([t.backward_input_s + t.backward_weight_s for t in ts])  # type: ignore[operator]
        least = np.minimum(least, c.f + iw)
    return least, c.loss_f + c.loss_g


def family_bound(
    profile: Profile, cluster: Cluster, options: PlanOptions, family: str, v: int, m: int
) -> float:
    """A lower bound on the step of every partition and recomputation of ``family`` with v
    chunks per rank and m micro-batches: the larger of :func:`work_bound` at m and, for each
    rank q that must hold an end of the model (the first unit: rank 0; the last: rank p - 1
    in a loop, rank 0 in a V),

        c + D_q + m (sum of its forced units' s_u [+ the loss] + (v - e_q) s_min + 2 v o)
          + sum of U(w_u) / v_q over its forced units

    (:func:`work_bound`'s c, s_u and D_q; e_q the number of forced units, each in its own
    chunk; s_min the least s_u of the other units; o the engine overhead; U the optimizer
    step of w_u parameter bytes, counted only where U never falls as w grows).

    Proof.  Rank q runs m micro-batches through each of its v chunks, each chunk at least one
    unit and two actions (F, then B or I and W) of at least o more each; a forced unit's
    chunk costs at least that unit.  It starts no earlier than c + D_q (:func:`work_bound`)
    and updates each chunk's parameters after its last action, a chunk holding at least its
    forced unit's bytes (U is a sum over chunks; contention only slows it).  Where the model's
    ends are heavy (an embedding and a head, or one big update) this bound is the one that
    shows what a V (both ends on rank 0) or a loop (the head beside another chunk) cannot
    reach, which the work bound never does."""
    p, n = cluster.n_stages, profile.n_units
    least, loss = _least(profile, m)
    fastest = max(d.speed for d in cluster.devices)
    c = unit_costs(profile, m)
    fwd = np.concatenate([[0.0], np.cumsum(np.minimum(c.f, np.diff(c.Pfc)))]) / fastest
    o = cluster.engine_overhead_s
    upd = update_cost(profile, options.optimizer, cluster)
    monotone = all(sl >= 0 for sl, _ in upd.pieces)
    owner = rank_of_stage(family, p, v)
    forced: dict[int, list[int]] = {}
    forced.setdefault(owner[0], []).append(0)
    if n > 1:
        forced.setdefault(owner[-1], []).append(n - 1)
    inner = least[1:-1] if n > 2 else least[:0]
    s_min = float(inner.min()) if len(inner) else 0.0
    best = work_bound(profile, cluster, options.model_copy(update={"microbatches": m}))
    for q, units in forced.items():
        speed = cluster.devices[q].speed
        work = sum(float(least[u]) for u in units) + (loss if n - 1 in units else 0.0)
        work += max(v - len(units), 0) * s_min
        nbytes = [float(c.w[u]) for u in units]
        if len(owner) == 1:  # one chunk holds both ends
            nbytes = [sum(nbytes)]
        update = sum(upd.seconds(b) for b in nbytes) if monotone else 0.0
        t = float(fwd[min(q, n)]) + (m * work + update) / speed + m * 2 * v * o
        best = max(best, t + cluster.step_overhead_s)
    return best


def work_bound(profile: Profile, cluster: Cluster, options: PlanOptions) -> float:
    """A lower bound on the step of every family, v, partition and recomputation:

        L = c + min over m of max((m S_m + sum_{q >= 1} v_q D_q) / sum_q v_q,  S_m / v_max)

    with c the step overhead, S_m = sum_u s_u + the loss's forward and backward at m, s_u the
    least of the unit's plain forward and backward f_u + g_u, its recomputing pair and (where
    measured) f_u + i_u + w_u, and D_q = sum_{u < q} min(f_u, fc_u) / v_max.

    Proof.  Every action's duration is at least the sum of its units' least times (the engine
    overhead and the checkpoint calls' own costs only add), so the ranks' busy times, weighted
    by speed, add up to at least m S_m.  Every rank's actions run one at a time after c, so
    T - c >= busy_q + (rank q's idle before its first action).  Every family places only
    chunks s >= q on rank q (a loop puts q, q + p, ...; a V puts q and 2p - 1 - q), and each
    chunk holds at least one unit, so rank q's first forward, of some micro-batch i, waits for
    the forwards of chunks 0..q-1 of i, one after another: those hold units 0..q-1 at least,
    hence the idle is at least D_q.  Weighting T - c >= busy_q + D_q by v_q and summing gives
    the first term.  The second: one micro-batch's forward and backward pass through every
    unit in order.  Tighter than the work bound alone (D_q = 0) by sum v_q D_q / sum v_q.
    """
    speed = sum(d.speed for d in cluster.devices)
    fastest = max(d.speed for d in cluster.devices)
    best = np.inf
    for m in microbatch_choices(profile, options):
        c = unit_costs(profile, m)
        least, loss = _least(profile, m)
        work = float(least.sum()) + loss
        fwd = np.concatenate([[0.0], np.cumsum(np.minimum(c.f, np.diff(c.Pfc)))]) / fastest
        ramp = sum(d.speed * float(fwd[min(q, c.n)]) for q, d in enumerate(cluster.devices))
        best = min(best, max((m * work + ramp) / speed, work / fastest))
    return float(best) + cluster.step_overhead_s
