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

and :func:`pipeplan.planner.replay.replay` gives the step time and each rank's peak (the
schedule solver's lower bounds on it are in :mod:`pipeplan.solvers.schedule_bounds`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeplan.planner.costmodel import stage_params, tied_syncs
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.families import FAMILIES, rank_of_stage
from pipeplan.planner.replay import ChunkCosts, Replay, replay
from pipeplan.planner.types import Cluster, PlanOptions, Profile
from pipeplan.planner.unitcosts import tables, unit_costs
from pipeplan.solvers.request import ResolvedRequest

__all__ = [
    "ChunkPlan",
    "fixed_flags",
    "has_split_backward",
    "refuse_split",
    "score",
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


def fixed_flags(options: PlanOptions, k: int) -> list[bool] | None:
    """The recompute flags of k chunks a fixed ``--checkpoint`` policy sets (``None`` under
    ``auto``, where each chunk's flag is the solver's choice)."""
    policy = options.checkpoint
    if policy == "auto":
        return None
    return [policy == "always" or (policy == "except_last" and s < k - 1) for s in range(k)]


class ChunkPlan:
    """The chunk costs of one (family, v, m) for any cuts and recomputation: the tables once."""

    def __init__(self, request: ResolvedRequest, family: str, v: int, m: int) -> None:
        profile, cluster = request.profile, request.cluster
        self.profile, self.cluster, self.options = profile, cluster, request.options
        self.family, self.v, self.m, self.p = family, v, m, cluster.n_stages
        self.costs = unit_costs(profile, m)
        self.owner = rank_of_stage(family, self.p, v)
        self.update = request.update
        self.state = request.state  # training state per byte
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
    request = ResolvedRequest(profile, cluster, options)
    return ChunkPlan(request, family, v, m).replay(starts, recompute, True)
