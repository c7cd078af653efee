"""The zoo: architectures this project did not write, from profile to a 2-rank run.

    PYTHONPATH=. .venv/bin/python -m benchmarks.zoo.main [--only NAME ...]

For every case in :mod:`benchmarks.zoo.cases`: profile with the default options (except float64,
so that gradients can be compared tightly, and one warm-up and one repeat: the table is about
behaviour, not speed), plan 2 and 4 stages with the
DP (1 GiB per device, SGD), then run every case's 2-stage plan at m = 2 for 2 steps on 2 ranks
(one torchrun launch, float64 except :data:`~benchmarks.zoo.cases.FLOAT32`, gloo, :mod:`benchmarks.zoo.job`) and compare the loss and every
gradient with the unsplit model on the full batch.  Prints this folder's README table and writes
``results.json``.  ``tests/zoo/test_zoo.py`` runs the same pipeline and asserts on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.zoo.cases import BATCH, CASES, FLOAT32, MICROBATCHES, STEPS, TOLERANCE
from pipeplan.intake.model import load_model
from pipeplan.planner.io import write_json
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile

__all__ = ["ZooRun", "compare", "dtype_of", "launch", "reference", "run_zoo", "sgd_steps"]

HERE = Path(__file__).resolve().parent


@dataclass
class ZooRun:
    """Everything the zoo produced: per case its profile, its plans and each rank's results."""

    profiles: dict[str, Profile] = field(default_factory=dict)
    plans: dict[str, dict[int, Plan]] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    stderr: str = ""


def dtype_of(name: str) -> str:
    """float64 unless the case cannot run in it (:data:`benchmarks.zoo.cases.FLOAT32`)."""
    return "float32" if name in FLOAT32 else "float64"


def _plan(profile: Profile, stages: int, m: int | None, memory: int = 1 << 30) -> Plan:
    from pipeplan.solvers import SOLVERS

    cluster = Cluster.homogeneous(stages, memory)
    return SOLVERS["dp"](profile, cluster, PlanOptions(microbatches=m, optimizer="sgd"))


def run_zoo(out: Path, names: list[str] | None = None) -> ZooRun:
    """Profile and plan every case, then run all 2-stage plans in one 2-rank launch."""
    from pipeplan.profiler import profile_model

    run = ZooRun()
    cases = {}
    for name in names or list(CASES):
        model, kwargs = CASES[name]
        profile = profile_model(
            model,
            batch_size=BATCH,
            model_kwargs=kwargs,
            dtype=dtype_of(name),
            warmup=1,
            repeats=1,
            progress=False,
        )
        run.profiles[name] = profile
        run.plans[name] = {p: _plan(profile, p, None) for p in (2, 4)}
        path = out / f"{name}.plan.json"
        write_json(path, _plan(profile, 2, MICROBATCHES))
        cases[name] = {"model": model, "kwargs": kwargs, "plan": str(path)}
    launch(out, cases, STEPS, run, timeout=900)
    return run


def launch(out: Path, cases: dict[str, Any], steps: int, run: ZooRun, timeout: int) -> None:
    """Run ``cases`` (:mod:`benchmarks.zoo.job`'s job file) in one 2-rank launch
    (:mod:`pipeplan.runtime.forkrun`);
    each rank's results and the launch's stderr go into ``run``."""
    job_file = out / "job.json"
    job_file.write_text(json.dumps({"cases": cases, "steps": steps, "out": str(out)}))
    # torchrun's agent, its ranks forked once it has imported torch and transformers
    cmd = [sys.executable, "-m", "pipeplan.runtime.forkrun", "--preload", "transformers",
           "--standalone", "--nproc-per-node", "2", "-m", "benchmarks.zoo.job", str(job_file)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                          env=env)  # fmt: skip
    run.stderr = proc.stderr
    run.ranks = [
        torch.load(out / f"rank{r}.pt") if (out / f"rank{r}.pt").exists() else {} for r in (0, 1)
    ]


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model in the case's dtype on the full batch: each step's loss, step 1's gradients."""
    model, kwargs = CASES[name]
    spec = load_model(model, kwargs)
    dtype = getattr(torch, dtype_of(name))
    module = spec.module.to(dtype)
    inputs, target = spec.batch(BATCH)
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    return sgd_steps(module, lambda: spec.loss(module(*inputs), target), STEPS)


