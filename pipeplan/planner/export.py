"""A plan in the terms of the frameworks users train with (``pipeplan export``).

A plan cuts between units; each unit's name says which modules it holds (:mod:`pipeplan.planner.graph`:
``model.layers.3``, ``model.norm+lm_head``, a piece of a leaf module ``blocks.3.norm[pow_1]``,
a second piece of one module ``blocks.3.attn#2``, parameter-free glue ``glue`` or ``[add]``).
Names are relative to the user's model (a prefix every module shares, such as pipeplan's own
wrapper's, is dropped).  Each target sees the model at its own granularity, a *key* per module:

``fqns``
    The module names as the plan names them.  A list of module names per stage.
``torchtitan``
    The model's direct children and the items of its block list (``embed``, ``blocks.3``,
    ``head``): what torchtitan's ``_split_module`` keeps per stage (``module_fqns_per_model_part``:
    a direct child by name, or ``child.i`` of a direct ``ModuleList``/``ModuleDict``; nested
    lists are not supported).  A transformers decoder, whose blocks lie in ``model.layers``, is
    named as torchtitan's transformers backend flattens it: ``tok_embeddings`` (for
    ``model.embed_tokens``), ``layers.N``, ``norm``, ``lm_head``, and ``rotary_emb`` on every
    stage; a unit before the first layer named ``lm_head`` is the embedding tied to it (a unit
    is named after the parameters it reads, and a tied one has the head's name).  Any other
    model whose block list is not a direct child cannot be named (an error).  A block list
    that is an ``nn.Sequential`` is kept whole by torchtitan; pipeplan does not load the model
    to check.
``deepspeed``
    The same modules, with their full names, as the flat ``layers`` list of ``PipelineModule``;
    the plan is its ``parts``: stage s holds ``layers[parts[s]:parts[s + 1]]``.  A tied module
    is listed in each stage that uses it, as DeepSpeed's ``TiedLayerSpec`` is.
``megatron``
    ``E`` (every unit before the first block), one ``t`` per block, ``L`` (every unit after the
    last block): the ``--pipeline-model-parallel-layout`` string, and the
    ``--decoder-first/last-pipeline-num-layers`` pair when the middle stages hold equal counts.

A module named in several stages (a tied embedding and head) gets a note on each export.

A cut between two units is expressible when no key lies on both sides of it (parameter-free glue
has no key and is transparent).  A plan with a cut the target cannot express is moved to the
closest plan it can: each such cut goes to the nearest expressible position before or after it,
and of those choices the one with the lowest predicted step time (:func:`pipeplan.planner.evaluate.
evaluate` on the plan's profile) is taken.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise, product
from typing import Final, Literal

from pipeplan.planner.errors import FingerprintMismatchError, InvalidRequestError
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.types import Plan, PlanOptions, Profile

__all__ = [
    "TARGETS",
    "Adjustment",
    "Export",
    "ModelLayout",
    "Target",
    "export_plan",
    "megatron_layout",
]

Target = Literal["torchtitan", "megatron", "deepspeed", "fqns"]
TARGETS: Final[tuple[Target, ...]] = ("torchtitan", "megatron", "deepspeed", "fqns")

#: Most cuts whose both roundings are tried (2**k plans are priced); beyond, the nearest is kept.
_MAX_ROUNDED = 10

#: torchtitan's transformers backend's names for a Llama-like model's modules under ``model.``
#: (torchtitan/experiments/transformers_modeling_backend/model.py, ``named_children``).
_TITAN_HF_NAMES: Final = {"embed_tokens": "tok_embeddings", "final_layernorm": "norm"}


def unit_modules(name: str) -> tuple[str, ...]:
    """The module paths a unit's name holds (glue: none).

    >>> unit_modules("model.norm+lm_head"), unit_modules("blocks.3.norm[pow_1]")
    (('model.norm', 'lm_head'), ('blocks.3.norm',))
    >>> unit_modules("blocks.3.attn#2"), unit_modules("[add]"), unit_modules("glue")
    (('blocks.3.attn',), (), ())
    """
    name = re.sub(r"#\d+$", "", name)
    paths = []
    for part in name.split("+"):
        path = part.split("[", 1)[0]
        if path and path not in ("glue", "root") and path not in paths:
            paths.append(path)
    return tuple(paths)


def _item(path: str) -> str | None:
    """The first block-list item on a module path: ``model.layers.3.mlp`` -> ``model.layers.3``."""
    parts = path.split(".")
    for i, seg in enumerate(parts):
        if i > 0 and seg.isdigit():
            return ".".join(parts[: i + 1])
    return None


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


@dataclass(frozen=True)
class ModelLayout:
    """The model's structure as a plan's unit names reveal it."""

    modules: tuple[tuple[str, ...], ...]
    """Per unit, the module paths it holds."""
    container: str | None
    """The block list with the most items (``model.layers``), ``None`` when there is none."""
    wrapper: str
    """The module holding the block list (``model``; ``""`` for the root)."""
    containers: tuple[str, ...] = ()
    """Every block list of two items or more (an encoder's and a decoder's)."""

    @classmethod
    def of(cls, unit_names: Sequence[str]) -> ModelLayout:
        modules = tuple(unit_modules(n) for n in unit_names)
        items: dict[str, set[str]] = {}
        for paths in modules:
            for path in paths:
                item = _item(path)
                if item is not None:
                    items.setdefault(_parent(item), set()).add(item)
        container = max(items, key=lambda c: len(items[c]), default=None)
        lists = tuple(c for c in items if len(items[c]) > 1 or c == container)
        return cls(modules, container, _parent(container) if container else "", lists)

    def block_key(self, path: str) -> str:
        """The block-list item holding ``path``, else its module just below the wrapper's level."""
        item = _item(path)
        if item is not None and _parent(item) in self.containers:
            return item
        wrapper = self.wrapper.split(".") if self.wrapper else []
        parts = path.split(".")
        common = 0
        while common < min(len(wrapper), len(parts)) and wrapper[common] == parts[common]:
            common += 1
        return ".".join(parts[: common + 1])

    def is_block(self, key: str) -> bool:
        """Whether ``key`` is an item of a block list."""
        return _parent(key) in self.containers

    def keys(self, target: Target) -> list[tuple[str, ...]]:
        """Per unit, the target's keys (see the module docstring)."""
        if target == "fqns":
            return list(self.modules)
        blocks = [tuple(dict.fromkeys(self.block_key(p) for p in ps)) for ps in self.modules]
        if target != "megatron":
            return blocks
        if len(self.containers) > 1:
            raise InvalidRequestError(
                f"megatron: the model has {len(self.containers)} block lists "
                f"({', '.join(self.containers)}) and Megatron's layout lays out one stack of "
                f"decoder layers; export --to deepspeed or fqns"
            )
        holding = [u for u, ks in enumerate(blocks) if any(self.is_block(k) for k in ks)]
        if not holding:
            raise InvalidRequestError(
                "megatron: the plan's units hold no block list (a ModuleList of layers), so "
                "there are no decoder layers to lay out; export --to deepspeed or fqns"
            )
        out: list[tuple[str, ...]] = []
        for u, ks in enumerate(blocks):
            if u < holding[0]:
                out.append(("E",) if ks else ())
            elif u > holding[-1]:
                out.append(("L",) if ks else ())
            elif ks and not all(self.is_block(k) for k in ks):
                other = next(k for k in ks if not self.is_block(k))
                raise InvalidRequestError(
                    f"megatron: {other} lies among the decoder layers ({self.container}.N); "
                    f"Megatron's layout has only an embedding, decoder layers and the loss; "
                    f"export --to deepspeed or fqns"
                )
            else:
                out.append(ks)
        return out


