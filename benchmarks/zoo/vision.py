"""The vision zoo: torchvision and timm classifiers from profile to a 2-rank run, as they are.

    PYTHONPATH=. .venv/bin/python -m benchmarks.zoo.vision [--only NAME ...]

For every model of :mod:`pipeplan.models.vision` (64 x 64 images, 10 classes): profile with the
default options except float64 (so that gradients can be compared tightly) and one warm-up and
two repeats, plan 2 and 4 stages with the DP (8 GiB per device, SGD), then run every model's
2-stage plan at m = 2 for 2 steps on 2 ranks, built as ``pipeplan run`` builds it by default
(on meta, each rank materializing its stage, or the whole model where something has no
initializer: ``--init auto``; one torchrun launch, gloo, :mod:`benchmarks.zoo.job`), and
compare the loss and every gradient with the unsplit model built the same way.  The unsplit
model runs each micro-batch on its own and averages the losses, as the pipeline does: a
BatchNorm normalises with each micro-batch's statistics (:mod:`pipeplan.runtime.batchnorm`).
Prints this folder's README vision table and writes ``vision.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.zoo.main import HERE, ZooRun, _plan, compare, launch, sgd_steps
from pipeplan.intake.meta import materialize
from pipeplan.intake.model import load_model
from pipeplan.intake.spec import ModelSpec
from pipeplan.models.vision import VISION
from pipeplan.planner.io import write_json
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.runtime.worker import _whole_build_needed

__all__ = ["BATCH", "KWARGS", "built_as_run", "reference", "run_vision"]

BATCH = 8
MICROBATCHES = 2
STEPS = 2
KWARGS: dict[str, Any] = {"image": 64}


def built_as_run(name: str, dtype: torch.dtype = torch.float64, image: int = 64) -> ModelSpec:
    """The model as one rank of ``pipeplan run --init auto`` builds it, whole, in ``dtype``:
    on meta and materialized from seed 0 (in ``dtype``: a float64 draw is not a float32 one),
    or built for real where something has no initializer (then cast)."""
    model = f"pipeplan.models.vision:{name}"
    kwargs = {**KWARGS, "image": image}
    spec = load_model(model, kwargs, meta=True)
    if _whole_build_needed(spec, 1, 1):
        spec = load_model(model, kwargs)
        spec.module.to(dtype)
        return spec
    spec.module.to(dtype)
    materialize(spec.module, [n for n, _ in spec.module.named_parameters()], torch.device("cpu"))
    return spec


def reference(name: str, image: int = 64) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model in float64, micro-batch by micro-batch: each step's loss (the mean
    over micro-batches) and step 1's gradients."""
    spec = built_as_run(name, image=image)
    module = spec.module
    inputs, target = spec.batch(BATCH)
    x = inputs[0].to(torch.float64)

    def step_loss() -> torch.Tensor:
        parts = [
            spec.loss(module(xc), tc) / MICROBATCHES
            for xc, tc in zip(x.chunk(MICROBATCHES), target.chunk(MICROBATCHES))
        ]
        return torch.stack(parts).sum()

    return sgd_steps(module, step_loss, STEPS)


def run_vision(
    out: Path, names: list[str], image: int = 64, repeats: int = 2, zbv: Sequence[str] = ()
) -> ZooRun:
    """Profile and plan every model (``image``-sided inputs, ``repeats`` timed passes), then
    run all 2-stage plans in one 2-rank launch; for the models in ``zbv`` also a ZB-V plan
    (2 ranks x 2 chunks, the schedule solver's cuts), as case ``NAME+zbv``."""
    from pipeplan.profiler import profile_model
    from pipeplan.solvers.multichunk import solve_schedule

    run = ZooRun()
    cases = {}
    for name in names:
        model = f"pipeplan.models.vision:{name}"
        t0 = time.perf_counter()
        kwargs = {**KWARGS, "image": image}
        profile = profile_model(model, batch_size=BATCH, model_kwargs=kwargs, dtype="float64",
                                warmup=1, repeats=repeats, progress=False)  # fmt: skip
        print(f"{name}: profiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        run.profiles[name] = profile
        run.plans[name] = {p: _plan(profile, p, None, 8 << 30) for p in (2, 4)}
        path = out / f"{name}.plan.json"
        write_json(path, _plan(profile, 2, MICROBATCHES, 8 << 30))
        cases[name] = {"model": model, "kwargs": kwargs, "plan": str(path), "meta": True}
        if name in zbv:
            options = PlanOptions(schedule="zbv", microbatches=MICROBATCHES, optimizer="sgd")
            chunked = solve_schedule(profile, Cluster.homogeneous(2, 8 << 30), options)
            write_json(out / f"{name}+zbv.plan.json", chunked)
            run.plans[f"{name}+zbv"] = {2: chunked}
            cases[f"{name}+zbv"] = {**cases[name], "plan": str(out / f"{name}+zbv.plan.json")}
    launch(out, cases, STEPS, run, timeout=3600)
    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="model names (default: all)")
    args = ap.parse_args(argv)
    names = args.only or list(VISION)
    with tempfile.TemporaryDirectory() as tmp:
        run = run_vision(Path(tmp), names)
        results = {name: compare(name, run, reference) for name in names}
    print("| model | architecture | units | plans p=2/4 (m) | runs on 2 ranks | loss, gradients max rel. error |")  # fmt: skip
    print("|---|---|---:|---|---|---|")
    for name, r in results.items():
        arch = type(load_model(f"pipeplan.models.vision:{name}", KWARGS, meta=True).module).__name__
        plans = "/".join(f"{'yes' if run.plans[name][p].feasible else 'no'} ({run.plans[name][p].microbatches})" for p in (2, 4))  # fmt: skip
        runs = "yes" if r["error"] is None else f"no: {r['error']}"
        errs = "-" if r["error"] else f"{r['loss_rel']:.0e}, {r['grad_rel']:.0e}"
        print(f"| `{name}` | {arch} | {run.profiles[name].n_units} | {plans} | {runs} | {errs} |")
    (HERE / "vision.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
