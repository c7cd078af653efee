"""Saving a training run over its ranks, and resuming it: weights, optimizer, RNG and step.

:func:`save` is collective (every rank calls it after the same step) and follows
:mod:`pipeplan.runtime.snapshots`: rank 0 makes the partial folder and a save id and
broadcasts the id; replica 0 of each pipeline rank writes its weights' shard (its stages'
tensors by the unsplit model's names, a tied one once; the save id in its safetensors
header) and every rank writes its training state (``train-r-of-n.pt``,
``torch.save``: the optimizer's ``state_dict`` with the parameter names it belongs to, the
step, the CPU and CUDA RNG states); the ranks gather what each wrote, or the error that stopped
it; rank 0 writes the index and the manifest and commits.  A rank that cannot write (a full
disk) is reported by every rank, the partial folder is removed and the run stops with the
stage named; the previous save stays ``latest``.

:func:`restore` is the other half: each rank loads its training state (after its weights were
read from the same step folder, :class:`~pipeplan.runtime.checkpoint.CheckpointReader`) and
continues from the step saved, so ``run --steps 4`` and ``run --steps 2 --save D`` then
``run --resume D --steps 2`` end with the same bits (tested for GPipe, 1F1B, pp x dp and a zero-bubble V).

Why not ``torch.distributed.checkpoint`` itself: its strength is resharding a save onto another
layout, but a pipeline stage's optimizer state only makes sense for the same plan, and the
weights are already written as the sharded safetensors ``transformers`` reads; what it adds
for atomicity is what its callers (torchtitan) do around it, which is done here: a folder per
step, complete only when its manifest is written and its rename done.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeplan.planner.errors import InvalidRequestError, ModelLoadError, PipeplanError
from pipeplan.planner.types import Plan
from pipeplan.runtime.checkpoint import INDEX, shard_name, write_index, write_shard
from pipeplan.runtime.engine import PipelineRunner
from pipeplan.runtime.snapshots import (
    check_file,
    commit,
    file_record,
    partial_dir,
    prune,
    resolve,
    train_state_name,
)

__all__ = [
    "CheckpointWriteError",
    "PeerFailedError",
    "restore",
    "resume_point",
    "run_info",
    "save",
]

SaveFault = Callable[[int], None]
"""Called with the step after a rank wrote its files and before they are gathered (tests)."""


class CheckpointWriteError(PipeplanError, RuntimeError):
    """This rank could not write its part of a save (a full disk, a lost mount)."""

    located = True
    """Its message names the stage, the step and what is kept: reported as it is."""


class PeerFailedError(RuntimeError):
    """Another rank failed (here: could not write its part of a save); not this rank's fault."""

    peer = True


def run_info(plan: Plan, optimizer: str, lr: float, seed: int) -> dict[str, Any]:
    """What a resumed run must share with the saved one, recorded in the manifest."""
    return {
        "stages": plan.n_stages,
        "replicas": plan.cluster.data_parallel,
        "graph_fingerprint": plan.graph_fingerprint,
        "boundaries": [s.first_unit for s in plan.stages],
        "schedule": plan.schedule,
        "microbatches": plan.microbatches,
        "optimizer": optimizer,
        "lr": lr,
        "lr_schedule": "constant",
        "seed": seed,
    }


def _train_state(runner: PipelineRunner, step: int) -> dict[str, Any]:
    rng = {"cpu": torch.get_rng_state()}
    if runner.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(runner.device)
    return {
        "step": step,
        "stage": runner.rank,
        "replica": runner.replica,
        "params": [runner.names[id(p)] for p in runner.params],
        "optimizer": runner.optimizer.state_dict(),
        "rng": rng,
    }


