"""The zoo: architectures this project did not write, brought as their users would.

For every case (``_zoo_cases``): profile with the default options, plan 2 and 4 stages with the
DP, then run the 2-stage plan for 2 steps on 2 ranks (one torchrun launch for all cases,
float64, gloo) and check the loss and every gradient against the unsplit model on the full
batch.  This is the suite's "bring any model" acceptance test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _zoo_cases import BATCH, CASES, MICROBATCHES, STEPS

pytest.importorskip("transformers")

from planner.io import write_json
from planner.model import load_model
from planner.types import Cluster, PlanOptions, Profile
from profiler import profile_model
from solvers import SOLVERS

TIGHT = {"rtol": 1e-9, "atol": 1e-11}


def _plan(profile: Profile, stages: int, m: int | None) -> Any:
    cluster = Cluster.homogeneous(stages, 1 << 30)
    return SOLVERS["dp"](profile, cluster, PlanOptions(microbatches=m, optimizer="sgd"))


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Profile and plan every case, then run all 2-stage plans in one 2-rank launch."""
    out = tmp_path_factory.mktemp("zoo")
    profiles, plans, cases = {}, {}, {}
    for name, (model, kwargs) in CASES.items():
        profiles[name] = profile_model(
            model, batch_size=BATCH, model_kwargs=kwargs, warmup=1, repeats=1, progress=False
        )
        plans[name] = {p: _plan(profiles[name], p, None) for p in (2, 4)}
        fixed = _plan(profiles[name], 2, MICROBATCHES)
        path = out / f"{name}.plan.json"
        write_json(path, fixed)
        cases[name] = {"model": model, "kwargs": kwargs, "plan": str(path)}
    job_file = out / "job.json"
    job_file.write_text(json.dumps({"cases": cases, "steps": STEPS, "out": str(out)}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(Path(__file__).with_name("_zoo_job.py")), str(job_file)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=env)
    ranks = [torch.load(out / f"rank{r}.pt") if (out / f"rank{r}.pt").exists() else {}
             for r in range(2)]  # fmt: skip
    return {"profiles": profiles, "plans": plans, "ranks": ranks, "stderr": proc.stderr}


def _reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, kwargs = CASES[name]
    spec = load_model(model, kwargs)
    module = spec.module.double()
    inputs, target = spec.batch(BATCH)
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    named = dict(module.named_parameters())
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = spec.loss(module(*inputs), target)
        loss.backward()
        losses.append(float(loss))
        if step == 0:
            grads = {k: p.grad.clone() for k, p in named.items() if p.grad is not None}
        opt.step()
    return losses, grads


@pytest.mark.parametrize("name", list(CASES))
def test_profiles_and_plans_with_defaults(zoo: dict[str, Any], name: str) -> None:
    profile = zoo["profiles"][name]
    assert profile.n_units >= 4, [u.name for u in profile.units]
    for p in (2, 4):
        plan = zoo["plans"][name][p]
        assert plan.n_stages == p and plan.feasible, (p, plan.status)


@pytest.mark.parametrize("name", list(CASES))
def test_two_rank_run_equals_unsplit_model(zoo: dict[str, Any], name: str) -> None:
    ranks = [r.get(name) for r in zoo["ranks"]]
    errors = [r["error"] for r in ranks if r and "error" in r]
    assert not errors, errors
    assert all(ranks), f"{name} did not run:\n{zoo['stderr'][-3000:]}"
    ref_losses, ref_grads = _reference(name)
    assert ranks[-1]["losses"] == pytest.approx(ref_losses, rel=1e-9)
    seen: set[str] = set()
    for r, rank in enumerate(ranks):
        for pname, grad in rank["grads"].items():
            torch.testing.assert_close(
                grad, ref_grads[pname], **TIGHT, msg=lambda m, r=r, p=pname: f"rank {r} {p}: {m}"
            )
        seen |= set(rank["grads"])
    assert seen == set(ref_grads), sorted(set(ref_grads) ^ seen)
