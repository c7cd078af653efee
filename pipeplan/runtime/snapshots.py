"""Checkpoints of a training run that never tear: one folder per saved step, made visible whole.

A run saving into ``DIR`` (``pipeplan run --save DIR``) writes each save as its own step folder
and moves one pointer last::

    DIR/
      latest                       "step-000004": the newest complete save (replaced atomically)
      step-000002/ step-000004/    complete saves, never written again
        model-0000k-of-0000p.safetensors   stage k-1's weights (safetensors metadata: save id)
        model.safetensors.index.json       tensor -> shard, as ``transformers`` writes it
        train-0000r-of-0000n.pt            rank r's optimizer state, RNG states and step
        manifest.json                      written last: save id, step, every file's bytes and
                                           SHA-256, the run's settings
      .partial-step-000006/        a save under way (or one a dead run left; never read)

The protocol (:mod:`pipeplan.runtime.saving` drives it over the ranks):

1. rank 0 makes a fresh ``.partial-step-S`` folder and a save id (a random hex string);
2. every rank writes its files into it (:func:`file_record` gives their bytes and SHA-256);
3. once every rank has reported its files, rank 0 writes the index and ``manifest.json``,
   fsyncs, renames the folder to ``step-S`` (one ``rename``: the folder appears whole or not
   at all), and replaces ``latest`` (:func:`commit`).

A run that dies anywhere before step 3's rename leaves only a partial folder, which nothing
reads; ``latest`` still names the previous complete save.  This is the scheme of
``torch.distributed.checkpoint``'s callers (torchtitan writes ``step-N`` folders and marks
them complete at the end) with the sharded safetensors files ``transformers`` reads.

With ``--keep K``, rank 0 then removes the complete saves but the K committed last
(:func:`prune`; ``latest``'s is always kept): each is first renamed to a hidden
``.pruned-step-S`` (one ``rename`` again, so no ``step-S`` folder is ever seen half removed),
then deleted; a prune a dead run left is finished by the next one.

Reading (:func:`resolve`, :func:`check_file`) refuses what a tear, a truncation or a mix
would leave: a step folder without a manifest, a file the manifest lists that is missing, of
another size, of another SHA-256, or a shard whose save id is not the manifest's; each error
names the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeplan.planner.errors import ModelLoadError

__all__ = [
    "LATEST",
    "MANIFEST",
    "FileRecord",
    "check_file",
    "commit",
    "committed_saves",
    "file_record",
    "fsync_dir",
    "latest_step",
    "partial_dir",
    "prune",
    "read_manifest",
    "remove_partials",
    "resolve",
    "step_name",
    "train_state_name",
]

LATEST = "latest"
MANIFEST = "manifest.json"
_SCHEMA = 1


def step_name(step: int) -> str:
    """``step-000004`` for the save after 4 optimizer steps."""
    return f"step-{step:06d}"


def train_state_name(rank: int, world: int) -> str:
    """``train-00001-of-00004.pt``: rank 1's optimizer state, RNG states and step."""
    return f"train-{rank:05d}-of-{world:05d}.pt"


_PARTIAL = ".partial-"
_POINTER = f".{LATEST}.tmp"  # written, then renamed to LATEST


def partial_dir(root: str | Path, step: int) -> Path:
    """The folder a save of ``step`` is written into before :func:`commit` renames it."""
    return Path(root) / f"{_PARTIAL}{step_name(step)}"


def remove_partials(root: str | Path) -> None:
    """Remove what a save cut short leaves in ``root`` (a rank killed inside :func:`commit`):
    its partial folders and the pointer not yet renamed to ``latest``.  The complete saves,
    ``latest`` and the ``.old-`` copy a repeated step's save renames away are kept.  Only
    when no rank writes ``root`` (:mod:`pipeplan.runtime.save_lock`)."""
    root = Path(root)
    for stale in root.glob(f"{_PARTIAL}*"):
        shutil.rmtree(stale, ignore_errors=True)
    with contextlib.suppress(OSError):
        (root / _POINTER).unlink(missing_ok=True)


