"""The step simulator: a replay of torch's per-rank action lists, its time, timeline and memory.

Chunk s (of n = p v) has per micro-batch: forward F_s, full backward B_s (recompute
included), and for the split families I_s + W_s (input and weight gradients); C_s is the round
trip across the cut after chunk s, paid only where chunks s and s + 1 sit on different ranks.
Each rank runs :func:`pipeplan.planner.families.action_order`'s list in order, each action as
soon as its rank is free and its input has arrived:

    F(s, i)     needs F(s - 1, i);  runs F_s, then the blocking send C_s / 2
    B/I(s, i)   needs F(s, i) and the B or I of (s + 1, i);  runs the receive C_s / 2, then B_s or I_s
    W(s, i)     needs I(s, i);  runs W_s

torch's special case: chunk 0 has no input gradient to make, so its I does nothing and its W is
the full backward (I_0 = 0, W_0 = B_0).  With k (``Cluster.contention``) a rank's compute (F,
B, I, W; not its transfers) runs at rate 1 / (1 + k a) while a other ranks compute too,
integrated between events (p >= 2 and m >= 2 only).  Contention only slows, so a bound without
it bounds the contended step as well.

Then every rank updates its chunks' parameters (U_r = sum of its chunks' U_s) after its last
action.  Before that, the ranks that hold copies of a tied parameter sum its gradient
(``syncs``: (chunks, seconds) all-reduces, run in order): each starts when the last of its
ranks arrives, and those ranks update only after it ends.  Updates are not slowed by k and do
not slow forwards or backwards, but slow each other: while a run at once each progresses at
rate 1 / (1 + kappa_u (a - 1)) (``update_contention``; the closed form's
:func:`pipeplan.planner.updates.shared_ends`).  The step ends with the last update.

GPipe and 1F1B are the families of one chunk per rank (v = 1).  For GPipe the makespan is
sum_s (f_s + b_s) + (m - 1) (max_s f_s + max_s b_s), f_s = F_s + C_s / 2 and b_s = B_s + C_s / 2,
so the closed form of :mod:`pipeplan.planner.costmodel`, sum_s t_s + (m - 1) max_s t_s, is
exact when b_s / f_s is the same for every stage and a lower bound otherwise; with k and p
identical stages without transfers it is (F + B) (p + m - 1 + k (p - 1)(m - 1)).
:func:`replay_plan` replays a plan, one timeline row per rank, in the event kinds the runtime
records (``forward``, ``backward``, ``backward_input``, ``backward_weight``, ``send``, ``recv``,
``tied``, ``optimizer``, and ``recompute``: the start of a recomputing stage's B).

Memory follows the same list, so a rank's peak is independent of timing: a chunk's micro-batch
holds ``held_s`` bytes (its outputs, its saved activations, or only its input when it
recomputes) from its F until its B, or until its I and then ``weight_held_s`` (what W still
reads, the intermediate gradients I made among it) until its W; during a backward ``transient_s`` more (the activations a
recomputing chunk remakes, the working gradients).  Gradients are set to None at each step's
start: a chunk's ``grad_s`` bytes appear with its first B, after the peak of that B (they take
the place of the activations it frees, as in the closed form of
:func:`pipeplan.planner.costmodel.memory_parts`), or with its first W, beside what W still
holds; a later B or W adds ``grad_temp_s`` (its largest parameter's gradient, made in a
temporary before it is added).  Peak_r = static_r + max over the list of the live bytes,
static_r the parameters, optimizer states and buffers of its chunks.
"""

# ruff: noqa: PLR1730  (the hot loops compare instead of calling max(): 16 % off a search)
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from pipeplan.planner.families import FAMILIES, Action, action_order, rank_of_stage
from pipeplan.planner.types import Plan
from pipeplan.planner.updates import shared_ends

__all__ = ["ChunkCosts", "Replay", "ReplayEvent", "peak_memory", "replay", "replay_plan"]


