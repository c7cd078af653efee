"""Multi-chunk schedules on models this project did not write: the loss and every gradient
equal the unsplit model's.

On 2 ranks (p = 2, v = 2: four chunks) and on 4 (p = 4, v = 2: eight chunks, one unit each),
one torchrun launch runs all five multi-chunk families (interleaved1f1b, loopedbfs,
zb-interleaved, zbv, dualpipev) on torch's own schedule classes over gloo for every model
(:mod:`_chunked_job`), in float64, with m = 2 p micro-batches (dualpipev's least); each test
compares one model's families with the unsplit model on the full batch.  The models:

- ``llama`` (``pipeplan.models.zoo``): RoPE's cos and sin (no gradient) and the causal mask,
  made before the first layer, cross every cut;
- ``gpt2``: its embedding and LM head are one tensor, held by the first and the last chunk
  (on two ranks in a loop, on one rank in a V);
- ``skip`` (``_carry_models``): a tensor made in chunk 0 and used in chunks 3, 5 and 7 (on
  other ranks), a view of it, an integer tensor, a bool mask and a float tensor that needs no
  gradient, each passing through the chunks between; a 0-dim tensor among the outputs.

What each once broke: the runner ignored the plan's dtype; torch's default merge of the last
stage's outputs cannot concatenate a 0-dim one; torch's zero-bubble backward detaches a stage's
outputs in place, which a value passed through (a view of what the stage received) refuses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _runtime_jobs import make_plan

from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.io import write_json

pytestmark = pytest.mark.multirank

JOB = Path(__file__).parents[1] / "runtime" / "_chunked_job.py"
FAMILIES = ("interleaved1f1b", "loopedbfs", "zb-interleaved", "zbv", "dualpipev")
ZOO = {"d_model": 16, "vocab": 64, "seq_len": 8}
#: name -> (model, kwargs by p): 2 p units, one per chunk.
MODELS: dict[str, tuple[str, dict[int, dict[str, Any]]]] = {
    "llama": ("pipeplan.models.zoo:llama", {2: {**ZOO, "n_layers": 2}, 4: {**ZOO, "n_layers": 6}}),
    "gpt2": ("pipeplan.models.zoo:gpt2", {2: {**ZOO, "n_layers": 2}, 4: {**ZOO, "n_layers": 6}}),
    "skip": ("_carry_models:skip", {2: {}, 4: {}}),
}
DTYPE = torch.float64


@dataclass
class Launch:
    """One torchrun launch of every model's five plans on p ranks."""

    p: int
    out: Path
    batches: dict[str, tuple[Any, torch.Tensor]]


def _cast(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DTYPE) if t.is_floating_point() else t for t in inputs)


def _plans(out: Path, name: str, p: int) -> list[str]:
    """Write ``name``'s plan of each family: 2 p chunks of one unit, v = 2, m = 2 p."""
    model, kwargs = MODELS[name][0], MODELS[name][1][p]
    spec = load_model(model, kwargs)
    spec.module.to(DTYPE)
    traced = trace_model(spec.module, _cast(spec.batch(2)[0]))
    files = []
    for fam in FAMILIES:
        plan = make_plan(model, kwargs, traced, starts=list(range(2 * p)), batch_size=4 * p,
                         microbatches=2 * p, dtype="float64", checkpoint="never")  # fmt: skip
        plan = plan.model_copy(update={
            "schedule": fam, "stages_per_rank": 2,
            "cluster": plan.cluster.model_copy(update={"devices": plan.cluster.devices[:p]}),
        })  # fmt: skip
        write_json(out / f"{name}-{fam}.json", plan)
        files.append(str(out / f"{name}-{fam}.json"))
    return files


@pytest.fixture(scope="module", params=[2, 4], ids=["p2", "p4"])
def launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """Every model's plans on p gloo ranks in one torchrun launch (a launch costs seconds)."""
    p = request.param
    out = tmp_path_factory.mktemp(f"chunked{p}")
    files = [f for name in MODELS for f in _plans(out, name, p)]
    batches = {model: load_model(model, kw[p]).batch(4 * p) for model, kw in MODELS.values()}
    torch.save(batches, out / "batch.pt")
    cmd = [sys.executable, "-m", "pipeplan.runtime.forkrun", "--standalone",
           f"--nproc-per-node={p}", str(JOB), str(out / "batch.pt"), str(out), *files]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Launch(p, out, batches)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_family_equals_the_unsplit_model(launch: Launch, name: str) -> None:
    """Loss within 1e-12 and every gradient within 1e-9 (relative) of the unsplit model's, in
    float64: the schedules only reorder the sums over micro-batches.  A gradient missing or in
    another dtype fails too."""
    model, kwargs = MODELS[name][0], MODELS[name][1][launch.p]
    inputs, target = launch.batches[model]
    torch.manual_seed(3)
    spec = load_model(model, kwargs)
    whole = spec.module.to(DTYPE)
    loss = spec.loss(whole(*_cast(inputs)), target)
    loss.backward()
    want = {n: prm.grad for n, prm in whole.named_parameters() if prm.grad is not None}
    for fam in FAMILIES:
        ranks = [torch.load(launch.out / f"{name}-{fam}-rank{r}.pt") for r in range(launch.p)]
        losses = [r["loss"] for r in ranks if r["loss"] is not None]
        assert len(losses) == 1 and losses[0] == pytest.approx(loss.item(), rel=1e-12), fam
        got: dict[str, torch.Tensor] = {}
        for r in ranks:
            got.update(r["grads"])
        assert got.keys() == want.keys(), (fam, got.keys() ^ want.keys())
        for k, g in want.items():
            assert got[k].dtype == DTYPE, (fam, k, got[k].dtype)
            torch.testing.assert_close(got[k], g, rtol=1e-9, atol=1e-12, msg=f"{fam} {k}")
