"""pipeplan.split: a user's own loop on torch.distributed.pipelining's schedule gets the unsplit
model's loss and gradients, tied weights and replicas included; misuse is one clear error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _runtime_jobs import chunked, make_plan

import pipeplan
from pipeplan.intake.meta import materialize
from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.io import write_json

GPT = (
    "pipeplan.models.gpt:gpt",
    {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8},
)
LOOP = Path(__file__).with_name("_split_loop.py")


def _launch(tmp_path: Path, starts: list[int], replicas: int) -> tuple[list[dict], float, dict]:
    spec = load_model(*GPT)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(*GPT, traced, starts=starts, batch_size=4 * replicas, microbatches=2,
                     replicas=replicas)  # fmt: skip
    write_json(tmp_path / "plan.json", plan)
    torch.manual_seed(11)
    inputs, target = spec.batch(4 * replicas)  # the global batch
    torch.save((inputs, target), tmp_path / "batch.pt")
    world = len(starts) * replicas
    cmd = [sys.executable, "-m", "pipeplan.runtime.forkrun", "--standalone",
           f"--nproc-per-node={world}", str(LOOP), str(tmp_path / "plan.json"),
           str(tmp_path / "batch.pt"), str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    whole = load_model(*GPT, meta=True).module.double()  # initialised in the plan's dtype
    materialize(whole, [n for n, _ in whole.named_parameters()], torch.device("cpu"), seed=3)
    loss = spec.loss(whole(*inputs), target)
    loss.backward()
    grads = {n: p.grad for n, p in whole.named_parameters()}
    return ranks, loss.item(), grads


@pytest.mark.multirank
@pytest.mark.parametrize(("starts", "replicas"), [([0, 3], 1), ([0], 2)], ids=["p2d1", "p1d2"])
def test_a_users_loop_gets_the_unsplit_models_loss_and_gradients(
    tmp_path: Path, starts: list[int], replicas: int
) -> None:
    ranks, loss, grads = _launch(tmp_path, starts, replicas)
    seen: set[str] = set()
    for r in ranks:
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-9, atol=1e-12, msg=name)
            seen.add(name)
    assert seen == set(grads)  # every parameter lives on some stage
    losses = [x for r in ranks for x in r["losses"]]
    assert len(losses) == 2 * replicas
    if replicas == 1:
        assert sum(losses) / len(losses) == pytest.approx(loss, rel=1e-9)
    assert sorted(r["stage"] for r in ranks) == sorted(j for j in range(len(starts)) for _ in
                                                       range(replicas))  # fmt: skip


def test_split_without_a_process_group_names_the_fix(tmp_path: Path) -> None:
    spec = load_model(*GPT)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(*GPT, traced, starts=[0, 3], batch_size=4, microbatches=2)
    with pytest.raises(InvalidRequestError, match="init_process_group"):
        pipeplan.split(plan)


@pytest.mark.multirank
def test_the_own_loop_example_trains_a_gpipe_and_a_zbv_plan_alike(tmp_path: Path) -> None:
    """The example runs whatever family the plan names (split.schedule): a zbv plan (4 chunks
    on 2 ranks, the last on rank 0) gives the GPipe plan's first loss."""
    spec = load_model(*GPT)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(*GPT, traced, starts=[0, 2], batch_size=4, microbatches=2, dtype="float32")
    zbv = chunked(make_plan(*GPT, traced, starts=[0, 1, 2, 3], batch_size=4, microbatches=2,
                            dtype="float32"), "zbv", 2)  # fmt: skip
    example = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"
    losses = {}
    for name, p in (("gpipe", plan), ("zbv", zbv)):
        write_json(tmp_path / f"{name}.json", p)
        cmd = [sys.executable, "-m", "pipeplan.runtime.forkrun", "--standalone",
               "--nproc-per-node=2", str(example), str(tmp_path / f"{name}.json"), "2"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=240, env=env, check=False
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        last = 1 if name == "gpipe" else 0  # zbv's last chunk (2p - 1 = 3) is on rank 0
        lines = [x for x in proc.stdout.splitlines() if x.startswith(f"rank {last} step ")]
        assert len(lines) == 2, proc.stdout
        losses[name] = [float(x.split("loss ")[1]) for x in lines]
    assert losses["zbv"][0] == pytest.approx(losses["gpipe"][0], rel=1e-4)
    assert losses["zbv"][1] == pytest.approx(losses["gpipe"][1], rel=1e-3)