@dataclass(frozen=True, slots=True)
class ChunkCosts:
    """Per-chunk, per-micro-batch costs (seconds and bytes), indexed by chunk."""

    forward_s: Sequence[float]
    backward_s: Sequence[float]
    comm_s: Sequence[float]
    backward_input_s: Sequence[float] | None = None
    """I_s; with ``backward_weight_s`` needed by the split families."""
    backward_weight_s: Sequence[float] | None = None
    update_s: Sequence[float] = ()
    static_bytes: Sequence[int] = ()
    held_bytes: Sequence[int] = ()
    weight_held_bytes: Sequence[int] = ()
    """What stays from I until W, freed by W (part of ``held_bytes``, plus what I adds)."""
    transient_bytes: Sequence[int] = ()
    grad_bytes: Sequence[int] = ()
    """The chunk's parameters' gradients, made by its first B (or W)."""
    grad_temp_bytes: Sequence[int] = ()
    """The temporary a later B or W makes its largest parameter's gradient in."""
    grad_temp_first_bytes: Sequence[int] = ()
    """That temporary already in its first B or W (a shared gradient its rank made before)."""
    recompute_s: Sequence[float] = ()
    """The part of B_s that remakes the forward: its own ``recompute`` event on the timeline."""

    @property
    def n(self) -> int:
        return len(self.forward_s)


@dataclass(frozen=True, slots=True)
class ReplayEvent:
    rank: int
    stage: int
    microbatch: int
    kind: str
    """forward, recompute, backward, backward_input, backward_weight, send, recv, tied or
    optimizer."""
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class Replay:
    events: tuple[ReplayEvent, ...]
    makespan_s: float
    p: int
    m: int
    peak_bytes: tuple[int, ...]
    """Per rank: static bytes plus the largest live bytes of its list."""
    busy: tuple[float, ...]
    """Per rank: seconds of compute (F, B, I, W)."""

    def busy_s(self, rank: int) -> float:
        return self.busy[rank]

    @property
    def bubble_fraction(self) -> float:
        """1 - average compute time per rank / makespan."""
        if self.makespan_s <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s(r) for r in range(self.p)) / self.p / self.makespan_s


_Phase = tuple[str, float, bool]


def _phases(kind: str, s: int, costs: ChunkCosts, cross: Sequence[bool]) -> list[_Phase]:
    """(event kind, seconds, compute?) of each phase of chunk s's action ``kind``."""
    half = costs.comm_s[s] / 2 if cross[s] else 0.0
    if kind == "F":
        return [("forward", costs.forward_s[s], True), ("send", half, False)]
    if kind == "W":
        assert costs.backward_weight_s is not None
        w = costs.backward_s[s] if s == 0 else costs.backward_weight_s[s]
        return [("backward_weight", w, True)]
    if kind == "I":
        assert costs.backward_input_s is not None
        i = 0.0 if s == 0 else costs.backward_input_s[s]
        return [("recv", half, False), ("backward_input", i, True)]
    rc = costs.recompute_s[s] if costs.recompute_s else 0.0
    remade = [("recompute", rc, True)] if rc else []
    return [("recv", half, False), *remade, ("backward", costs.backward_s[s] - rc, True)]


def replay(
    family: str,
    p: int,
    v: int,
    m: int,
    costs: ChunkCosts,
    *,
    syncs: Sequence[tuple[Sequence[int], float]] = (),
    step_overhead_s: float = 0.0,
    update_contention: float = 0.0,
    contention: float = 0.0,
    timeline: bool = True,
    peaks: tuple[int, ...] | None = None,
) -> Replay:
    """Replay one step of ``family`` on p ranks with v chunks each and m micro-batches.

    ``syncs`` are (chunks, seconds) all-reduces of tied gradients, run in order on the ranks
    that hold those chunks; ``step_overhead_s`` delays the first action; ``contention`` k
    slows the compute of ranks that compute at once (p >= 2 and m >= 2 only).  Without
    ``timeline`` only the compute actions' events are left out (a solver's inner loop).
    ``peaks``: :func:`peak_memory` of the same costs, when the caller has walked it already.
    """
    n = p * v
    if costs.n != n:
        raise ValueError(f"costs name {costs.n} chunks; {family} with p = {p}, v = {v} runs {n}")
    if FAMILIES[family].split_backward and (
        costs.backward_input_s is None or costs.backward_weight_s is None
    ):
        raise ValueError(f"{family} splits the backward into I and W: give their times")
    owner = rank_of_stage(family, p, v)
    cross = [owner[s] != owner[s + 1] for s in range(n - 1)] + [False]
    table = {(k, s): _phases(k, s, costs, cross) for s in range(n) for k in "FBIW"
             if k in "FB" or costs.backward_input_s is not None}  # fmt: skip
    deps, flat, keys, n_slots = _compiled(family, p, v, m)
    kappa = contention if p > 1 and m > 1 else 0.0
    if kappa > 0:
        free, busy, pos, events = _contended(deps, table, n_slots, kappa, step_overhead_s, timeline)
    else:
        free, busy, pos, events = _sweep(
            deps, flat, keys, table, n_slots, step_overhead_s, timeline
        )
    if any(pos[r] < len(deps[r]) for r in range(p)):  # pragma: no cover - torch's lists are valid
        raise RuntimeError(f"{family} deadlocked in the replay")
    arrive = list(free)
    for members, seconds in syncs:
        ranks = sorted({owner[s] for s in members})
        if len(ranks) < 2:
            continue
        end = max(arrive[r] for r in ranks) + seconds
        for r in ranks:
            events.append(ReplayEvent(r, -1, -1, "tied", arrive[r], end))
            arrive[r] = end
    upd = [0.0] * p
    for s, u in enumerate(costs.update_s):
        upd[owner[s]] += u
    done = (shared_ends(arrive, upd, update_contention) if update_contention
            else [t + u for t, u in zip(arrive, upd, strict=True)])  # fmt: skip
    events += [ReplayEvent(r, -1, -1, "optimizer", arrive[r], done[r])
               for r in range(p) if upd[r] > 0]  # fmt: skip
    ends = [*free, *arrive, *(e.end_s for e in events)]
    makespan = max(ends, default=0.0)
    if peaks is None:
        peaks = peak_memory(family, p, v, m, costs)
    return Replay(tuple(events), makespan, p, m, peaks, tuple(busy))


