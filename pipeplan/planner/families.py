"""Pipeline schedule families and their per-rank action lists, taken from torch's own classes.

A family runs n = p * v chunks (stages) on p ranks, v chunks per rank, placed in a loop
(chunk s on rank s mod p: ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
``ScheduleInterleavedZeroBubble``) or in a V (v = 2, chunks r and 2p - 1 - r on rank r:
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``).  Each rank runs its actions in a fixed
order: F (forward), B (full backward), or the backward split into I (gradient of the inputs,
``stage_backward_input``) and W (gradient of the weights, ``stage_backward_weight``).

:func:`action_order` builds those lists from torch's schedule classes themselves: the
multi-stage classes compute ``pipeline_order`` for every rank in their constructor, which needs
only each stage's index, count and rank, so stand-in stages without a process group suffice.
The lists are the ones ``_PipelineScheduleRuntime`` executes (idle slots dropped;
``OVERLAP_F_B`` expanded into its forward and backward, which run one after the other on CPU).

GPipe and 1F1B are ``PipelineScheduleSingle`` classes: they execute ``_step_microbatches``,
not ``pipeline_order``.  GPipe's ``pipeline_order`` matches what it executes and is used; torch
2.13's ``Schedule1F1B.pipeline_order`` does not (the last rank's list starts at F1 and ends
at F{m}), so 1F1B's list is the order its ``_step_microbatches`` runs: warm-up
min(m, p - r - 1) forwards, then one forward and one backward alternating, then the drain.
Drawn for p = 3, m = 4 (rank r runs chunk r)::

    gpipe  r=0: F0 F1 F2 F3 B0 B1 B2 B3          1f1b  r=0: F0 F1 F2 B0 F3 B1 B2 B3
           r=1: F0 F1 F2 F3 B0 B1 B2 B3                r=1: F0 F1 B0 F2 B1 F3 B2 B3
           r=2: F0 F1 F2 F3 B0 B1 B2 B3                r=2: F0 B0 F1 B1 F2 B2 F3 B3

Which (p, v, m) a family accepts is what its torch class accepts: :func:`check` constructs it
and reports torch's ``ValueError`` (for example Interleaved1F1B needs m a multiple of
max(1, m // p); 1F1B needs m >= p).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, NamedTuple

__all__ = [
    "FAMILIES",
    "Action",
    "Family",
    "FamilyName",
    "action_order",
    "check",
    "rank_of_stage",
    "stages_of_rank",
]

FamilyName = Literal[
    "gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "zb-interleaved", "zbv", "dualpipev"
]


@dataclass(frozen=True, slots=True)
class Family:
    name: FamilyName
    torch_class: str
    """The class in ``torch.distributed.pipelining.schedules``."""
    placement: Literal["loop", "v"]
    split_backward: bool
    """Whether its backward runs as I and W (needs a profile that measured them)."""
    v: tuple[int, ...]
    """The chunks per rank it accepts (multi-stage loops: 2 and up, planned up to 4)."""


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("gpipe", "ScheduleGPipe", "loop", False, (1,)),
        Family("1f1b", "Schedule1F1B", "loop", False, (1,)),
        Family("interleaved1f1b", "ScheduleInterleaved1F1B", "loop", False, (2, 3, 4)),
        Family("loopedbfs", "ScheduleLoopedBFS", "loop", False, (2, 3, 4)),
        Family("zb-interleaved", "ScheduleInterleavedZeroBubble", "loop", True, (2, 3, 4)),
        Family("zbv", "ScheduleZBVZeroBubble", "v", True, (2,)),
        Family("dualpipev", "ScheduleDualPipeV", "v", True, (2,)),
    )
}


class Action(NamedTuple):
    """One compute action of a rank: ``kind`` F, B, I or W on chunk ``stage``."""

    kind: Literal["F", "B", "I", "W"]
    stage: int
    microbatch: int


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def stages_of_rank(family: str, p: int, v: int, rank: int) -> list[int]:
    """The chunks rank ``rank`` holds, in the order torch's schedules take them."""
    if _family(family).placement == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(v)]


def rank_of_stage(family: str, p: int, v: int) -> list[int]:
    """rank_of_stage(...)[s]: the rank that runs chunk s."""
    out = [0] * (p * v)
    for r in range(p):
        for s in stages_of_rank(family, p, v, r):
            out[s] = r
    return out


