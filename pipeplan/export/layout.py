"""The model's structure as a plan's unit names reveal it, and each target's *keys*:
the modules it names per unit (see :mod:`pipeplan.export`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, get_args

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types.base import ScheduleName

__all__ = [
    "TARGETS",
    "TARGET_FAMILIES",
    "ModelLayout",
    "Target",
    "owner_names",
    "param_prefix",
    "unit_modules",
]


Target = Literal["torchtitan", "megatron", "deepspeed", "fqns"]

TARGETS: Final[tuple[Target, ...]] = ("torchtitan", "megatron", "deepspeed", "fqns")

#: The schedule families each target runs as planned (``pipeplan plan --for`` lets ``auto``
#: choose among these): torchtitan takes any of torch's classes by name; Megatron-LM runs 1F1B,
#: or its interleaved 1F1B with virtual stages (VPP); DeepSpeed its own 1F1B-like schedule.
TARGET_FAMILIES: Final[dict[Target, tuple[ScheduleName, ...]]] = {
    "torchtitan": get_args(ScheduleName),
    "megatron": ("1f1b", "interleaved1f1b"),
    "deepspeed": ("1f1b",),
    "fqns": get_args(ScheduleName),
}


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


def _rename(name: str, old: str, new: str) -> str:
    """``name`` with its module path ``old`` (whole, in any ``+`` part) replaced by ``new``."""
    parts = []
    for part in name.split("+"):
        path, bracket, rest = part.partition("[")
        path, hash_, num = path.partition("#")
        if path == old:
            path = new
        parts.append(path + hash_ + num + bracket + rest)
    return "+".join(parts)


def owner_names(
    unit_names: Sequence[str],
    shared: Sequence[tuple[str, Sequence[int]]] = (),
    unit_params: Sequence[Sequence[str]] = (),
) -> list[str]:
    """The unit names with a tied weight's first user named after the module torch names it
    under (``transformer.wte`` for GPT-2's tied ``transformer.wte.weight``), not after the
    head that shares it.

    A unit is named after the modules whose parameters it reads, and the tracer names a tied
    parameter after its last module (``lm_head``).  ``shared``: (parameter name as torch names
    it, the units that use it) per tied parameter, with ``unit_params`` the parameter names
    each unit reads (a profile's); a module of the first user that holds none of the unit's
    parameters is the tie's alias and takes the owner's name.  Without them, a transformers
    decoder's unit named ``lm_head`` before its first layer is ``model.embed_tokens``.

    >>> owner_names(["lm_head+wpe", "h.0", "ln_f+lm_head"], [("m.wte.weight", (0, 2))],
    ...             [("m.wte.weight", "m.wpe.weight"), ("m.h.0.w",), ("m.ln_f.w", "m.wte.weight")])
    ['wte+wpe', 'h.0', 'ln_f+lm_head']
    """
    names = list(unit_names)
    if not shared:
        layout = ModelLayout.of(names)
        if layout.wrapper == "model" and layout.container == "model.layers":
            for u, paths in enumerate(layout.modules):
                if any(_item(p) for p in paths):
                    break
                names[u] = _rename(names[u], "lm_head", "model.embed_tokens")
        return names
    prefix = param_prefix(names, unit_params)
    for param, users in shared:
        u = users[0]
        for path in unit_modules(names[u]):
            if not any(f".{path}." in f".{q}" for q in unit_params[u]):
                names[u] = _rename(names[u], path, param.rsplit(".", 1)[0].removeprefix(prefix))
    return names


def param_prefix(names: Sequence[str], unit_params: Sequence[Sequence[str]]) -> str:
    """What the parameter names carry before the unit names' module paths (``model.`` where
    pipeplan wrapped the model)."""
    for name, params in zip(names, unit_params):
        for path in unit_modules(name):
            for q in params:
                at = f".{q}".find(f".{path}.")
                if at >= 0:
                    return q[:at]
    return ""


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