def replay_plan(plan: Plan, timeline: bool = True) -> Replay:
    """The replay of a plan's step: its family, chunks per rank, m and stages' times; with
    ``timeline``, a recomputing stage's B starts with its recompute (F_s, a label)."""
    st = plan.stages
    split = all(s.backward_input_s is not None for s in st)
    costs = ChunkCosts(
        [s.forward_s for s in st],
        [s.backward_s for s in st],
        [s.comm_s for s in st],
        [s.backward_input_s or 0.0 for s in st] if split else None,
        [s.backward_weight_s or 0.0 for s in st] if split else None,
        [s.update_s for s in st],
        recompute_s=[s.forward_s if s.recompute and timeline else 0.0 for s in st],
    )
    cl = plan.cluster
    return replay(
        plan.schedule, plan.pipeline_ranks, plan.stages_per_rank, plan.microbatches, costs,
        syncs=[(t.stages, t.seconds) for t in plan.tied_syncs], step_overhead_s=cl.step_overhead_s,
        update_contention=cl.update_contention, contention=cl.contention, timeline=timeline,
    )  # fmt: skip


_Deps = tuple[tuple[tuple[int, int, int, Action], ...], ...]
_Table = dict[tuple[str, int], list[_Phase]]
_Walk = tuple[list[float], list[float], list[int], list[ReplayEvent]]
_Flat = tuple[tuple[int, int, int, int, int, Action], ...]
_Keys = tuple[tuple[str, int], ...]


def _sweep(
    deps: _Deps, flat: _Flat, keys: _Keys, table: _Table, n_slots: int, t0: float, timeline: bool
) -> _Walk:
    """Without contention: each action of each rank starts when its rank is free and its
    inputs are done, and takes its phases' sum.  Per rank: when it is free, its compute
    seconds and how far it got; and the events.  One pass over ``flat``, :func:`_topological`'s
    order, which depends on the lists alone."""
    p = len(deps)
    took = [sum(amount for _, amount, _ in table[key]) for key in keys]
    compute = [sum(amount for _, amount, c in table[key] if c) for key in keys]
    done = [-1.0] * n_slots + [float("-inf")]  # done[-1]: no input to wait for
    free = [float(t0)] * p
    busy = [0.0] * p
    events: list[ReplayEvent] = []
    for r, slot, d1, d2, k, a in flat:
        t = free[r]
        x = done[d1]  # (comparisons, not max(): this loop is the planner's hottest)
        if x > t:
            t = x
        x = done[d2]
        if x > t:
            t = x
        if timeline:
            start = t
            for kind, amount, c in table[keys[k]]:
                if amount > 0 or c:
                    events.append(
                        ReplayEvent(r, a.stage, a.microbatch, kind, start, start + amount)
                    )
                start += amount
        t += took[k]
        busy[r] += compute[k]
        done[slot] = free[r] = t
    return free, busy, [len(mine) for mine in deps], events


