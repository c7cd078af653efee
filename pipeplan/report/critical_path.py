"""Why a plan's step takes what it takes: the chain of actions that sets it, and each rank's
actions as text.

    pipeplan show plan.json --critical-path     # the chain, and the stage that sets the pace
    pipeplan show plan.json --timeline          # rank 0: F0 F1 B0 B1 ...

The replay (:mod:`pipeplan.planner.replay`) starts each action when its rank is free and its
input has arrived:

    F(s, i)     after F(s - 1, i)
    B/I(s, i)   after F(s, i) and the B (or, for the split families, the I) of (s + 1, i)
    W(s, i)     after I(s, i)

each after the rank's previous action; the ranks that hold a tied parameter sum its gradient
when the last of them is done, and each rank then updates.  The step ends with the last
update.  Walking back from it, each action's predecessor on the critical path is the one of
these whose end is its start (an input from another chunk before the rank's own previous
action, where both end then).  No action on the chain can start earlier, so a shorter step
needs a shorter action on it: the chain is the step's critical path, its durations sum to the
step (less the engine's cost before the first action).  The stage that sets the pace in the
steady phase is the one whose compute on the chain takes the longest.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from pipeplan.planner.families import action_order
from pipeplan.planner.replay import Replay, ReplayEvent, replay_plan
from pipeplan.planner.types import Plan

__all__ = ["CriticalPath", "PathStep", "critical_path", "path_table", "rank_lines"]

#: The replay's event kinds, by the action (F, B, I, W) they are a phase of; ``recv`` precedes
#: the B or I that reads the received gradient.
_ACTION = {
    "forward": "F",
    "send": "F",
    "recompute": "B",
    "backward": "B",
    "backward_input": "I",
    "backward_weight": "W",
}


@dataclass(frozen=True, slots=True)
class PathStep:
    """One link of the chain: an action (F, B, I, W) of chunk ``stage`` on micro-batch
    ``microbatch``, or a rank's ``tied`` all-reduce or ``update`` (no stage, no micro-batch)."""

    rank: int
    stage: int | None
    microbatch: int | None
    action: str
    start_s: float
    end_s: float

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class CriticalPath:
    steps: tuple[PathStep, ...]
    """In time order: each starts when the one before it ends."""
    step_s: float
    """The plan's replayed step."""
    pace_stage: int | None
    """The stage whose compute on the chain takes the longest (``None``: none computes)."""
    pace_s: float
    """That stage's compute seconds on the chain."""


def _actions(rep: Replay) -> dict[tuple[int, int, str], PathStep]:
    """Every compute action of the replay, by (stage, micro-batch, F/B/I/W): from its first
    phase's start to its last phase's end (a ``recv`` joins the B or I of its chunk and
    micro-batch: DualPipeV runs both kinds)."""
    spans: dict[tuple[int, int, str], PathStep] = {}

    def add(e: ReplayEvent, key: tuple[int, int, str]) -> None:
        old = spans.get(key)
        start = e.start_s if old is None else min(old.start_s, e.start_s)
        end = e.end_s if old is None else max(old.end_s, e.end_s)
        spans[key] = PathStep(e.rank, e.stage, e.microbatch, key[2], start, end)

    tensors = [e for e in rep.events if e.stage >= 0]
    for e in tensors:
        if e.kind != "recv":
            add(e, (e.stage, e.microbatch, _ACTION[e.kind]))
    for e in tensors:
        if e.kind == "recv":
            add(e, (e.stage, e.microbatch, "I" if (e.stage, e.microbatch, "I") in spans else "B"))
    return spans


def _inputs(key: tuple[int, int, str], n: int) -> list[tuple[int, int, str]]:
    """The actions of other chunks (or of the same chunk) that action ``key`` may wait for."""
    s, i, letter = key
    if letter == "F":
        return [(s - 1, i, "F")] if s > 0 else []
    if letter == "W":
        return [(s, i, "I")]
    later = [(s + 1, i, "I"), (s + 1, i, "B")] if s + 1 < n else []
    return [*later, (s, i, "F")]


