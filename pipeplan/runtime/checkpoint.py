"""Checkpoints a stage reads its weights from and writes them to, one stage's tensors at a time.

Reading (:class:`CheckpointReader`) takes

- a ``.safetensors`` file, read lazily (``safe_open``: only the tensors asked for are read);
- a ``torch.save`` state dict (``.pt``, ``.bin``, ``.pth``), memory-mapped
  (``torch.load(mmap=True, weights_only=True)``), so pages are read only when touched;
- a folder: a sharded ``transformers`` checkpoint with its index
  (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``: tensor -> shard file,
  and only the shards holding wanted tensors are opened), or a single ``model.safetensors``.

Keys are the user's model's ``state_dict`` names (a ``transformers`` model's own, without
pipeplan's ``NamedInputs`` wrapper).  A tied parameter needs one of its names.
:attr:`CheckpointReader.read_keys` records what was read, so a test can check that a rank read
only its stage.

Writing (:func:`write_shard`, :func:`write_index`) produces the same sharded layout that
``transformers`` writes: every stage its own ``model-0000k-of-0000p.safetensors`` and one
``model.safetensors.index.json``; each file is written atomically (a temporary file renamed).
A training run writes them into step folders made visible whole (:mod:`pipeplan.runtime.snapshots`):
given such a save's root, the reader reads the step ``latest`` names, checks every file's size
against the manifest at once and each shard's SHA-256 and save id when it opens it, so a torn,
truncated, corrupted or mixed save is refused with the file named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeplan.planner.errors import ModelLoadError
from pipeplan.runtime.snapshots import check_file, resolve

__all__ = [
    "INDEX",
    "CheckpointReader",
    "load_checkpoint",
    "match",
    "shard_name",
    "write_index",
    "write_shard",
]

INDEX = "model.safetensors.index.json"
_TORCH_INDEX = "pytorch_model.bin.index.json"

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointReader:
    """Lazy access to the tensors of a checkpoint file or folder (module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.read_keys: list[str] = []
        self._files: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        if not self.path.exists():
            raise ModelLoadError(f"checkpoint {self.path} does not exist; pass a .safetensors "
                                 f"file, a torch state-dict file or a sharded checkpoint folder")  # fmt: skip
        p, self.manifest = resolve(self.path)
        """The save's manifest (:mod:`pipeplan.runtime.snapshots`), ``None`` for other checkpoints."""
        self.folder = p
        if self.manifest is not None:
            for name in self.manifest["files"]:  # every file there and whole, before any read
                check_file(p, self.manifest, name, sha256=False)
        if p.is_dir():
            index = next((p / n for n in (INDEX, _TORCH_INDEX) if (p / n).is_file()), None)
            if index is not None:
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ModelLoadError(f"checkpoint index {index} is not valid ({exc})") from None
                self._where = {str(k): p / str(v) for k, v in weight_map.items()}
            elif (p / "model.safetensors").is_file():
                self._index_file(p / "model.safetensors")
            else:
                raise ModelLoadError(
                    f"checkpoint folder {p} has no {INDEX}, {_TORCH_INDEX} or model.safetensors"
                )
        else:
            self._index_file(p)

    def _index_file(self, file: Path) -> None:
        for key in self._open(file).keys():  # noqa: SIM118 - safe_open has no __iter__
            self._where[str(key)] = file

    def _open(self, file: Path) -> Any:
        if file not in self._files:
            if not file.is_file():
                raise ModelLoadError(f"checkpoint shard {file} does not exist")
            try:
                if self.manifest is not None:
                    check_file(self.folder, self.manifest, file.name, sha256=False)
                if file.suffix == ".safetensors":
                    from safetensors import safe_open

                    handle = safe_open(str(file), framework="pt", device="cpu")
                    self._check_save_id(file, handle)  # a mix is named as one
                    self._files[file] = handle
                else:
                    self._files[file] = _TorchFile(file)
            except ModelLoadError:
                raise
            except Exception as exc:  # noqa: BLE001 - any unreadable file is reported
                raise ModelLoadError(f"cannot read checkpoint {file}: {exc}") from None
            if self.manifest is not None:  # the bytes are the ones written
                check_file(self.folder, self.manifest, file.name)
        return self._files[file]

    def _check_save_id(self, file: Path, handle: Any) -> None:
        """Refuse a shard written by another save than the manifest's (a mixed checkpoint)."""
        if self.manifest is None:
            return
        found = (handle.metadata() or {}).get("save_id")
        if found != self.manifest["save_id"]:
            raise ModelLoadError(
                f"checkpoint shard {file} belongs to save {found} but {self.folder}'s manifest "
                f"is save {self.manifest['save_id']}: a mixed checkpoint; resume from an "
                f"earlier step-* folder"
            )

    def keys(self) -> set[str]:
        return set(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of ``key`` without reading it."""
        f = self._open(self._where[key])
        if isinstance(f, _TorchFile):
            t = f.get_tensor(key)
            return tuple(t.shape), t.dtype
        sl = f.get_slice(key)
        return tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.uint8)

    def read(self, key: str) -> Tensor:
        """The tensor ``key`` (recorded in :attr:`read_keys`)."""
        self.read_keys.append(key)
        return self._open(self._where[key]).get_tensor(key)  # type: ignore[no-any-return]


class _TorchFile:
    """A ``torch.save`` state dict, memory-mapped where the file format allows it."""

    def __init__(self, file: Path) -> None:
        try:
            obj = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # a legacy (non-zip) file cannot be mapped
            obj = torch.load(file, map_location="cpu", weights_only=True)
        if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
            obj = obj["state_dict"]
        if not isinstance(obj, Mapping) or not all(isinstance(v, Tensor) for v in obj.values()):
            raise ModelLoadError(f"checkpoint {file} is not a state dict of tensors")
        self._tensors: Mapping[str, Tensor] = obj

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_tensor(self, key: str) -> Tensor:
        return self._tensors[key]


def match(reader: CheckpointReader, keys: Sequence[str], t: Tensor) -> str:
    """The first of ``keys`` (a tensor's aliases) that the checkpoint holds, with ``t``'s shape
    and dtype, read from the checkpoint's header alone.

    Raises :class:`~pipeplan.planner.errors.ModelLoadError` naming the tensor the checkpoint
    lacks or holds with another shape or dtype, and the fix.
    """
    key = next((k for k in keys if k in reader), None)
    if key is None:
        raise ModelLoadError(
            f"checkpoint {reader.path} lacks tensor {keys[0]!r} (shape {tuple(t.shape)}, "
            f"{str(t.dtype).removeprefix('torch.')}); pass the checkpoint of this model"
        )
    shape, dtype = reader.info(key)
    if shape != tuple(t.shape):
        raise ModelLoadError(
            f"checkpoint {reader.path}: tensor {key!r} has shape {shape} but the model's "
            f"has {tuple(t.shape)}; pass the checkpoint of this model and configuration"
        )
    if dtype != t.dtype:
        have, want = (str(d).removeprefix("torch.") for d in (dtype, t.dtype))
        raise ModelLoadError(
            f"checkpoint {reader.path}: tensor {key!r} is {have} but the plan runs {want}; "
            f"convert the checkpoint, or profile and plan with --dtype {have}"
        )
    return key


def load_checkpoint(
    reader: CheckpointReader,
    targets: Mapping[str, list[str]],
    tensors: Mapping[str, Tensor],
) -> None:
    """Copy into each of ``tensors`` (by the model's name) the checkpoint tensor under the
    first of its keys ``targets[name]`` (its aliases) that the checkpoint holds (:func:`match`,
    which raises for a tensor it lacks or holds with another shape or dtype)."""
    for name, t in tensors.items():
        key = match(reader, targets[name], t)
        with torch.no_grad():
            t.copy_(reader.read(key))


def shard_name(stage: int, stages: int) -> str:
    """``model-00001-of-00004.safetensors`` for stage 0 of 4."""
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def write_shard(
    directory: str | Path,
    stage: int,
    stages: int,
    tensors: Mapping[str, Tensor],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write one stage's tensors as its shard of a sharded checkpoint (``metadata`` in its
    safetensors header); returns the bytes."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    data = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    _atomic(d / shard_name(stage, stages), lambda p: save_file(data, str(p), metadata=metadata))
    return sum(v.numel() * v.element_size() for v in data.values())


def write_index(directory: str | Path, shards: list[list[str]], total_bytes: int) -> None:
    """Write ``model.safetensors.index.json``: every key -> the shard of the stage holding it."""
    weight_map = {k: shard_name(j, len(shards)) for j, keys in enumerate(shards) for k in keys}
    text = json.dumps(
        {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2,
    )
    _atomic(Path(directory) / INDEX, lambda p: p.write_text(text + "\n"))