#: Where each target can cut, for the line that says why a plan moved.
_CUTS_AT: Final[dict[str, str]] = {
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


def _legal_cuts(keys: Sequence[tuple[str, ...]]) -> list[bool]:
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


@dataclass(frozen=True)
class Export:
    """One plan written for one target."""

    target: Target
    text: str
    """What the target reads (TOML, JSON or command-line arguments), ending in a newline."""
    stage_keys: tuple[tuple[str, ...], ...]
    """Per stage, the target's names in order (megatron: ``E``, ``t``, ``L``)."""
    adjustment: Adjustment | None = None
    notes: tuple[str, ...] = ()


def _starts(plan: Plan) -> list[int]:
    return [s.first_unit for s in plan.stages]


def _closest(
    plan: Plan,
    keys: Sequence[tuple[str, ...]],
    legal: Sequence[bool],
    price: Callable[[list[int]], Plan] | None,
    target: str,
) -> tuple[list[int], str, Plan | None]:
    """The expressible stage starts closest to the plan's, the reason, and their Plan."""
    starts = _starts(plan)
    bad = [b for b in starts[1:] if not legal[b]]
    names = [n for s in plan.stages for n in s.unit_names]
    first = bad[0]
    inside = _inside(keys, first)
    what = {"E": "the embedding (the units before the first block)", "L": "the head and loss"}
    reason = (
        f"{target} cannot cut inside {what.get(inside, inside)}, as the plan does between "
        f"{names[first - 1]} and {names[first]} ({len(bad)} such cut"
        f"{'s' if len(bad) > 1 else ''}): {_CUTS_AT[target]}"
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


def _tied_notes(stage_keys: Sequence[Sequence[str]], target: str) -> list[str]:
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


def _stage_keys(keys: Sequence[tuple[str, ...]], starts: Sequence[int]) -> list[list[str]]:
    bounds = [*starts, len(keys)]
    return [list(dict.fromkeys(k for ks in keys[a:b] for k in ks)) for a, b in pairwise(bounds)]


def _json_object(fields: dict[str, object]) -> str:
    """A JSON object with one field per line, each value on one line."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items())
    return "{\n" + body + "\n}\n"


def megatron_layout(counts: Sequence[tuple[bool, int, bool]]) -> str:
    """The layout string of stages holding (embedding?, decoder layers, loss?).

    >>> megatron_layout([(True, 3, False), (False, 3, False), (False, 2, True)])
    'Et*3|t*3|t*2L'
    """
    stages = []
    for emb, t, loss in counts:
        body = "t" * t if t < 2 else f"t*{t}"
        stages.append(("E" if emb else "") + body + ("L" if loss else ""))
    return "|".join(stages)


def _pair_counts(layers: Sequence[int]) -> list[list[int]]:
    """The layers per stage ``--decoder-first/last-pipeline-num-layers`` can give (first and
    last > 0, the middle stages equal and > 0) that move the plan's cuts least, in layers."""
    p, n = len(layers), sum(layers)
    want = list(accumulate(layers))[:-1]
    best: int | None = None
    out: list[list[int]] = []
    for first in range(1, n):
        for mid in range(1, n) if p > 2 else [0]:
            last = n - first - (p - 2) * mid
            if last < 1:
                break
            counts = [first, *[mid] * (p - 2), last]
            moved = sum(abs(a - b) for a, b in zip(accumulate(counts), want))
            if best is None or moved < best:
                best, out = moved, [counts]
            elif moved == best:
                out.append(counts)
    return out


def _megatron(
    stage_keys: list[list[str]],
    block_starts: Sequence[int],
    price: Callable[[list[int]], Plan] | None,
    planned_s: float,
) -> tuple[str, list[str]]:
    """The layout line, the first/last line when it says the same, and a note when it cannot:
    the closest first/last counts, priced when ``price`` is given (``block_starts``: the unit
    each block starts at)."""
    last = len(stage_keys) - 1
    counts = [
        (j == 0, sum(k not in ("E", "L") for k in ks), j == last) for j, ks in enumerate(stage_keys)
    ]
    p = len(counts)
    layers = [t for _, t, _ in counts]
    size = f"--pipeline-model-parallel-size {p} --num-layers {sum(layers)}"
    lines = [f"{size} --pipeline-model-parallel-layout '{megatron_layout(counts)}'"]
    if p == 1:
        return lines[0] + "\n", []
    middle = layers[1:-1]
    if min(layers) > 0 and len(set(middle)) <= 1:
        lines.append(
            f"{size} --decoder-first-pipeline-num-layers {layers[0]} "
            f"--decoder-last-pipeline-num-layers {layers[-1]}"
        )
        return "\n".join(lines) + "\n", []
    why = (
        f"a stage holds no decoder layer ({layers})"
        if min(layers) == 0
        else f"the middle stages hold different counts ({middle})"
    )
    note = f"megatron: --decoder-first/last-pipeline-num-layers cannot express this plan: {why}"
    options = _pair_counts(layers)
    if not options:
        return lines[0] + "\n", [f"{note}, and there are fewer layers than stages"]
    choice, cost = options[0], ""
    if price is not None:
        priced = []
        for option in options:
            cuts = [block_starts[c] for c in list(accumulate(option))[:-1]]
            priced.append((price(cuts).step_time_s, option))
        step, choice = min(priced)
        change = (step / planned_s - 1) * 100 if planned_s > 0 else 0.0
        cost = (
            f": predicted step {step * 1e3:.4g} ms vs {planned_s * 1e3:.4g} ms planned "
            f"({change:+.1f}%)"
        )
    else:
        cost = " (give --profile to price it)"
    note += (
        f"; the closest they can is --decoder-first-pipeline-num-layers {choice[0]} "
        f"--decoder-last-pipeline-num-layers {choice[-1]} ({choice} layers per stage){cost}; "
        f"the layout above is the plan itself"
    )
    return lines[0] + "\n", [note]


def _torchtitan(
    layout: ModelLayout, stage_keys: list[list[str]], plan: Plan
) -> tuple[str, list[list[str]]]:
    prefix = layout.wrapper + "." if layout.wrapper else ""
    names = [[k.removeprefix(prefix) for k in ks] for ks in stage_keys]
    if layout.wrapper == "model" and layout.container == "model.layers":
        # Before the first layer a decoder only embeds: a unit there named lm_head reads the
        # embedding tied to it (units are named after the parameters they read).
        first = next(
            j for j, ns in enumerate(names) if any(layout.is_block(k) for k in stage_keys[j])
        )
        for j in range(first + 1):
            block = next((i for i, k in enumerate(stage_keys[j]) if layout.is_block(k)), None)
            cut = len(names[j]) if block is None else block
            names[j] = [
                "embed_tokens" if n == "lm_head" and i < cut else n for i, n in enumerate(names[j])
            ]
            names[j] = list(dict.fromkeys(names[j]))
        names = [[_TITAN_HF_NAMES.get(n, n) for n in ns] + ["rotary_emb"] for ns in names]
    elif layout.wrapper:
        raise InvalidRequestError(
            f"torchtitan: the block list {layout.container} is not a direct child of the model, "
            f"and torchtitan keeps only the model's direct children and the items of a direct "
            f"ModuleList (its transformers backend flattens Llama-like models only); "
            f"export --to deepspeed or fqns"
        )
    for n in sorted({n for ns in names for n in ns}):
        parts = n.split(".")
        if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise InvalidRequestError(
                f"torchtitan: {n} is neither a direct child of the model nor an item of a "
                f"direct ModuleList, and torchtitan keeps only those; export --to deepspeed or "
                f"fqns"
            )
    schedule = {"gpipe": "GPipe", "1f1b": "1F1B"}[plan.schedule]
    text = (
        "[parallelism]\n"
        f"pipeline_parallel_degree = {len(names)}\n"
        f'pipeline_parallel_schedule = "{schedule}"\n'
        f"num_pp_microbatches = {plan.microbatches}\n"
        f"module_fqns_per_model_part = {json.dumps(names)}\n"
    )
    return text, names


def _pricer(plan: Plan, profile: Profile) -> Callable[[list[int]], Plan]:
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


def export_plan(plan: Plan, target: Target, profile: Profile | None = None) -> Export:
    """``plan`` in ``target``'s terms; when the target cannot express a cut, the closest plan
    it can (priced on ``profile``, which must be the plan's; without it the cut is an error).
    """
    if target not in TARGETS:
        raise InvalidRequestError(f"--to {target!r} is not one of {', '.join(TARGETS)}")
    if profile is not None and profile.fingerprint != plan.profile_fingerprint:
        raise FingerprintMismatchError(
            f"the profile's fingerprint {profile.fingerprint} is not the plan's "
            f"({plan.profile_fingerprint}); give the profile the plan was made from"
        )
    if plan.granularity == "node":
        raise InvalidRequestError(
            "the plan's units are graph nodes (profiled with --granularity node), not modules, "
            "so no framework can name them; profile with --granularity auto and plan again"
        )
    names = [n for s in plan.stages for n in s.unit_names]
    layout = ModelLayout.of(names)
    keys = layout.keys(target)
    legal = _legal_cuts(keys)
    starts = _starts(plan)
    adjustment = None
    if not all(legal[b] for b in starts[1:]):
        price = None if profile is None else _pricer(plan, profile)
        cuts, reason, closest = _closest(plan, keys, legal, price, target)
        if closest is None:
            raise InvalidRequestError(
                f"{reason}; give --profile PROFILE (the plan's profile) to price the closest "
                f"plan it can express"
            )
        adjustment = Adjustment(reason, closest)
        starts = [0, *cuts]
    stage_keys = _stage_keys(keys, starts)
    notes = _tied_notes(stage_keys, target)
    if target == "megatron":
        block_starts = [
            min(u for u, ks in enumerate(keys) if k in ks)
            for k in dict.fromkeys(k for ks in keys for k in ks if k not in ("E", "L"))
        ]
        price = None if profile is None else _pricer(plan, profile)
        text, more = _megatron(stage_keys, block_starts, price, plan.step_time_s)
        notes += more
        out_keys = [
            (["E"] if j == 0 else [])
            + ["t"] * sum(k not in ("E", "L") for k in ks)
            + (["L"] if j == len(stage_keys) - 1 else [])
            for j, ks in enumerate(stage_keys)
        ]
    elif target == "torchtitan":
        text, out_keys = _torchtitan(layout, stage_keys, plan)
    elif target == "deepspeed":
        flat = [k for ks in stage_keys for k in ks]
        parts = [0]
        for ks in stage_keys:
            parts.append(parts[-1] + len(ks))
        body = {"num_stages": len(stage_keys), "parts": parts, "layers": flat}
        text, out_keys = _json_object(body), stage_keys
    else:
        rows = ",\n".join(f"  {json.dumps(ks)}" for ks in stage_keys)
        text, out_keys = f"[\n{rows}\n]\n", stage_keys
    return Export(
        target,
        text,
        tuple(tuple(ks) for ks in out_keys),
        adjustment,
        tuple(notes),
    )
