"""pipeplan.runtime.checkpoint: every format reads lazily and by key; a checkpoint that lacks a tensor,
or holds one of another shape or dtype, is named in one line; shards written per stage load
back into the unsplit model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeplan.planner.errors import ModelLoadError
from pipeplan.runtime.checkpoint import (
    INDEX,
    CheckpointReader,
    load_checkpoint,
    shard_name,
    write_index,
    write_shard,
)

STATE = {
    "a.weight": torch.arange(6.0).reshape(2, 3),
    "a.bias": torch.ones(2),
    "b.weight": torch.full((3, 3), 2.0),
}


def _formats(tmp_path: Path) -> dict[str, Path]:
    single = tmp_path / "single.safetensors"
    save_file(STATE, str(single))
    torch_file = tmp_path / "state.pt"
    torch.save({"state_dict": STATE}, torch_file)
    sharded = tmp_path / "sharded"
    write_shard(sharded, 0, 2, {k: v for k, v in STATE.items() if k.startswith("a.")})
    write_shard(sharded, 1, 2, {"b.weight": STATE["b.weight"]})
    write_index(sharded, [["a.bias", "a.weight"], ["b.weight"]], 0)
    folder = tmp_path / "folder"
    folder.mkdir()
    save_file(STATE, str(folder / "model.safetensors"))
    return {"safetensors": single, "torch": torch_file, "sharded": sharded, "folder": folder}


@pytest.mark.parametrize("kind", ["safetensors", "torch", "sharded", "folder"])
def test_every_format_reads_only_what_is_asked(tmp_path: Path, kind: str) -> None:
    reader = CheckpointReader(_formats(tmp_path)[kind])
    assert reader.keys() == set(STATE)
    assert reader.info("a.weight") == ((2, 3), torch.float32)
    assert torch.equal(reader.read("b.weight"), STATE["b.weight"])
    assert reader.read_keys == ["b.weight"]


def test_a_sharded_folder_opens_only_the_shards_it_needs(tmp_path: Path) -> None:
    sharded = _formats(tmp_path)["sharded"]
    (sharded / shard_name(1, 2)).unlink()  # the second stage's shard is never needed
    reader = CheckpointReader(sharded)
    target = {"a.weight": torch.zeros(2, 3)}
    load_checkpoint(reader, {"a.weight": ["a.weight"]}, target)
    assert torch.equal(target["a.weight"], STATE["a.weight"])
    assert json.loads((sharded / INDEX).read_text())["weight_map"]["b.weight"] == shard_name(1, 2)
    with pytest.raises(ModelLoadError, match="shard .* does not exist"):
        reader.read("b.weight")


def test_a_tied_tensor_needs_one_of_its_names(tmp_path: Path) -> None:
    reader = CheckpointReader(_formats(tmp_path)["safetensors"])
    target = {"head.weight": torch.zeros(3, 3)}
    load_checkpoint(reader, {"head.weight": ["head.weight", "b.weight"]}, target)
    assert torch.equal(target["head.weight"], STATE["b.weight"])


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ({"c.weight": torch.zeros(1)}, r"lacks tensor 'c.weight' \(shape \(1,\), float32\)"),
        ({"a.weight": torch.zeros(3, 2)}, r"'a.weight' has shape \(2, 3\) but the model's has"),
        ({"a.bias": torch.zeros(2, dtype=torch.float64)}, r"'a.bias' is float32 but the plan"),
    ],
    ids=["missing", "shape", "dtype"],
)
def test_a_mismatched_checkpoint_is_named(
    tmp_path: Path, target: dict[str, torch.Tensor], match: str
) -> None:
    reader = CheckpointReader(_formats(tmp_path)["safetensors"])
    with pytest.raises(ModelLoadError, match=match):
        load_checkpoint(reader, {k: [k] for k in target}, target)


def test_bad_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        CheckpointReader(tmp_path / "nothing.safetensors")
    with pytest.raises(ModelLoadError, match=r"has no model.safetensors.index.json"):
        CheckpointReader(tmp_path)
    (tmp_path / "x.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="cannot read checkpoint"):
        CheckpointReader(tmp_path / "x.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ModelLoadError, match="not a state dict of tensors"):
        CheckpointReader(tmp_path / "list.pt")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / INDEX).write_text("{}")
    with pytest.raises(ModelLoadError, match="index .* is not valid"):
        CheckpointReader(tmp_path / "bad")
