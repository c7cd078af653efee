"""Saving a training run over its ranks, and resuming it: weights, optimizer, RNG and step.

:func:`save` is collective (every rank calls it after the same step) and follows
:mod:`pipeplan.runtime.snapshots`: rank 0 makes the partial folder and a save id and
broadcasts the id; replica 0 of each pipeline rank writes its weights' shard (its stages'
tensors by the unsplit model's names, a tied one once; the save id in its safetensors
header) and every rank writes its training state (``train-r-of-n.pt``,
``torch.save``: the optimizer's ``state_dict`` with the parameter names it belongs to, the
step, the CPU and CUDA RNG states); the ranks gather what each wrote, or the error that stopped
it; rank 0 writes the index and the manifest and commits.  A rank that cannot write (a full
disk, whatever the library writing says: an ``OSError``, safetensors' ``SafetensorError``,
``torch.save``'s ``RuntimeError``) is reported by every rank, the partial folder is removed (the
disk is freed) and the run stops with the stage named; the previous save stays ``latest``.

:func:`restore` is the other half: each rank loads its training state (after its weights were
read from the same step folder, :class:`~pipeplan.runtime.checkpoint.CheckpointReader`) and
continues from the step saved, so ``run --steps 4`` and ``run --steps 2 --save D`` then
``run --resume D --steps 2`` end with the same bits (tested for GPipe, 1F1B, pp x dp, 1 stage
x 2 ranks sharded by FSDP2 and a zero-bubble V).

A plan sharded by FSDP2 (``Cluster.data_parallel_mode == "shard"``, :mod:`pipeplan.runtime.mesh`)
saves the same folder: each stage's weights shard holds full tensors (every rank of the stage
takes part in :meth:`~torch.distributed.tensor.DTensor.full_tensor`, replica 0 writes them), so
``transformers`` and any other plan read it as they read a replicated save; each rank's
training state holds its own shards (``DTensor.to_local()`` of Adam's moments, and the list of
entries that were sharded), which :func:`restore` wraps back with ``DTensor.from_local`` onto
the parameters' own mesh and placements.  The manifest covers every rank's file, as before.  A
save resumes only on the mesh it was made on (:func:`check_mesh`: pp, dp and the dp mode, and
tp).  A tensor-parallel plan (:mod:`pipeplan.runtime.mesh`) saves the same way: the t ranks of a
stage gather each split weight whole and tp rank 0 of replica 0 writes the shard; each rank's
training state holds its own slices.

torch's ``get_optimizer_state_dict`` and ``set_optimizer_state_dict``
(``torch.distributed.checkpoint.state_dict``) were weighed for this: with
``full_state_dict=False`` they return the same DTensors keyed by the paths of one module (a
rank here holds several chunk modules, and the save records the model's names), still to be
made local for ``torch.load(weights_only=True)`` (and an optimizer without state is first given
one by a zero-rate step); ``full_state_dict=True`` gathers whole states, which is not what a
rank of a sharded run should write.  DTensor's own ``to_local``, ``from_local`` and
``full_tensor`` are what remains, and they are used directly.

Why not ``torch.distributed.checkpoint`` itself: its strength is resharding a save onto another
layout, but a pipeline stage's optimizer state only makes sense for the same plan, and the
weights are already written as the sharded safetensors ``transformers`` reads; what it adds
for atomicity is what its callers (torchtitan) do around it, which is done here: a folder per
step, complete only when its manifest is written and its rename done.
"""

from __future__ import annotations

import contextlib
import os
import re
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
from pipeplan.runtime.mesh import local
from pipeplan.runtime.snapshots import (
    check_file,
    commit,
    file_record,
    partial_dir,
    prune,
    resolve,
    train_state_name,
)
from pipeplan.runtime.stage_errors import rank_label