def critical_path(plan: Plan, replay: Replay | None = None) -> CriticalPath:
    """The chain of actions that sets ``plan``'s step (module docstring); ``replay``: the
    plan's :func:`~pipeplan.planner.replay.replay_plan`, when the caller has it."""
    rep = replay if replay is not None else replay_plan(plan)
    spans = _actions(rep)
    by_rank: dict[int, list[PathStep]] = {}
    for a in sorted(spans.values(), key=lambda a: (a.start_s, a.end_s)):
        by_rank.setdefault(a.rank, []).append(a)
    previous = {
        (a.stage, a.microbatch, a.action): (mine[k - 1] if k else None)
        for mine in by_rank.values()
        for k, a in enumerate(mine)
    }
    eps = 1e-9 * max(rep.makespan_s, 1e-12)
    tails = [e for e in rep.events if e.stage < 0]
    chain: list[PathStep] = []
    current: PathStep | None = None
    last = max(tails, key=lambda e: e.end_s, default=None)
    if last is not None and last.end_s >= max((a.end_s for a in spans.values()), default=0.0):
        current = _tail(last, tails, chain, eps)
    if current is None and spans:  # no update ends the step: its last action does
        current = max(spans.values(), key=lambda a: a.end_s)
    elif current is not None:  # the rank's last action before its tied sum or update
        mine = by_rank.get(current.rank, [])
        current = next((a for a in reversed(mine) if abs(a.end_s - current.start_s) <= eps), None)
    n = plan.n_stages
    while current is not None:
        chain.append(current)
        assert current.stage is not None and current.microbatch is not None
        key = (current.stage, current.microbatch, current.action)
        waits = [spans[k] for k in _inputs(key, n) if k in spans]
        own = previous.get(key)
        candidates = [*waits, *([own] if own is not None else [])]
        current = next((c for c in candidates if abs(c.end_s - current.start_s) <= eps), None)
    chain.reverse()
    compute: dict[int, float] = {}
    for step in chain:
        if step.stage is not None:
            compute[step.stage] = compute.get(step.stage, 0.0) + step.seconds
    pace = max(compute, key=lambda s: (compute[s], -s), default=None)
    return CriticalPath(
        steps=tuple(chain),
        step_s=rep.makespan_s,
        pace_stage=pace,
        pace_s=compute.get(pace, 0.0) if pace is not None else 0.0,
    )


def _tail(
    last: ReplayEvent, tails: list[ReplayEvent], chain: list[PathStep], eps: float
) -> PathStep:
    """The update that ends the step and the tied all-reduces before it, appended to ``chain``
    (backwards); returns the first of them, whose start the rank's last action ends at."""
    ev: ReplayEvent | None = last
    step = PathStep(last.rank, None, None, "update", last.start_s, last.end_s)
    if last.kind == "optimizer":
        chain.append(step)
        ev = _sum_ending(tails, step.rank, step.start_s, eps)
    while ev is not None:  # a sum starts when the last of its ranks arrives: follow that rank
        peers = [e for e in tails if e.kind == "tied" and abs(e.end_s - ev.end_s) <= eps]
        arrived = max(peers, key=lambda e: e.start_s)
        step = PathStep(arrived.rank, None, None, "tied", arrived.start_s, arrived.end_s)
        chain.append(step)
        ev = _sum_ending(tails, arrived.rank, arrived.start_s, eps)
    return step


def _sum_ending(tails: list[ReplayEvent], rank: int, at: float, eps: float) -> ReplayEvent | None:
    """Rank ``rank``'s tied all-reduce that ends at ``at`` (and lasts), if any."""
    return next(
        (e for e in tails if e.kind == "tied" and e.rank == rank and abs(e.end_s - at) <= eps
         and e.end_s - e.start_s > eps),
        None,
    )  # fmt: skip


def rank_lines(plan: Plan) -> list[str]:
    """Each rank's actions in the order torch runs them: ``rank 0: F0 F1 B0 B1``, with the
    chunk after the micro-batch where a rank runs several (``F0.2``: micro-batch 0 of chunk 2)."""
    p, v, m = plan.pipeline_ranks, plan.stages_per_rank, plan.microbatches
    lines = []
    for r, actions in enumerate(action_order(plan.schedule, p, v, m)):
        words = [f"{a.kind}{a.microbatch}" + (f".{a.stage}" if v > 1 else "") for a in actions]
        lines.append(f"rank {r}: " + " ".join(words))
    return lines


def path_table(path: CriticalPath) -> Table:
    """The chain as a table, with a title that names the stage setting the pace."""
    pace = (
        f"; stage {path.pace_stage} sets the pace ({_ms(path.pace_s)} ms of its compute on it)"
        if path.pace_stage is not None
        else ""
    )
    table = Table(
        title=f"critical path: {len(path.steps)} actions, step {_ms(path.step_s)} ms{pace}",
        title_justify="left",
    )
    for name in ("rank", "stage", "micro-batch", "action", "start ms", "end ms", "ms"):
        table.add_column(name, justify="left" if name == "action" else "right")
    for s in path.steps:
        table.add_row(
            str(s.rank),
            "-" if s.stage is None else str(s.stage),
            "-" if s.microbatch is None else str(s.microbatch),
            s.action,
            _ms(s.start_s),
            _ms(s.end_s),
            _ms(s.seconds),
        )
    return table


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"
