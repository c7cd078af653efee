"""Helpers for the resume and fault tests: tiny plans, a torchrun job of the worker, what a
save holds, and the processes a job left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _runtime_jobs import chunked, make_plan

from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.io import write_json
from pipeplan.runtime.checkpoint import CheckpointReader
from pipeplan.runtime.supervise import live_processes

MODEL = ("_weights_models:dropped", {})
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
PIPEPLAN = [sys.executable, "-c", "from pipeplan.cli import main; main()"]


def write_plans(directory: Path) -> dict[str, Path]:
    """GPipe and 1F1B on 2 stages, GPipe on 2 stages x 2 replicas, GPipe on 1 stage x 2 ranks
    sharded by FSDP2, and ZB-V on 2 ranks x 2 chunks (one layer each, rank 0 holding the first
    and the last); Adam."""
    spec = load_model(*MODEL)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plans = {}
    for name, schedule, replicas in (("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1),
                                     ("ppdp", "gpipe", 2)):  # fmt: skip
        plans[name] = directory / f"{name}.json"
        plan = make_plan(*MODEL, traced, starts=[0, 2], batch_size=8, microbatches=2,
                         dtype="float32", optimizer="adam", schedule=schedule, replicas=replicas)  # fmt: skip
        write_json(plans[name], plan)
    plans["shard"] = directory / "shard.json"
    plan = make_plan(*MODEL, traced, starts=[0], batch_size=8, microbatches=2, dtype="float32",
                     optimizer="adam", replicas=2)  # fmt: skip
    cluster = plan.cluster.model_copy(update={"data_parallel_mode": "shard"})
    write_json(plans["shard"], plan.model_copy(update={"cluster": cluster}))
    plans["zbv"] = directory / "zbv.json"
    write_json(plans["zbv"], chunked(make_plan(*MODEL, traced, starts=[0, 1, 2, 3], batch_size=8,
               microbatches=2, dtype="float32", optimizer="adam"), "zbv", 2))  # fmt: skip
    return plans


def worker(plan: Path, world: int, *args: str) -> list[str]:
    """The torchrun command of the worker (no ``pipeplan run`` preflight: a launch costs less)."""
    return [sys.executable, "-m", "pipeplan.runtime.forkrun", "--standalone", "--nproc-per-node",
            str(world), "-m", "pipeplan.runtime.worker", str(plan), "--quiet", "--optimizer",
            "adam", "--warmup", "0", *args]  # fmt: skip


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180,
                          env={**ENV, **(env or {})})  # fmt: skip


def state(folder: Path) -> dict[str, Any]:
    """Everything a save holds, read through the checks of ``CheckpointReader``."""
    reader = CheckpointReader(folder)
    assert reader.manifest is not None
    out: dict[str, Any] = {k: reader.read(k) for k in sorted(reader.keys())}
    for name in sorted(reader.manifest["files"]):
        if name.startswith("train-"):
            s = torch.load(reader.folder / name, weights_only=True)
            out[name] = (s["step"], s["params"], s["optimizer"]["state"], s["rng"]["cpu"])
    return out


def equal(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of nested tensors, lists, tuples and dicts."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def beat(root: Path, rank: int) -> tuple[int, int | None] | None:
    """(pid, step) of ``rank`` from its heartbeat in ``root`` or any ``pipeplan-run-*`` in it."""
    for path in [root / f"beat-{rank}", *root.glob(f"pipeplan-run-*/beat-{rank}")]:
        try:
            pid, step, _ = json.loads(path.read_text())
            return int(pid), step
        except (OSError, ValueError):
            continue
    return None


def wait_for(predicate: Any, timeout: float = 120.0, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the job")
        time.sleep(poll)


def survivors(marker: str) -> list[str]:
    """Live processes whose command line contains ``marker`` (a test's own tmp path)."""
    return [f"{pid}: {cmd[:200]}" for pid, cmd in live_processes(marker).items()]
