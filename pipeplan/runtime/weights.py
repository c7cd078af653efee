"""This rank's weights: its chunks' tensors given storage, and the shard of a save it writes.

A model built on ``meta`` (or any model run with a checkpoint to read) gets storage on the
device for this rank's chunks' tensors alone (:func:`materialize_chunks`): initialised as the
unsplit model would be for the same seed (the contract of :mod:`pipeplan.intake.meta`, seeded
per module), or read from the checkpoint (:mod:`pipeplan.runtime.checkpoint`).
:func:`shard_tensors` is the other way: the rank's parameters and persistent buffers as its
shard of a sharded safetensors save (:mod:`pipeplan.runtime.saving` writes it).

Checkpoint keys are the user's model's ``state_dict`` names: every alias of a tensor, without
the ``model.`` prefix of pipeplan's ``NamedInputs`` wrapper, so a tied parameter needs one of
its names and any plan of the model reads any save.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from pipeplan.intake.meta import materialize
from pipeplan.intake.model import NamedInputs
from pipeplan.runtime.checkpoint import CheckpointReader, load_checkpoint, match
from pipeplan.runtime.stages import TiedParameter

__all__ = ["check_weights", "materialize_chunks", "shard_tensors", "tensor_aliases"]


def _prefix(module: nn.Module) -> str:
    """The prefix of pipeplan's ``NamedInputs`` wrapper, which checkpoint keys leave out."""
    return "model." if isinstance(module, NamedInputs) else ""


def tensor_aliases(module: nn.Module) -> dict[int, list[str]]:
    """``id(tensor) -> every qualified name`` of the model's parameters and buffers."""
    names: dict[int, list[str]] = {}
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(t), []).append(name)
    return names


def materialize_chunks(
    module: nn.Module,
    chunks: Sequence[nn.Module],
    device: torch.device,
    *,
    seed: int,
    init_weights: Callable[[nn.Module], None] | None,
    weights: str | None,
) -> tuple[list[str], list[str]]:
    """Give the modules of ``module`` that own this rank's ``chunks``' tensors storage on
    ``device``: initialised (the contract of :mod:`pipeplan.intake.meta`, seeded per module)
    or read from the checkpoint ``weights``.  Returns the modules materialized and the
    checkpoint tensors read (sorted; none without ``weights``)."""
    aliases = tensor_aliases(module)
    tensors = list(dict.fromkeys(t for c in chunks for t in [*c.parameters(), *c.buffers()]))
    wanted = [aliases[id(t)][0] for t in tensors if id(t) in aliases]
    mods = materialize(
        module,
        wanted,
        device,
        seed=seed,
        init_weights=init_weights,
        initialize=weights is None,
    )
    reads: list[str] = []
    if weights is not None:
        targets, owned = _state(module, mods, aliases, persistent_only=True)
        reader = CheckpointReader(weights)
        load_checkpoint(reader, targets, owned)
        reads = sorted(reader.read_keys)
    return mods, reads


def check_weights(weights: str | Path, module: nn.Module) -> None:
    """Check, from the checkpoint's header alone, that ``weights`` holds every parameter and
    persistent buffer of ``module`` with its shape and dtype (:func:`~pipeplan.runtime.
    checkpoint.match`): what each rank would find reading its stage's share, found before
    any rank starts."""
    aliases = tensor_aliases(module)
    mods = [name for name, _ in module.named_modules(remove_duplicate=False)]
    targets, owned = _state(module, mods, aliases, persistent_only=True)
    reader = CheckpointReader(weights)
    for name, t in owned.items():
        match(reader, targets[name], t)


def _state(
    module: nn.Module, mods: list[str], aliases: dict[int, list[str]], *, persistent_only: bool
) -> tuple[dict[str, list[str]], dict[str, Tensor]]:
    """The tensors the modules ``mods`` own, by the model's first name, with their
    checkpoint keys (every alias, without pipeplan's ``NamedInputs`` prefix)."""
    by_name = dict(module.named_modules(remove_duplicate=False))
    prefix = _prefix(module)
    targets: dict[str, list[str]] = {}
    owned: dict[str, Tensor] = {}
    for mod_name in mods:
        mod = by_name[mod_name]
        items = [*mod._parameters.items(), *mod._buffers.items()]
        for key, t in items:
            if t is None or (persistent_only and key in mod._non_persistent_buffers_set):
                continue
            names = aliases[id(t)]
            keys = [n.removeprefix(prefix) for n in names]
            targets[names[0]], owned[names[0]] = keys, t
    return targets, owned


def shard_tensors(
    module: nn.Module,
    chunks: Sequence[nn.Module],
    *,
    names: dict[int, str],
    tied: Sequence[TiedParameter],
    owner: Sequence[int],
    rank: int,
) -> dict[str, Tensor]:
    """The parameters and persistent buffers of this rank's ``chunks`` by checkpoint key, each
    once, as the rank's shard of a sharded safetensors checkpoint; a parameter ``tied`` across
    ranks (stage s on rank ``owner[s]``; ``names``: ``id -> name``) belongs to the lowest rank
    holding it.  The keys are the unsplit model's, so any plan reads it."""
    aliases = tensor_aliases(module)
    by_id = {id(t): t for m in chunks for t in [*m.parameters(), *m.buffers()]}
    mods = sorted({n.rpartition(".")[0] for i in by_id for n in aliases.get(i, [])})
    _, owned = _state(module, mods, aliases, persistent_only=True)
    first = {t.name: min(owner[s] for s in t.stages) for t in tied}
    prefix = _prefix(module)
    return {
        name.removeprefix(prefix): t
        for name, t in owned.items()
        if id(t) in by_id and first.get(names.get(id(t), name), rank) == rank
    }
