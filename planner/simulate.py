"""Discrete-event simulation of the GPipe (fill-drain) and 1F1B schedules.

Every stage runs its operations in a fixed order, each as soon as its device is free and its
input has arrived.  Stage j's forward of micro-batch i is ``F_j`` of compute followed by the
blocking send of its activations (``C_j / 2``); its backward waits for the gradient
(``C_j / 2``), recomputes the forward when the stage checkpoints, then runs the backward.

    forward(j, i)  needs forward(j - 1, i)
    backward(j, i) needs backward(j + 1, i) and forward(j, i)

For GPipe the makespan is  sum_j (f_j + b_j) + (m - 1) (max_j f_j + max_j b_j)  with
f_j = F_j + C_j/2 and b_j = B_j + C_j/2, so the closed form of :mod:`planner.costmodel`,
sum_j t_j + (m - 1) max_j t_j, is exact when b_j / f_j is the same for every stage and a lower
bound otherwise.

The operation order of stage j, drawn for p = 3, m = 4 (F = forward, B = backward)::

    gpipe  j=0: F0 F1 F2 F3 B0 B1 B2 B3          1f1b  j=0: F0 F1 F2 B0 F3 B1 B2 B3
           j=1: F0 F1 F2 F3 B0 B1 B2 B3                j=1: F0 F1 B0 F2 B1 F3 B2 B3
           j=2: F0 F1 F2 F3 B0 B1 B2 B3                j=2: F0 B0 F1 B1 F2 B2 F3 B3
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from planner.types import Plan

__all__ = ["Event", "Timeline", "operation_order", "simulate", "simulate_plan"]

Kind = Literal["forward", "send", "recv", "recompute", "backward"]


@dataclass(frozen=True, slots=True)
class Event:
    stage: int
    microbatch: int
    kind: Kind
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class Timeline:
    events: tuple[Event, ...]
    makespan_s: float
    n_stages: int
    microbatches: int

    def busy_s(self, stage: int) -> float:
        return sum(e.end_s - e.start_s for e in self.events if e.stage == stage)

    @property
    def bubble_fraction(self) -> float:
        """1 - average busy time per device / makespan."""
        if self.makespan_s <= 0:
            return 0.0
        busy = sum(self.busy_s(j) for j in range(self.n_stages)) / self.n_stages
        return 1.0 - busy / self.makespan_s


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


def simulate(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    m: int,
    *,
    schedule: str = "gpipe",
    recompute_s: Sequence[float] | None = None,
) -> Timeline:
    """Simulate one training step.

    ``backward_s[j]`` includes recomputation; ``recompute_s[j]`` (its part that is recompute) is
    used only to label the timeline.  ``comm_s[j]`` is the round trip C_j across the cut after
    stage j.
    """
    p = len(forward_s)
    rec = list(recompute_s) if recompute_s is not None else [0.0] * p
    orders = [operation_order(schedule, j, p, m) for j in range(p)]
    pos = [0] * p
    free = [0.0] * p
    f_done: dict[tuple[int, int], float] = {}
    b_done: dict[tuple[int, int], float] = {}
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for j in range(p):
            while pos[j] < len(orders[j]):
                op, i = orders[j][pos[j]]
                half = comm_s[j] / 2
                if op == "F":
                    if j > 0 and (j - 1, i) not in f_done:
                        break
                    t0 = max(free[j], f_done.get((j - 1, i), 0.0))
                    t1 = t0 + forward_s[j]
                    events.append(Event(j, i, "forward", t0, t1))
                    if half:
                        events.append(Event(j, i, "send", t1, t1 + half))
                    f_done[(j, i)] = free[j] = t1 + half
                else:
                    if j < p - 1 and (j + 1, i) not in b_done:
                        break
                    t0 = max(free[j], b_done.get((j + 1, i), 0.0), f_done[(j, i)])
                    t = t0
                    if half:
                        events.append(Event(j, i, "recv", t, t + half))
                        t += half
                    if rec[j]:
                        events.append(Event(j, i, "recompute", t, t + rec[j]))
                    events.append(Event(j, i, "backward", t + rec[j], t + backward_s[j]))
                    b_done[(j, i)] = free[j] = t + backward_s[j]
                pos[j] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - operation_order never deadlocks
            raise RuntimeError("schedule deadlocked")
    makespan = max(e.end_s for e in events) if events else 0.0
    return Timeline(tuple(events), makespan, p, m)


def simulate_plan(plan: Plan) -> Timeline:
    """Simulate a plan's step with its stage times, schedule and micro-batch count."""
    return simulate(
        [s.forward_s for s in plan.stages],
        [s.backward_s for s in plan.stages],
        [s.comm_s for s in plan.stages],
        plan.microbatches,
        schedule=plan.schedule,
        recompute_s=[s.forward_s if s.recompute else 0.0 for s in plan.stages],
    )