class _StandIn:
    """What a schedule's constructor reads of a stage (no process group, no module to run)."""

    def __init__(self, index: int, n: int, p: int, rank: int) -> None:
        import torch

        self.stage_index, self.num_stages = index, n
        self.group_size, self.group_rank = p, rank
        self.is_first, self.is_last = index == 0, index == n - 1
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod = torch.nn.Identity()


def _build(family: Family, p: int, v: int, m: int) -> object:
    if v not in family.v:
        raise ValueError(
            f"{family.name} runs {' or '.join(map(str, family.v))} chunks per rank, not v = {v}"
        )
    return _built(family.name, p, v, m)


@lru_cache(maxsize=512)
def _built(name: str, p: int, v: int, m: int) -> object:
    """torch's schedule object on stand-in stages, built once per (family, p, v, m).

    The multi-stage classes end their constructor by lowering ``pipeline_order`` to the list
    with communication actions (``_prepare_schedule_with_comms``), which only the runtime
    needs and which costs about 0.15 s at p = 8, v = 2, m = 16, most of a plan's time.  The
    class built here keeps that method's validation of the order
    (``_validate_and_set_stage_mapping``) and skips the lowering; the compute lists are the
    ones the constructor computed before it (``tests/planner/test_replay.py`` checks them
    with torch's ``_validate_schedule``)."""
    from torch.distributed.pipelining import schedules

    n = p * v
    stages = [_StandIn(s, n, p, 0) for s in stages_of_rank(name, p, v, 0)]
    cls = getattr(schedules, FAMILIES[name].torch_class)
    if v > 1 or hasattr(cls, "_prepare_schedule_with_comms"):
        cls = _orders_only(cls)
    return cls(stages[0] if v == 1 else stages, m, loss_fn=_no_loss)


@lru_cache(maxsize=16)
def _orders_only(cls: type) -> type:
    def prepare(self: Any, actions: Any, format: str = "compute_only") -> None:
        self._validate_and_set_stage_mapping(actions)

    return type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": prepare})


def _no_loss(output: object, target: object) -> object:  # pragma: no cover - never called
    return output


@lru_cache(maxsize=1024)
def check(family: str, p: int, v: int, m: int) -> str | None:
    """``None`` when torch's class accepts p ranks, v chunks per rank and m micro-batches, else
    why not (torch's own message)."""
    fam = _family(family)
    if p < 1 or m < 1:
        return f"p = {p} and m = {m} must be positive"
    try:
        _build(fam, p, v, m)
    except (ValueError, AssertionError, RuntimeError) as e:
        return f"{family} with p = {p}, v = {v}, m = {m}: {' '.join(str(e).split())}"
    return None


def _one_f_one_b(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """What ``Schedule1F1B._step_microbatches`` runs on each rank r: w = min(m, p - r - 1)
    forwards, then F(w + i) and B(i) alternating, then the backwards left."""
    out = []
    for r in range(p):
        w = min(m, p - r - 1)
        acts = [Action("F", r, i) for i in range(w)]
        for i in range(m - w):
            acts += [Action("F", r, w + i), Action("B", r, i)]
        out.append((*acts, *(Action("B", r, i) for i in range(m - w, m))))
    return tuple(out)


@lru_cache(maxsize=512)
def action_order(family: str, p: int, v: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """The compute actions of every rank, in the order torch's schedule ``family`` runs them.

    >>> [" ".join(f"{a.kind}{a.stage}.{a.microbatch}" for a in r) for r in action_order("gpipe", 2, 1, 2)]
    ['F0.0 F0.1 B0.0 B0.1', 'F1.0 F1.1 B1.0 B1.1']
    """
    fam = _family(family)
    why = check(family, p, v, m)
    if why is not None:
        raise ValueError(why)
    if family == "1f1b":
        return _one_f_one_b(p, m)
    sched = _build(fam, p, v, m)
    order = sched.pipeline_order  # type: ignore[attr-defined]
    out = []
    for r in range(p):
        acts: list[Action] = []
        for a in order[r]:
            for sub in a.sub_actions or (a,) if a is not None else ():
                kind = str(sub.computation_type.value)
                if kind in ("F", "B", "I", "W"):
                    acts.append(Action(kind, sub.stage_index, int(sub.microbatch_index)))  # type: ignore[arg-type]
        out.append(tuple(acts))
    return tuple(out)