def save(
    runner: PipelineRunner,
    root: str | Path,
    step: int,
    info: dict[str, Any],
    fault: SaveFault | None = None,
    keep: int = 0,
) -> None:
    """Save the run after ``step`` optimizer steps into ``root/step-S`` (collective); then,
    with ``keep`` > 0, keep only the ``keep`` saves committed last
    (:func:`pipeplan.runtime.snapshots.prune`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root, tmp = Path(root), partial_dir(root, step)
    box: list[Any] = [None]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died saving this step
        tmp.mkdir()
        box[0] = secrets.token_hex(8)
    dist.broadcast_object_list(box, src=0)
    save_id: str = box[0]
    records, keys, size, error = [], [], 0, None
    try:
        if runner.replica == 0:  # the replicas hold the same weights
            tensors = runner.shard_tensors()
            meta = {"save_id": save_id, "step": str(step)}
            size = write_shard(tmp, runner.rank, runner.ranks, tensors, meta)
            keys = sorted(tensors)
            records.append(file_record(tmp / shard_name(runner.rank, runner.ranks)))
        state = tmp / train_state_name(rank, world)
        torch.save(_train_state(runner, step), state)
        records.append(file_record(state))
        if fault is not None:
            fault(step)
    except OSError as exc:
        error = _why(exc)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (error, records, keys, size))
    failed = [(r, g[0]) for r, g in enumerate(gathered) if g[0] is not None]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        r, why = failed[0]
        stage = r % runner.ranks
        message = (
            f"stage {stage} (rank {r}) could not write its part of the save of step {step} "
            f"into {tmp}: {why}; the last complete save in {root} is kept"
        )
        raise CheckpointWriteError(message) if r == rank else PeerFailedError(message)
    if rank == 0:
        try:
            shards = [g[2] for g in gathered[: runner.ranks]]  # replica 0's ranks
            write_index(tmp, shards, sum(g[3] for g in gathered))
            files = [rec for g in gathered for rec in g[1]] + [file_record(tmp / INDEX)]
            commit(root, step, save_id, files, info)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(
                f"stage 0 (rank 0) could not finish the save of step {step} into {tmp}: "
                f"{_why(exc)}; the last complete save in {root} is kept"
            ) from None
        with contextlib.suppress(OSError):  # the save is complete: a prune may fail
            prune(root, keep)
    dist.barrier()


def _why(exc: OSError) -> str:
    """What the system said, without the errno: "No space left on device" (the folder is in
    the message already)."""
    return exc.strerror or str(exc)


def resume_point(path: str | Path, info: dict[str, Any]) -> tuple[Path, int]:
    """The step folder to resume from for ``path`` (a save root or a step folder) and its
    step; raises :class:`InvalidRequestError` when the run differs from the saved one in what
    a resume needs equal (the plan's stages and replicas, the optimizer and its rate)."""
    folder, manifest = resolve(path)
    if manifest is None:
        raise ModelLoadError(
            f"--resume {path} is not a pipeplan save (no manifest.json); start from its weights "
            f"with --weights instead"
        )
    for key in ("graph_fingerprint", "boundaries", "replicas", "optimizer", "lr", "seed"):
        if manifest.get(key) != info[key]:
            raise InvalidRequestError(
                f"--resume {folder}: the save has {key} {manifest.get(key)!r} but this run has "
                f"{info[key]!r}; resume with the same plan, --optimizer, --lr and --seed, or "
                f"start a new run from its weights with --weights"
            )
    return folder, int(manifest["step"])


def restore(runner: PipelineRunner, folder: Path) -> int:
    """Load this rank's optimizer state and RNG states from the step folder ``folder``
    (whose weights the runner was built from); returns the step to continue from."""
    _, manifest = resolve(folder)
    assert manifest is not None  # resume_point checked it
    path = check_file(folder, manifest, train_state_name(dist.get_rank(), dist.get_world_size()))
    state = torch.load(path, map_location="cpu", weights_only=True)
    names = [runner.names[id(p)] for p in runner.params]
    if state["params"] != names:
        raise ModelLoadError(
            f"{path} holds the optimizer state of parameters {state['params'][:3]}... but "
            f"stage {runner.rank} has {names[:3]}...; resume with the plan that was saved"
        )
    runner.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and runner.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], runner.device)
    return int(state["step"])