__all__ = [
    "CheckpointWriteError",
    "PeerFailedError",
    "check_mesh",
    "mesh_record",
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
    collective = True
    """Every rank learnt it in the save's gather and raises with it: the rank that failed waits
    for its peers' error files before it exits (:mod:`pipeplan.runtime.error_files`)."""


class PeerFailedError(RuntimeError):
    """Another rank failed (here: could not write its part of a save); not this rank's fault."""

    peer = True


def mesh_record(plan: Plan) -> dict[str, Any]:
    """The mesh a save is made on, as the manifest records it: pipeline ranks, data-parallel
    ranks and how they hold the weights (``replicate`` for one replica, whatever the plan says),
    and tensor-parallel ranks (``tp``, recorded where t > 1)."""
    d, t = plan.cluster.data_parallel, plan.cluster.tensor_parallel
    mesh: dict[str, Any] = {
        "pp": plan.pipeline_ranks,
        "dp": d,
        "dp_mode": plan.cluster.data_parallel_mode if d > 1 else "replicate",
    }
    if t > 1:
        mesh["tp"] = t
    return mesh


def check_mesh(folder: Path, manifest: dict[str, Any], mesh: dict[str, Any]) -> None:
    """Refuse to resume the save in ``folder`` on another mesh than its own
    (:func:`mesh_record`): each rank's training state holds its own shards.  A save made
    before meshes were recorded was replicated; its pipeline ranks are checked by its cuts
    and its files' names."""
    saved = manifest.get("mesh") or {**mesh, "dp": manifest.get("replicas"), "dp_mode": "replicate"}
    if saved != mesh:
        have, want = (
            f"pp {m['pp']} x dp {m['dp']} ({m['dp_mode']})"
            + (f" x tp {m['tp']}" if "tp" in m else "")
            for m in (saved, mesh)
        )
        raise InvalidRequestError(
            f"--resume {folder}: the save was made on the mesh {have} but this plan runs "
            f"{want}; resume with the plan that was saved, or start a new run from its "
            f"weights with --weights"
        )


def run_info(plan: Plan, optimizer: str, lr: float, seed: int) -> dict[str, Any]:
    """What a resumed run must share with the saved one, recorded in the manifest."""
    return {
        "stages": plan.n_stages,
        "replicas": plan.cluster.data_parallel,
        "mesh": mesh_record(plan),
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
    optimizer = runner.optimizer.state_dict()
    sharded = [
        [i, key]
        for i, entry in optimizer["state"].items()
        for key, value in entry.items()
        if local(value) is not value
    ]
    optimizer["state"] = {
        i: {key: local(value) for key, value in entry.items()}
        for i, entry in optimizer["state"].items()
    }
    return {
        "step": step,
        "stage": runner.rank,
        "replica": runner.replica,
        "params": [runner.names[id(p)] for p in runner.params],
        "optimizer": optimizer,
        "sharded": sharded,  # the (parameter, state) entries saved as this rank's DTensor shard
        "rng": rng,
    }


def _full_tensors(runner: PipelineRunner) -> dict[str, torch.Tensor]:
    """This stage's tensors by checkpoint key, whole: FSDP2's shards all-gathered over the dp
    group, tensor-parallel shards over the tp group (collective: every replica and tp rank of
    the stage calls it, in the same order)."""
    from torch.distributed.tensor import DTensor

    tensors = runner.shard_tensors()
    if not runner.sharded and runner.tensor_parallel == 1:
        return tensors
    with torch.no_grad():
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in tensors.items()}


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
    tensors = _full_tensors(runner)
    try:
        if runner.replica == 0 and runner.tp_rank == 0:  # the others hold the same weights
            meta = {"save_id": save_id, "step": str(step)}
            size = write_shard(tmp, runner.rank, runner.ranks, tensors, meta)
            keys = sorted(tensors)
            records.append(file_record(tmp / shard_name(runner.rank, runner.ranks)))
        state = tmp / train_state_name(rank, world)
        torch.save(_train_state(runner, step), state)
        records.append(file_record(state))
        if fault is not None:
            fault(step)
    except Exception as exc:  # noqa: BLE001 - a full disk is not always an OSError (_why)
        error = _why(exc, tmp)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (error, records, keys, size))
    failed = [(r, g[0]) for r, g in enumerate(gathered) if g[0] is not None]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        r, why = failed[0]
        held = [
            s
            for s, owner in enumerate(runner.owner)
            if owner == r // runner.tensor_parallel % runner.ranks
        ]
        message = (
            f"{rank_label(r, held)} could not write its part of the save of step {step} "
            f"into {tmp}: {why}; the last complete save in {root} is kept"
        )
        raise CheckpointWriteError(message) if r == rank else PeerFailedError(message)
    if rank == 0:
        try:
            t = runner.tensor_parallel
            shards = [g[2] for g in gathered[: runner.ranks * t : t]]  # replica 0's, tp 0's
            write_index(tmp, shards, sum(g[3] for g in gathered))
            files = [rec for g in gathered for rec in g[1]] + [file_record(tmp / INDEX)]
            commit(root, step, save_id, files, info)
        except Exception as exc:  # noqa: BLE001 - as above
            why = _why(exc, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(
                f"stage 0 (rank 0) could not finish the save of step {step} into {tmp}: "
                f"{why}; the last complete save in {root} is kept"
            ) from None
        with contextlib.suppress(OSError):  # the save is complete: a prune may fail
            prune(root, keep)
    dist.barrier()


def _shard_like(param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` (this rank's part of a state saved from a DTensor) as a DTensor laid out as
    the sharded ``param`` (:func:`check_mesh` made sure the run is sharded as the save was)."""
    from torch.distributed.tensor import DTensor

    assert isinstance(param, DTensor)
    return DTensor.from_local(
        shard.to(param.device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


#: Free bytes under which a failed write is put down to a full disk.
FULL_DISK_BYTES = 1 << 20


def _why(exc: BaseException, folder: Path) -> str:
    """What stopped a write into ``folder``, in words, without the errno: "No space left on
    device" (the folder is in the message already).

    A full disk does not always come as an :class:`OSError`: safetensors raises
    ``SafetensorError("... I/O error: No space left on device (os error 28)")`` and
    ``torch.save`` ``RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos
    576 vs 534")``.  The system's words are taken from the first; for an error that names no
    cause, a folder with less than :data:`FULL_DISK_BYTES` free is reported as full."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    text = " ".join(str(exc).split())
    said = re.search(r"I/O error: (.+?) \(os error \d+\)", text)
    if said:
        return said.group(1)
    with contextlib.suppress(OSError):
        disk = os.statvfs(folder)
        if disk.f_bavail * disk.f_frsize < FULL_DISK_BYTES:
            return "No space left on device"
    return f"{type(exc).__name__}: {text[:300]}"


def resume_point(path: str | Path, info: dict[str, Any]) -> tuple[Path, int]:
    """The step folder to resume from for ``path`` (a save root or a step folder) and its
    step; raises :class:`InvalidRequestError` when the run differs from the saved one in what
    a resume needs equal (the mesh, the plan's cuts, the optimizer and its rate)."""
    folder, manifest = resolve(path)
    if manifest is None:
        raise ModelLoadError(
            f"--resume {path} is not a pipeplan save (no manifest.json); start from its weights "
            f"with --weights instead"
        )
    check_mesh(folder, manifest, info["mesh"])
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
    optimizer = state["optimizer"]
    for i, key in state.get("sharded", []):  # this rank's shards, onto the parameter's mesh
        optimizer["state"][i][key] = _shard_like(runner.params[i], optimizer["state"][i][key])
    runner.optimizer.load_state_dict(optimizer)
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and runner.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], runner.device)
    return int(state["step"])
