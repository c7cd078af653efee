"""The old discrete-event loop of GPipe and 1F1B, kept as the replay's oracle (test only).

Until issue 41 pipeplan had two step simulators: this loop, with its own hand-written order of
GPipe and 1F1B, and the replay of torch's action lists (:mod:`pipeplan.planner.replay`).  The
replay is now the only one; this loop stays here so that ``test_replay.py`` can check the two
agree to 1e-12, with contention, updates that share the host, and tied all-reduces.

Every stage runs its operations in a fixed order, each as soon as its device is free and its
input has arrived.  Stage j's forward of micro-batch i is ``F_j`` of compute followed by the
blocking send of its activations (``C_j / 2``); its backward waits for the gradient
(``C_j / 2``), recomputes the forward when the stage checkpoints, then runs the backward.

    forward(j, i)  needs forward(j - 1, i)
    backward(j, i) needs backward(j + 1, i) and forward(j, i)

With contention k compute runs at rate 1 / (1 + k a) while a other stages compute too.  Each
stage then updates its parameters after its last operation and its tied all-reduces (``syncs``,
run in order, each from the last of its stages' arrival); updates slow each other: while a run
at once each progresses at rate 1 / (1 + kappa_u (a - 1)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pipeplan.planner.replay import ReplayEvent as Event

__all__ = ["Timeline", "operation_order", "simulate"]

Kind = Literal[
    "forward",
    "send",
    "recv",
    "recompute",
    "backward",
    "backward_input",
    "backward_weight",
    "tied",
    "optimizer",
]


@dataclass(frozen=True, slots=True)
class Timeline:
    events: tuple[Event, ...]
    makespan_s: float


def operation_order(schedule: str, j: int, p: int, m: int) -> list[tuple[str, int]]:
    """The (op, micro-batch) sequence stage j of p runs for m micro-batches."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}; use 'gpipe' or '1f1b'")
    warmup = min(m, p - j - 1)
    order = [("F", i) for i in range(warmup)]
    f, bk = warmup, 0
    while f < m:
        order += [("F", f), ("B", bk)]
        f, bk = f + 1, bk + 1
    order += [("B", i) for i in range(bk, m)]
    return order


def _phases(
    op: str,
    j: int,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    rec: Sequence[float],
) -> list[tuple[Kind, float, bool]]:
    """(kind, amount, compute?) phases of one operation; compute is slowed by contention."""
    half = comm_s[j] / 2
    if op == "F":
        return [("forward", forward_s[j], True), ("send", half, False)]
    return [
        ("recv", half, False),
        ("recompute", rec[j], True),
        ("backward", backward_s[j] - rec[j], True),
    ]  # fmt: skip


