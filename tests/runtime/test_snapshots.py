"""Step folders (``pipeplan.runtime.snapshots``) read through ``CheckpointReader``: the latest
complete save is read, and a torn, truncated, corrupted, mixed or incomplete one is refused
with the file named.  The saves are made with the same functions the ranks use, in one
process (the multi-rank protocol is tested in ``tests/runtime/test_saving.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeplan.planner.errors import ModelLoadError
from pipeplan.runtime.checkpoint import (
    INDEX,
    CheckpointReader,
    shard_name,
    write_index,
    write_shard,
)
from pipeplan.runtime.snapshots import commit, file_record, partial_dir, prune, step_name


def _save(root: Path, step: int, value: float, save_id: str, *, finish: bool = True) -> Path:
    """A two-stage save of step ``step`` whose tensors all hold ``value``."""
    tmp = partial_dir(root, step)
    tmp.mkdir(parents=True)
    shards = [{"a.weight": torch.full((64,), value)}, {"b.weight": torch.full((64,), -value)}]
    meta = {"save_id": save_id, "step": str(step)}
    for j, tensors in enumerate(shards):
        write_shard(tmp, j, 2, tensors, meta)
    write_index(tmp, [sorted(t) for t in shards], 512)
    torch.save({"step": step}, tmp / "train-00000-of-00002.pt")
    if not finish:
        return tmp
    names = [shard_name(0, 2), shard_name(1, 2), INDEX, "train-00000-of-00002.pt"]
    return commit(root, step, save_id, [file_record(tmp / n) for n in names], {"stages": 2})


def _read(path: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    return {k: reader.read(k) for k in sorted(reader.keys())}


def test_the_latest_complete_save_is_read_and_a_dead_save_changes_nothing(
    tmp_path: Path,
) -> None:
    _save(tmp_path, 2, 1.0, "aa")
    _save(tmp_path, 4, 2.0, "bb")
    assert (tmp_path / "latest").read_text().strip() == step_name(4)
    assert float(_read(tmp_path)["a.weight"][0]) == 2.0
    assert float(_read(tmp_path / step_name(2))["b.weight"][0]) == -1.0
    _save(tmp_path, 6, 3.0, "cc", finish=False)  # the run died before its commit
    assert float(_read(tmp_path)["a.weight"][0]) == 2.0
    manifest = json.loads((tmp_path / step_name(4) / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["save_id"] == "bb" and manifest["stages"] == 2


def test_a_save_of_the_same_step_replaces_the_old_one_whole(tmp_path: Path) -> None:
    _save(tmp_path, 2, 1.0, "aa")
    _save(tmp_path, 2, 5.0, "bb")
    assert float(_read(tmp_path)["b.weight"][0]) == -5.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", step_name(2)]


def test_prune_keeps_the_saves_made_last_and_latest_and_finishes_a_dead_prune(
    tmp_path: Path,
) -> None:
    """By commit order, not step number: a run resumed from step 2 into the same folder makes
    step 3 after step 6; latest's save is kept whatever K says."""
    for step, value in [(2, 1.0), (4, 2.0), (6, 3.0)]:
        _save(tmp_path, step, value, f"s{step}")
    assert prune(tmp_path, 0) == [] and len(list(tmp_path.glob("step-*"))) == 3  # 0: keep all
    _save(tmp_path, 3, 9.0, "s3")  # the resumed run's save: latest, and the newest
    (tmp_path / ".pruned-step-000001").mkdir()  # a prune a killed run left half done
    (tmp_path / ".pruned-step-000001" / "model.safetensors").write_bytes(b"x")
    _save(tmp_path, 8, 4.0, "s8", finish=False)  # a save under way is not a save: untouched
    removed = prune(tmp_path, 2)
    assert sorted(f.name for f in removed) == [step_name(2), step_name(4)]
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        ".partial-" + step_name(8), "latest", step_name(3), step_name(6)
    ]  # fmt: skip
    assert float(_read(tmp_path)["a.weight"][0]) == 9.0
    _save(tmp_path, 10, 5.0, "s10")
    (tmp_path / "latest").write_text(step_name(3) + "\n")  # latest's save is kept past K
    assert [f.name for f in prune(tmp_path, 1)] == [step_name(6)]
    assert sorted(f.name for f in tmp_path.glob("step-*")) == [step_name(3), step_name(10)]


def test_a_truncated_shard_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    folder = _save(tmp_path, 2, 1.0, "aa")
    shard = folder / shard_name(1, 2)
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(ModelLoadError, match=rf"{shard_name(1, 2)} is truncated .* bytes"):
        CheckpointReader(tmp_path)


def test_a_corrupted_shard_is_refused_when_read(tmp_path: Path) -> None:
    folder = _save(tmp_path, 2, 1.0, "aa")
    shard = folder / shard_name(0, 2)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the tensor's data: the header still parses
    shard.write_bytes(bytes(data))
    reader = CheckpointReader(tmp_path)
    assert float(reader.read("b.weight")[0]) == -1.0  # the other shard is whole
    with pytest.raises(ModelLoadError, match=rf"{shard_name(0, 2)} is corrupted"):
        reader.read("a.weight")


def test_a_shard_from_another_save_is_refused_as_a_mix(tmp_path: Path) -> None:
    old, new = _save(tmp_path, 2, 1.0, "aa"), _save(tmp_path, 4, 2.0, "bb")
    shutil.copy(old / shard_name(1, 2), new / shard_name(1, 2))  # same size, old contents
    reader = CheckpointReader(tmp_path)
    assert float(reader.read("a.weight")[0]) == 2.0
    with pytest.raises(ModelLoadError, match=r"belongs to save aa .* save bb: a mixed checkpoint"):
        reader.read("b.weight")


def test_an_incomplete_step_folder_and_a_dangling_pointer_are_refused(tmp_path: Path) -> None:
    tmp = _save(tmp_path, 2, 1.0, "aa", finish=False)
    with pytest.raises(ModelLoadError, match="is incomplete: it has no manifest.json"):
        CheckpointReader(tmp)
    renamed = tmp_path / step_name(2)
    tmp.rename(renamed)  # a folder renamed by hand, without its manifest
    with pytest.raises(ModelLoadError, match="is incomplete"):
        CheckpointReader(renamed)
    (tmp_path / "latest").write_text("step-000009\n")
    with pytest.raises(ModelLoadError, match="latest names 'step-000009'"):
        CheckpointReader(tmp_path)