def _topological(deps: _Deps, keys: _Keys) -> _Flat:
    """(rank, slot, dependency, dependency, index in ``keys``, action) of every action, in the
    order a sweep over the ranks runs them: round after round, each rank runs its list until
    an action waits for an input not yet done.  Raises when the lists deadlock."""
    done = [False] * sum(len(mine) for mine in deps)
    pos = [0] * len(deps)
    index = {key: k for k, key in enumerate(keys)}
    out: list[tuple[int, int, int, int, int, Action]] = []
    progress = True
    while progress:
        progress = False
        for r, mine in enumerate(deps):
            while pos[r] < len(mine):
                slot, d1, d2, a = mine[pos[r]]
                if (d1 >= 0 and not done[d1]) or (d2 >= 0 and not done[d2]):
                    break
                out.append((r, slot, d1, d2, index[(a.kind, a.stage)], a))
                done[slot], pos[r], progress = True, pos[r] + 1, True
    if not all(done):  # pragma: no cover - torch's lists are valid
        raise RuntimeError("the action lists deadlock")
    return tuple(out)


def _contended(
    deps: _Deps, table: _Table, n_slots: int, kappa: float, t0: float, timeline: bool
) -> _Walk:
    """With contention k: event to event, each rank's running phase progresses at rate
    1 / (1 + k (a - 1)) while it is one of a ranks computing (1 for a transfer); an action
    starts once its rank is free and its inputs are done.  Returns what :func:`_sweep` does,
    busy being the compute phases' wall seconds.  Only the ranks an event concerns are
    looked at: those whose phase ended, and those that waited for the action that ended."""
    p = len(deps)
    done = [-1.0] * n_slots
    pos = [0] * p
    busy = [0.0] * p
    free = [float(t0)] * p
    events: list[ReplayEvent] = []
    # per rank: its action's phases and the running phase's index, the amount of that phase
    # left, whether it computes, and when it began; phases None while the rank waits
    phases: list[list[_Phase] | None] = [None] * p
    k_of = [0] * p
    left = [0.0] * p
    computes = [False] * p
    began = [0.0] * p
    waiting: dict[int, list[int]] = {}  # slot -> the ranks whose next action needs it
    now = float(t0)

    def start(r: int) -> None:
        """Start rank r's next action if its inputs are done; else wait for the missing one."""
        if pos[r] >= len(deps[r]):
            return
        _, d1, d2, a = deps[r][pos[r]]
        for d in (d1, d2):
            if d >= 0 and done[d] < 0:
                waiting.setdefault(d, []).append(r)
                return
        ph = phases[r] = table[(a.kind, a.stage)]
        k_of[r], left[r], computes[r], began[r] = 0, ph[0][1], ph[0][2], now

    def finish(r: int, woken: list[int]) -> None:
        """End rank r's phases that are over at ``now``, starting what follows."""
        while (ph := phases[r]) is not None and left[r] <= 0.0:
            k = k_of[r]
            kind, amount, _ = ph[k]
            slot, _, _, a = deps[r][pos[r]]
            if computes[r]:
                busy[r] += now - began[r]
            if timeline and (amount > 0 or computes[r]):
                events.append(ReplayEvent(r, a.stage, a.microbatch, kind, began[r], now))
            if k + 1 < len(ph):
                k_of[r], left[r], began[r] = k + 1, ph[k + 1][1], now
                computes[r] = ph[k + 1][2]
                continue
            done[slot] = free[r] = now
            phases[r], pos[r] = None, pos[r] + 1
            woken += waiting.pop(slot, ())
            start(r)

    for r in range(p):
        start(r)
    work = list(range(p))
    while True:
        while work:
            r = work.pop()
            if phases[r] is None:
                start(r)
            finish(r, work)
        active = [r for r in range(p) if phases[r] is not None]
        if not active:
            return free, busy, pos, events
        # on to the next phase's end: the a ranks that compute at rate 1 / (1 + k (a - 1))
        a = sum(1 for r in active if computes[r])
        slow = 1.0 / (1.0 + kappa * (a - 1)) if a > 1 else 1.0
        dt, first = min((left[r] / (slow if computes[r] else 1.0), r) for r in active)
        now += dt
        tiny = 1e-12 * max(now, 1e-300)
        for r in active:
            rest = 0.0 if r == first else left[r] - dt * (slow if computes[r] else 1.0)
            left[r] = rest if rest > tiny else 0.0
        work = [r for r in active if left[r] == 0.0]


