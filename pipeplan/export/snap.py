"""Where a target can cut, and the closest plan it can express when the plan cuts elsewhere.

A cut between two units is expressible when no key lies on both sides of it (parameter-free
glue has no key and is transparent).  Each inexpressible cut goes to the nearest expressible
position before or after it, and of those choices the one with the lowest predicted step time
(:func:`pipeplan.planner.evaluate.evaluate` on the plan's profile) is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise, product
from typing import Final

from pipeplan.export.layout import ModelLayout, Target
from pipeplan.export.torchtitan import check_torchtitan, needs_layer_per_stage
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.types import Plan, PlanOptions, Profile

__all__ = [
    "Adjustment",
    "closest_plan",
    "legal_cuts",
    "pricer",
    "stage_keys_of",
    "starts_of",
    "target_cuts",
    "tied_notes",
]


#: Most cuts whose both roundings are tried (2**k plans are priced); beyond, the nearest is kept.
_MAX_ROUNDED = 10

#: Where each target can cut, for the line that says why a plan moved.
CUTS_AT: Final[dict[str, str]] = {
    "torchtitan": "it keeps whole modules per stage, the model's direct children and the items "
    "of its block list",
    "megatron": "its layout cuts only between the embedding, whole decoder layers and the loss",
    "deepspeed": "its layers are the model's top-level modules and blocks",
    "fqns": "a module is named in one stage",
}


def _neighbours(keys: Sequence[tuple[str, ...]], b: int) -> tuple[set[str], set[str]]:
    """The keys of the nearest units with keys before and after the cut before unit b."""
    before = next((keys[u] for u in range(b - 1, -1, -1) if keys[u]), ())
    after = next((keys[u] for u in range(b, len(keys)) if keys[u]), ())
    return set(before), set(after)


def _inside(keys: Sequence[tuple[str, ...]], b: int) -> str:
    """The key the cut before unit b divides."""
    before, after = _neighbours(keys, b)
    return min(before & after)


def target_cuts(unit_names: Sequence[str], target: Target) -> tuple[int, ...]:
    """The units a stage may start at (beyond unit 0) when ``target`` runs the plan: the legal
    cuts of its keys, and for torchtitan's transformers backend only cuts that leave a decoder
    layer on every stage (0.3.0 fails on a stage without one, see
    :mod:`pipeplan.export.torchtitan`).  Raises what the export would for a model the target
    cannot name.  Passed to the solvers as ``PlanOptions.allowed_cuts`` (``plan --for``)."""
    layout = ModelLayout.of(unit_names)
    keys = layout.keys(target)
    legal = legal_cuts(keys)
    if target == "torchtitan":
        check_torchtitan(layout, [list(dict.fromkeys(k for ks in keys for k in ks))])
        if needs_layer_per_stage(layout):
            blocks = [u for u, ks in enumerate(keys) if any(layout.is_block(k) for k in ks)]
            legal = [ok and blocks[0] < b <= blocks[-1] for b, ok in enumerate(legal)]
    return tuple(b for b in range(1, len(keys)) if legal[b])


def legal_cuts(keys: Sequence[tuple[str, ...]]) -> list[bool]:
    """``legal[b]``: a stage may start at unit b (no key lies on both sides of the cut)."""
    legal = [True] * len(keys)
    for b in range(1, len(keys)):
        before, after = _neighbours(keys, b)
        legal[b] = not before & after
    return legal


@dataclass(frozen=True)
class Adjustment:
    """The closest plan a target can express, when the plan itself cannot be."""

    reason: str
    """Which cut the target cannot express, and why."""
    plan: Plan
    """The closest expressible plan, evaluated on the plan's profile."""


def starts_of(plan: Plan) -> list[int]:
    return [s.first_unit for s in plan.stages]


