"""Resuming a saved run equals not stopping it, and a run killed between saves loses nothing.

On 2 ranks (4 for pp x dp), a model whose dropout draws from every rank's RNG each step, with
Adam: a run saving after step 2 and step 4 (the GPipe one saves after every step);
``--resume`` from the save of step 2 for 2 more steps must write a save of step 4
bit-identical to the first run's: weights, Adam's moments, step and RNG states (GPipe, 1F1B,
2 stages x 2 replicas, and 1 stage x 2 ranks sharded by FSDP2, whose losses are compared too).  Then rank 1 is SIGKILLed during a run saving every step, once inside
a save (after its files are written, before the commit) and once at a random step and moment
(a new one each time the suite runs, named in the failure): ``latest`` must name a complete
save equal to the uninterrupted run's at that step, and resuming from it must end equal to
the uninterrupted run's last save.  That run and its resumption keep only their last two
saves (``--keep 2``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _resume_jobs import (
    ENV,
    MODEL,
    beat,
    equal,
    run,
    state,
    survivors,
    wait_for,
    worker,
    write_plans,
)
from _runtime_jobs import make_plan
from safetensors import SafetensorError

from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.io import write_json
from pipeplan.runtime import saving
from pipeplan.runtime.snapshots import step_name

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_plans(tmp_path_factory.mktemp("resume"))


@pytest.fixture(scope="module")
def reference(plans: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted GPipe run of 8 steps saving after every one."""
    ref = tmp_path_factory.mktemp("reference")
    proc = run(worker(plans["gpipe"], 2, "--steps", "8", "--save-every", "1", "--save", str(ref)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ref


@pytest.mark.parametrize(("name", "world"), [("gpipe", 2), ("1f1b", 2), ("ppdp", 4)])
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(
    plans: dict[str, Path], reference: Path, tmp_path: Path, name: str, world: int
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    if name == "gpipe":  # the reference is that run
        a = reference
    else:
        cmd = worker(plans[name], world, "--steps", "4", "--save-every", "2", "--save", str(a))
        proc = run(cmd)
        assert proc.returncode == 0, proc.stderr[-3000:]
    whole = _resumed_equals_whole(plans[name], world, a, b)
    assert sum(k.startswith("train-") for k in whole) == world  # every rank's state


def _resumed_equals_whole(plan: Path, world: int, a: Path, b: Path, *args: str) -> dict[str, Any]:
    """Resume the run saved in ``a`` from its step 2 for 2 steps into ``b`` (``args`` to the
    worker); check that it ends bit-identical to ``a``'s step 4 (and that the comparison can
    fail); ``a``'s step 4."""
    resume = worker(plan, world, "--steps", "2", "--resume", str(a / step_name(2)),
                    "--save", str(b), *args)  # fmt: skip
    proc = run(resume)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (b / "latest").read_text().strip() == step_name(4)
    whole, resumed = state(a / step_name(4)), state(b)
    assert equal(whole, resumed)
    assert not equal(state(a / step_name(2)), whole)
    return whole


def test_a_zbv_run_reads_a_gpipe_save_saves_each_weight_once_and_resumes_bit_identical(
    plans: dict[str, Path], reference: Path, tmp_path: Path
) -> None:
    """ZB-V (2 ranks x 2 chunks, rank 0 holding layers 0 and 3) starts from the GPipe run's
    weights, writes shards of the unsplit model's names that a GPipe plan reads, and resumes."""
    a, b, run_dir = tmp_path / "a", tmp_path / "b", tmp_path / "run"
    run_dir.mkdir()
    cmd = worker(plans["zbv"], 2, "--steps", "4", "--save-every", "2", "--save", str(a),
                 "--weights", str(reference / step_name(2)), "--run-dir", str(run_dir))  # fmt: skip
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = [json.loads((run_dir / f"weights-{r}.json").read_text()) for r in range(2)]
    assert {k.split(".")[1] for k in read[0]} == {"0", "3"}  # its chunks' tensors only
    assert {k.split(".")[1] for k in read[1]} == {"1", "2"}
    whole = _resumed_equals_whole(plans["zbv"], 2, a, b)
    gpipe = state(reference / step_name(2))
    weights = {k: v.shape for k, v in whole.items() if not k.startswith("train-")}
    assert weights == {k: v.shape for k, v in gpipe.items() if not k.startswith("train-")}


def test_a_sharded_run_saves_whole_weights_and_rank_shards_and_resumes_bit_identical(
    plans: dict[str, Path], tmp_path: Path
) -> None:
    """1 stage x 2 ranks sharded by FSDP2 (issue 42): the weights shard holds the unsplit
    model's full tensors (its ``state_dict``'s names and shapes), each rank's training state its
    own rows of Adam's moments, the manifest both ranks' files; resuming from step 2 ends
    with the uninterrupted run's losses and step-4 save, bit for bit."""
    a, b = tmp_path / "a", tmp_path / "b"
    cmd = worker(plans["shard"], 2, "--steps", "4", "--save-every", "2", "--save", str(a),
                 "--report", str(tmp_path / "a.json"))  # fmt: skip
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = _resumed_equals_whole(plans["shard"], 2, a, b, "--report", str(tmp_path / "b.json"))
    losses = [json.loads((tmp_path / f"{r}.json").read_text())["losses"] for r in "ab"]
    assert len(losses[0]) == 4 and losses[0][2:] == losses[1]
    weights = {k: v.shape for k, v in whole.items() if not k.startswith("train-")}
    assert weights == {k: v.shape for k, v in load_model(*MODEL).module.state_dict().items()}
    moments = [whole[f"train-0000{r}-of-00002.pt"][2][0]["exp_avg"] for r in range(2)]
    assert moments[0].shape == (8, 16)  # layers.0.weight's rows of rank 0 and rank 1
    assert torch.cat(moments).shape == whole["layers.0.weight"].shape
    assert not torch.equal(*moments)


@pytest.mark.parametrize("trial", ["inside-a-save", "random"])
def test_a_rank_killed_between_saves_resumes_from_the_last_complete_one(
    plans: dict[str, Path], reference: Path, tmp_path: Path, trial: str
) -> None:
    save, run_dir = tmp_path / "save", tmp_path / "run"
    run_dir.mkdir()
    cmd = worker(plans["gpipe"], 2, "--steps", "8", "--save-every", "1", "--save", str(save),
                 "--keep", "2", "--run-dir", str(run_dir))  # fmt: skip
    env = {**ENV, "PIPEPLAN_FAIL": "1:5:kill-save"} if trial == "inside-a-save" else ENV
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True
    )
    where = "in the save of step 5"
    if trial == "random":  # SIGKILL rank 1 at a random point: a random step, a random moment
        rng = random.Random()
        step, delay = rng.randint(1, 4), rng.uniform(0.0, 0.03)
        where = f"{delay * 1e3:.0f} ms after the save of step {step}"
        wait_for(lambda: (save / step_name(step)).exists() or proc.poll() is not None, poll=0.002)
        target = beat(run_dir, 1)
        assert target is not None
        time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):  # then the run ended first: fails below
            os.kill(target[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, f"the run ended before the kill ({where})"
    last = int((save / "latest").read_text().strip().removeprefix("step-"))
    if trial == "inside-a-save":
        assert last == 4 and not (save / step_name(5)).exists()
    assert 1 <= last < 8, f"{where}: {err[-2000:]}"
    # --keep 2: the two saves made last (a third while the kill interrupted the prune)
    kept = {f.name for f in save.glob("step-*")}
    assert step_name(last) in kept and kept <= {step_name(s) for s in (last - 2, last - 1, last)}
    assert equal(state(save), state(reference / step_name(last))), f"step {last} mixed ({where})"
    resume = worker(plans["gpipe"], 2, "--steps", str(8 - last), "--resume", str(save),
                    "--save", str(save), "--save-every", "1", "--keep", "2")  # fmt: skip
    done = run(resume)
    assert done.returncode == 0, done.stderr[-3000:]
    assert equal(state(save), state(reference / step_name(8))), f"resumed from {last} ({where})"
    assert sorted(f.name for f in save.glob("step-*")) == [step_name(7), step_name(8)]
    assert not survivors(str(tmp_path))


def test_a_full_disk_is_named_whichever_library_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    assert saving._why(full, tmp_path) == "No space left on device"
    said = SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )
    assert saving._why(said, tmp_path) == "No space left on device"
    silent = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    monkeypatch.setattr(saving, "FULL_DISK_BYTES", 0)  # a disk with room: the library's words
    assert saving._why(silent, tmp_path) == (
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
    )
    monkeypatch.setattr(saving, "FULL_DISK_BYTES", 1 << 62)  # a disk with no room left
    assert saving._why(silent, tmp_path) == "No space left on device"


def test_a_tensor_parallel_run_saves_whole_weights_and_resumes_bit_identical(
    tmp_path: Path,
) -> None:
    """pp 2 x tp 2 (the bundled GPT, its MLPs split over 2 ranks, its norms over the sequence's
    halves: sequence parallelism's collectives hold no state; issue 44): the weights shard
    holds the unsplit model's full tensors, each rank's training state its own half of Adam's
    moments of a split weight; resuming from step 2 ends with the uninterrupted run's step-4
    save, bit for bit."""
    gpt = ("pipeplan.models.gpt:gpt",
           {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8})  # fmt: skip
    spec = load_model(*gpt)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(*gpt, traced, starts=[0, 3], batch_size=8, microbatches=2,
                     dtype="float32", optimizer="adam")  # fmt: skip
    path = tmp_path / "tp.json"
    write_json(path, plan.model_copy(update={
        "cluster": plan.cluster.model_copy(update={"tensor_parallel": 2,
                                                   "sequence_parallel": True})}))  # fmt: skip
    a, b = tmp_path / "a", tmp_path / "b"
    proc = run(worker(path, 4, "--steps", "4", "--save-every", "2", "--save", str(a)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = _resumed_equals_whole(path, 4, a, b)
    weights = {k: v.shape for k, v in whole.items() if not k.startswith("train-")}
    assert weights == {k: v.shape for k, v in spec.module.named_parameters()}  # tied: once
    names = [whole[f"train-0000{r}-of-00004.pt"][1] for r in range(4)]
    assert names[0] == names[1] and names[2] == names[3]  # tp ranks: the same parameters
    fc = names[0].index("blocks.0.fc.weight")
    halves = [whole[f"train-0000{r}-of-00004.pt"][2][fc]["exp_avg"] for r in range(2)]
    assert halves[0].shape == (32, 16)  # rows 0..31 and 32..63 of the 64 x 16 weight
    assert not torch.equal(*halves)