@dataclass(frozen=True)
class FileRecord:
    """One file of a save: its name in the step folder, its size and its SHA-256."""

    name: str
    bytes: int
    sha256: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> FileRecord:
    """Fsync ``path`` and describe it (read back from disk, so a short write shows)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return FileRecord(path.name, path.stat().st_size, _sha256(path))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit(
    root: str | Path, step: int, save_id: str, files: list[FileRecord], info: dict[str, Any]
) -> Path:
    """Finish a save whose files are all in :func:`partial_dir`: write ``manifest.json`` into
    it, rename it to ``step-S`` (replacing an older save of the same step) and point
    ``latest`` at it.  Returns the step folder."""
    root = Path(root)
    tmp, final = partial_dir(root, step), root / step_name(step)
    manifest = {
        "format": "pipeplan-checkpoint",
        "schema": _SCHEMA,
        "save_id": save_id,
        "step": step,
        "committed_ns": time.time_ns(),  # the order of saves, which their steps need not be
        **info,
        "files": {r.name: {"bytes": r.bytes, "sha256": r.sha256} for r in sorted(files, key=lambda r: r.name)},
    }  # fmt: skip
    _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    fsync_dir(tmp)
    if final.exists():  # a save of the same step (a run repeated): the new one replaces it
        old = root / f".old-{step_name(step)}-{save_id}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    pointer = root / _POINTER
    _write_synced(pointer, step_name(step) + "\n")
    os.replace(pointer, root / LATEST)
    fsync_dir(root)
    return final


def prune(root: str | Path, keep: int) -> list[Path]:
    """Remove the complete saves of ``root`` but the ``keep`` committed last (their manifests'
    ``committed_ns``; ``keep`` = 0 keeps every one) and the one ``latest`` names; finish
    the removals a dead run left.  Each goes by a ``rename`` to a hidden ``.pruned-`` name
    first, so a save is either whole at its ``step-S`` name or gone from it.  Returns the step
    folders removed.  What cannot be renamed or deleted (a disk error) is left, and named
    nowhere: the save is complete either way."""
    root = Path(root)
    for left in root.glob(".pruned-step-*"):
        shutil.rmtree(left, ignore_errors=True)
    if keep <= 0:
        return []
    pointer = root / LATEST
    latest = pointer.read_text().strip() if pointer.is_file() else None
    removed = []
    for folder in committed_saves(root)[keep:]:
        name = folder.name
        if name == latest:
            continue
        gone = root / f".pruned-{name}"
        try:
            os.rename(folder, gone)
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)
        removed.append(folder)
    return removed


def committed_saves(root: str | Path) -> list[Path]:
    """The step folders of ``root`` that hold a manifest, the one committed last first (its
    ``committed_ns``: a run resumed into its own folder saves lower steps again).  Their files
    are not checked here (:func:`check_file`)."""
    saves = []
    for folder in Path(root).glob("step-*"):
        try:
            manifest = json.loads(folder.joinpath(MANIFEST).read_text())
            saves.append((int(manifest["committed_ns"]), folder.name, folder))
        except (OSError, ValueError, KeyError, TypeError):  # not a complete save of ours
            continue
    return [folder for *_, folder in sorted(saves, reverse=True)]


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a step folder; ``None`` for a folder that is not a pipeplan save (a
    ``transformers`` checkpoint); raises :class:`ModelLoadError` for an incomplete save."""
    path = folder / MANIFEST
    if not path.is_file():
        if any(folder.glob("train-*-of-*.pt")) or folder.name.startswith(".partial-"):
            raise ModelLoadError(
                f"checkpoint {folder} is incomplete: it has no {MANIFEST} (its save did not "
                f"finish); pass the save folder or its last complete step-* folder"
            )
        return None
    try:
        manifest = json.loads(path.read_text())
        manifest["files"], manifest["save_id"], manifest["step"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"checkpoint manifest {path} is not valid ({exc})") from None
    return manifest  # type: ignore[no-any-return]


def latest_step(root: str | Path) -> Path | None:
    """The step folder ``root/latest`` names, or ``None`` when ``root`` has no pointer."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    folder = root / name
    if not name.startswith("step-") or not folder.is_dir():
        raise ModelLoadError(
            f"checkpoint {root}: {LATEST} names {name!r}, which is not a step folder there"
        )
    return folder


def resolve(path: str | Path) -> tuple[Path, dict[str, Any] | None]:
    """The folder to read for ``path`` (a save root is read at ``latest``) and its manifest
    (``None`` for a plain file or a folder that is not a pipeplan save)."""
    p = Path(path)
    if not p.is_dir():
        return p, None
    folder = latest_step(p) or p
    return folder, read_manifest(folder)


def check_file(folder: Path, manifest: dict[str, Any], name: str, *, sha256: bool = True) -> Path:
    """The path of ``name`` in a step folder, after checking it against the manifest: listed,
    present, of the size written and (``sha256``) of the same SHA-256."""
    path = folder / name
    entry = manifest["files"].get(name)
    if entry is None:
        raise ModelLoadError(
            f"checkpoint {folder}: {name} is not in its {MANIFEST} (a file from another save?)"
        )
    if not path.is_file():
        raise ModelLoadError(f"checkpoint {folder} is incomplete: {name} is missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise ModelLoadError(
            f"checkpoint file {path} is truncated or overwritten: {size} bytes, the manifest "
            f"says {entry['bytes']}; resume from an earlier step-* folder"
        )
    if sha256 and _sha256(path) != entry["sha256"]:
        raise ModelLoadError(
            f"checkpoint file {path} is corrupted: its SHA-256 is not the one written; resume "
            f"from an earlier step-* folder"
        )
    return path