@lru_cache(maxsize=256)
def _compiled(family: str, p: int, v: int, m: int) -> tuple[_Deps, _Flat, _Keys, int]:
    """Per rank: (slot, dependency slot, dependency slot or -1, action) of every action, the
    slots numbering the actions; the actions in :func:`_topological` order; the (kind, chunk)
    pairs they take their times from; and how many actions there are."""
    order = action_order(family, p, v, m)
    n = p * v
    slots = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(x for r in order for x in r)}
    out = []
    for acts in order:
        rank = []
        for a in acts:
            s, i = a.stage, a.microbatch
            d1 = d2 = -1
            if a.kind == "F":
                d1 = slots[("F", s - 1, i)] if s > 0 else -1
            elif a.kind == "W":
                d1 = slots[("I", s, i)]
            else:
                d1 = slots[("F", s, i)]
                if s < n - 1:
                    d2 = slots.get(("B", s + 1, i), slots.get(("I", s + 1, i), -1))
            rank.append((slots[(a.kind, s, i)], d1, d2, a))
        out.append(tuple(rank))
    deps = tuple(out)
    keys = tuple(sorted({(a.kind, a.stage) for acts in order for a in acts}))
    return deps, _topological(deps, keys), keys, len(slots)


_F, _B_FIRST, _B_LATER, _I, _W_FIRST, _W_LATER, _NOTHING = range(7)
_NO_PEAK = -(2**62)  # a peak candidate no list reaches


@lru_cache(maxsize=256)
def _memory_walk(
    family: str, p: int, v: int, m: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[tuple[int, ...], ...]]:
    """The lists' actions as arrays, every rank's after the other's: their chunks, their kinds
    of memory move (``_F`` .. ``_NOTHING``); where each rank's actions begin; its chunks."""
    order = action_order(family, p, v, m)
    stage: list[int] = []
    move: list[int] = []
    starts: list[int] = []
    for acts in order:
        starts.append(len(stage))
        made: set[int] = set()  # the chunks whose gradients exist
        for a in acts:
            s = a.stage
            stage.append(s)
            if a.kind == "F":
                move.append(_F)
            elif a.kind == "B" or (a.kind == "W" and s == 0):  # chunk 0's W: the full backward
                move.append(_B_LATER if s in made else _B_FIRST)
                made.add(s)
            elif a.kind == "I":
                move.append(_I if s > 0 else _NOTHING)  # chunk 0's I does nothing
            else:
                move.append(_W_LATER if s in made else _W_FIRST)
                made.add(s)
    chunks = tuple(tuple(sorted({a.stage for a in acts})) for acts in order)
    return np.asarray(stage), np.asarray(move), np.asarray(starts), chunks


def peak_memory(family: str, p: int, v: int, m: int, costs: ChunkCosts) -> tuple[int, ...]:
    """Per rank: its chunks' static bytes plus the largest live bytes while it runs its list.

    Each action moves the live bytes by a delta and may peak above them on the way; with
    h, k, t, g, e, e1 the chunk's held, weight-held, transient, gradient and gradient-temporary
    (later, first) bytes and L the live bytes before the action:

        F        L + h                              peak at the end
        B first  L - h + g          peak L + t + e1, and at the end
        B later  L - h              peak L + t + e
        I        L + k - h          peak L + t, and at the end   (nothing on chunk 0)
        W first  L + g - k          peak L + g + e1
        W later  L - k              peak L + e

    A rank's peak: the largest of 0, its peaks on the way and its live bytes after each action.
    """
    if not costs.held_bytes:
        return (0,) * p
    n = costs.n

    def col(xs: Sequence[int] | None) -> np.ndarray:
        return np.asarray(xs or [0] * n, dtype=np.int64)

    h, k, t = col(costs.held_bytes), col(costs.weight_held_bytes), col(costs.transient_bytes)
    g, e, e1 = col(costs.grad_bytes), col(costs.grad_temp_bytes), col(costs.grad_temp_first_bytes)
    none = np.full(n, _NO_PEAK, dtype=np.int64)
    delta = np.stack([h, g - h, -h, k - h, g - k, -k, 0 * h])
    on_the_way = np.stack([none, t + e1, t + e, t, g + e1, e, none])
    stage, move, starts, chunks = _memory_walk(family, p, v, m)
    d = delta[move, stage]
    after = np.cumsum(d)
    # each rank starts from nothing: take off what the ranks before it left
    left = np.where(starts > 0, after[starts - 1], 0)
    after -= np.repeat(left, np.diff(starts, append=len(d)))
    top = np.maximum(after, after - d + on_the_way[move, stage])
    peaks = np.maximum(np.maximum.reduceat(top, starts), 0)
    static = costs.static_bytes
    return tuple(
        (sum(int(static[s]) for s in mine) if static else 0) + int(pk)
        for mine, pk in zip(chunks, peaks.tolist(), strict=True)
    )