def closest_plan(
    plan: Plan,
    keys: Sequence[tuple[str, ...]],
    legal: Sequence[bool],
    price: Callable[[list[int]], Plan] | None,
    target: str,
) -> tuple[list[int], str, Plan | None]:
    """The expressible stage starts closest to the plan's, the reason, and their Plan."""
    starts = starts_of(plan)
    bad = [b for b in starts[1:] if not legal[b]]
    names = [n for s in plan.stages for n in s.unit_names]
    first = bad[0]
    inside = _inside(keys, first)
    what = {"E": "the embedding (the units before the first block)", "L": "the head and loss"}
    reason = (
        f"{target} cannot cut inside {what.get(inside, inside)}, as the plan does between "
        f"{names[first - 1]} and {names[first]} ({len(bad)} such cut"
        f"{'s' if len(bad) > 1 else ''}): {CUTS_AT[target]}"
    )
    positions = [b for b in range(1, len(legal)) if legal[b]]
    if len(positions) < len(starts) - 1:
        raise InvalidRequestError(
            f"{target} can cut this model in only {len(positions)} place(s), so it cannot run "
            f"{len(starts)} stages; plan again with --stages {len(positions) + 1} or fewer"
        )
    options: list[list[int]] = []
    for b in starts[1:]:
        if legal[b]:
            options.append([b])
            continue
        down = [p for p in positions if p < b]
        up = [p for p in positions if p > b]
        near = ([down[-1]] if down else []) + ([up[0]] if up else [])
        options.append(sorted(near, key=lambda p: abs(p - b)))
    if sum(len(o) > 1 for o in options) > _MAX_ROUNDED:
        options = [o[:1] for o in options]
    candidates = [list(c) for c in product(*options) if all(a < b for a, b in pairwise([0, *c]))]
    if not candidates:  # the nearest positions collide: spread the cuts over them in order
        candidates = [_spread(starts[1:], positions)]
    if price is None:
        return candidates[0], reason, None
    priced = sorted(((price(c), c) for c in candidates), key=lambda pc: pc[0].step_time_s)
    return priced[0][1], reason, priced[0][0]


def _spread(wanted: list[int], positions: list[int]) -> list[int]:
    """Distinct legal positions, in order, each as near its wanted cut as the order allows."""
    out: list[int] = []
    for i, b in enumerate(wanted):
        room = len(wanted) - i - 1  # positions still needed after this one
        allowed = [p for p in positions if (not out or p > out[-1])]
        allowed = allowed[: len(allowed) - room] if room else allowed
        out.append(min(allowed, key=lambda p: abs(p - b)))
    return out


def tied_notes(stage_keys: Sequence[Sequence[str]], target: str) -> list[str]:
    """A line for each module named in several stages: after the cuts moved, only a tied
    parameter's modules are (the tie's first user is named after whichever module owns it)."""
    stages: dict[str, list[int]] = {}
    for j, ks in enumerate(stage_keys):
        for k in ks:
            if k not in ("E", "L"):
                stages.setdefault(k, []).append(j)
    return [
        f"{target}: {k} is named in stages {js}: they share a tied parameter, and a stage "
        f"that only reads it (a tied embedding) is named after the module that owns it"
        for k, js in stages.items()
        if len(js) > 1
    ]


def stage_keys_of(keys: Sequence[tuple[str, ...]], starts: Sequence[int]) -> list[list[str]]:
    bounds = [*starts, len(keys)]
    return [list(dict.fromkeys(k for ks in keys[a:b] for k in ks)) for a, b in pairwise(bounds)]


def pricer(plan: Plan, profile: Profile) -> Callable[[list[int]], Plan]:
    """Evaluate stage starts under the plan's cluster, options and micro-batch count."""
    options = PlanOptions(
        microbatches=plan.microbatches,
        checkpoint=plan.checkpoint,
        schedule=plan.schedule,
        optimizer=plan.optimizer,
    )

    def price(cuts: list[int]) -> Plan:
        return evaluate(profile, plan.cluster, options, cuts, plan.microbatches, solver="export")

    return price