def sgd_steps(
    module: torch.nn.Module, step_loss: Callable[[], torch.Tensor], steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` SGD steps (lr 0.1) of ``module`` on ``step_loss()``: each step's loss and the
    first step's gradients, by parameter name."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    named = dict(module.named_parameters())
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = step_loss()
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {k: p.grad.clone() for k, p in named.items() if p.grad is not None}
        opt.step()
    return losses, grads


def compare(
    name: str,
    run: ZooRun,
    reference_fn: Callable[[str], tuple[list[float], dict[str, torch.Tensor]]] | None = None,
) -> dict[str, Any]:
    """The case's pipelined losses and gradients against ``reference_fn``
    (default :func:`reference`).

    Returns ``error`` (a rank's failure, or None), ``loss_rel`` (largest relative loss error),
    ``grad_rel`` (largest gradient error, max |got - ref| over a parameter, divided by the
    larger of that parameter's max |ref| and 1e-3 of the largest |ref| of any parameter: a
    gradient that is zero in exact arithmetic, like an attention key bias's, is compared on the
    model's scale, not on its rounding noise) and ``missing`` (parameters with a reference
    gradient that no rank produced, or the reverse).
    """
    ranks = [r.get(name) for r in run.ranks]
    errors = [r["error"] for r in ranks if r and "error" in r]
    if errors or not all(ranks):
        return {"error": errors[0] if errors else "did not run", "loss_rel": None,
                "grad_rel": None, "missing": []}  # fmt: skip
    ref_losses, ref_grads = (reference_fn or reference)(name)
    # the rank that holds the last chunk computes the loss: the last rank, or rank 0 in a V
    got = next(r["losses"] for r in ranks if r and None not in r["losses"])
    loss_rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, ref_losses))
    grad_rel, seen = 0.0, set()
    floor = 1e-3 * max((float(g.abs().max()) for g in ref_grads.values()), default=1.0)
    for rank in ranks:
        for pname, grad in rank["grads"].items():  # type: ignore[index]
            ref = ref_grads.get(pname)
            if ref is None or ref.shape != grad.shape:
                continue
            scale = max(float(ref.abs().max()), floor) or 1.0
            grad_rel = max(grad_rel, float((grad - ref).abs().max()) / scale)
            seen.add(pname)
    return {"error": None, "loss_rel": loss_rel, "grad_rel": grad_rel,
            "missing": sorted(set(ref_grads) ^ seen)}  # fmt: skip


def _row(name: str, run: ZooRun, result: dict[str, Any]) -> str:
    model, _ = CASES[name]
    profile = run.profiles[name]
    module = load_model(*CASES[name]).module
    arch = type(getattr(module, "model", module)).__name__
    tol = TOLERANCE.get(name, 1e-9)
    ok = result["error"] is None and not result["missing"] and result["grad_rel"] <= tol
    runs = "yes" if result["error"] is None else f"no: {result['error']}"
    grads = f"yes ({result['grad_rel']:.0e}, {dtype_of(name)})" if ok else "no"
    feasible = "/".join("yes" if run.plans[name][p].feasible else "no" for p in (2, 4))
    return (f"| `{model}` | {arch} | {profile.tracer} | {profile.n_units} | {feasible} | {runs} "
            f"| {grads} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    args = ap.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = run_zoo(Path(tmp), args.only)
        results = {name: compare(name, run) for name in run.profiles}
    print("| model | architecture | tracer | units | plans p=2/4 | runs on 2 ranks | gradients equal (max rel. error) |")  # fmt: skip
    print("|---|---|---|---:|---|---|---|")
    for name, result in results.items():
        print(_row(name, run, result))
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