def simulate(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    m: int,
    *,
    schedule: str = "gpipe",
    recompute_s: Sequence[float] | None = None,
    contention: float = 0.0,
    update_s: Sequence[float] = (),
    syncs: Sequence[tuple[Sequence[int], float]] = (),
    step_overhead_s: float = 0.0,
    update_contention: float = 0.0,
) -> Timeline:
    """Simulate one training step.

    ``backward_s[j]`` includes recomputation; ``recompute_s[j]`` (its part that is recompute) is
    used only to label the timeline.  ``comm_s[j]`` is the round trip C_j across the cut after
    stage j.  ``contention`` k slows compute (forward, recompute, backward; not transfers) by
    the factor 1 + k a while a other stages compute: the stages' progress is
    integrated between events, so partial overlaps cost in proportion.  ``update_s[j]`` (U_j;
    none by default) follows stage j's last operation and the all-reduces in ``syncs`` that
    stage j takes part in ((stages, seconds) each, run in order; an event spans a stage's wait
    for the others plus the all-reduce, as the runtime's "tied" span does).
    ``step_overhead_s`` (the engine's fixed cost per step, c) delays the first operation.
    ``update_contention`` kappa_u slows the updates under way by 1 + kappa_u (a - 1), a of
    them at once (integrated between releases and ends, as the compute is).
    """
    p = len(forward_s)
    kappa = contention if p > 1 and m > 1 else 0.0
    rec = list(recompute_s) if recompute_s is not None else [0.0] * p
    orders = [operation_order(schedule, j, p, m) for j in range(p)]
    pos = [0] * p
    # The running operation of each stage: its phases, the current one's index, the amount
    # left of it and when it started; None while the stage waits.
    running: list[tuple[int, list[tuple[Kind, float, bool]], int] | None] = [None] * p
    left = [0.0] * p
    began = [0.0] * p
    f_done: dict[tuple[int, int], float] = {}
    b_done: dict[tuple[int, int], float] = {}
    events: list[Event] = []
    now = float(step_overhead_s)

    def ready(j: int) -> bool:
        op, i = orders[j][pos[j]]
        if op == "F":
            return j == 0 or (j - 1, i) in f_done
        return (j == p - 1 or (j + 1, i) in b_done) and (j, i) in f_done

    def advance(j: int) -> None:
        """Finish phases of stage j that are over (or empty) at ``now``; start what is ready."""
        while True:
            cur = running[j]
            if cur is None:
                if pos[j] >= len(orders[j]) or not ready(j):
                    return
                op, i = orders[j][pos[j]]
                cur = (i, _phases(op, j, forward_s, backward_s, comm_s, rec), 0)
                running[j] = cur
                left[j], began[j] = cur[1][0][1], now
            i, phases, k = cur
            if left[j] > 0:
                return
            kind, amount, _ = phases[k]
            if amount > 0 or kind in ("forward", "backward"):
                events.append(Event(j, j, i, kind, began[j], now))
            if k + 1 < len(phases):
                running[j] = (i, phases, k + 1)
                left[j], began[j] = phases[k + 1][1], now
                continue
            op, _ = orders[j][pos[j]]
            (f_done if op == "F" else b_done)[(j, i)] = now
            running[j], pos[j] = None, pos[j] + 1

    while True:
        while True:  # a finish can make a neighbour ready at the same instant
            before = (tuple(pos), tuple(running))
            for j in range(p):
                advance(j)
            if (tuple(pos), tuple(running)) == before:
                break
        active = [j for j in range(p) if running[j] is not None]
        if not active:
            break
        now = shared_step(left, active, [running[j] is not None and _phase(running[j])[2]
                                         for j in range(p)], kappa, now)  # fmt: skip
    if any(pos[j] < len(orders[j]) for j in range(p)):  # pragma: no cover
        raise RuntimeError("schedule deadlocked")
    arrive = [max((e.end_s for e in events if e.stage == j), default=0.0) for j in range(p)]
    for members, seconds in syncs:
        end = max(arrive[i] for i in members) + seconds
        for i in members:
            events.append(Event(i, -1, -1, "tied", arrive[i], end))
            arrive[i] = end
    events += update_events(arrive, update_s, update_contention)
    makespan = max(e.end_s for e in events) if events else 0.0
    return Timeline(tuple(events), makespan)


def shared_step(
    left: list[float], active: Sequence[int], computes: Sequence[bool], kappa: float, now: float
) -> float:
    """Advance the running work to the next end and return its time: each of the a devices
    of ``active`` that ``computes`` progresses at rate 1 / (1 + k (a - 1)), the others (their
    transfers) at rate 1; ``left`` (per device) shrinks accordingly and the first to end
    reaches 0."""
    a = sum(1 for j in active if computes[j])
    slow = 1.0 / (1.0 + kappa * (a - 1)) if a > 1 else 1.0
    dt, first = min((left[j] / (slow if computes[j] else 1.0), j) for j in active)
    now += dt
    tiny = 1e-12 * max(now, 1e-300)
    for j in active:
        if j == first:
            left[j] = 0.0
        else:
            rest = left[j] - dt * (slow if computes[j] else 1.0)
            left[j] = rest if rest > tiny else 0.0
    return now


def update_events(
    arrive: Sequence[float], update_s: Sequence[float], kappa_u: float
) -> list[Event]:
    """The "optimizer" events of updates ``update_s[j]`` released at ``arrive[j]``: advanced from
    event to event (a release or an end), each one's remaining work shrinking at the rate
    1 / (1 + kappa_u (a - 1)) shared by the a under way; in stage order.  With kappa_u = 0 each
    ends U_j after its release."""
    if not kappa_u:
        return [
            Event(j, -1, -1, "optimizer", arrive[j], arrive[j] + u)
            for j, u in enumerate(update_s)
            if u > 0
        ]
    pending = sorted((arrive[j], j) for j, u in enumerate(update_s) if u > 0)
    left: dict[int, float] = {}  # remaining work of the updates under way
    ends: dict[int, float] = {}
    now = 0.0
    while pending or left:
        if not left:
            now = pending[0][0]
        while pending and pending[0][0] <= now:
            _, j = pending.pop(0)
            left[j] = float(update_s[j])
        rate = 1.0 / (1.0 + kappa_u * (len(left) - 1))
        dt = min(left.values()) / rate
        if pending and pending[0][0] - now < dt:
            dt = pending[0][0] - now
        now += dt
        for j in list(left):
            left[j] -= dt * rate
            if left[j] <= 1e-12 * max(abs(now), float(update_s[j])):
                ends[j] = now
                del left[j]
    return [Event(j, -1, -1, "optimizer", arrive[j], ends[j]) for j in sorted(ends)]


def _phase(cur: tuple[int, list[tuple[Kind, float, bool]], int] | None) -> tuple[Kind, float, bool]:
    assert cur is not None
    return cur[1][cur[2]]
