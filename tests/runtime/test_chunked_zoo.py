"""Multi-chunk schedules on models this project did not write: the loss and every gradient
equal the unsplit model's.

For each model and p (2 ranks: p = 2, v = 2, four chunks; 4 ranks: p = 4, v = 2, eight chunks,
one unit each) one torchrun launch runs all five multi-chunk families (interleaved1f1b,
loopedbfs, zb-interleaved, zbv, dualpipev) on torch's own schedule classes over gloo
(:mod:`_chunked_job`), in float64, and the test compares each family's loss and gradients with
the unsplit model's on the full batch.  The models:

- ``llama`` (``pipeplan.models.zoo``): RoPE's cos and sin and the causal mask, made before the
  first layer, cross every cut;
- ``gpt2``: its embedding and LM head are one tensor, held by the first and the last chunk
  (in a loop on two ranks, in a V on one);
- ``skip`` (``_carry_models``): a tensor made in chunk 0 used in chunk 3 and later, an integer
  tensor, a bool mask, a float tensor that needs no gradient and a transposed view, each passing
  through chunks on other ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _runtime_jobs import make_plan

from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.io import write_json

JOB = Path(__file__).with_name("_chunked_job.py")
FAMILIES = ("interleaved1f1b", "loopedbfs", "zb-interleaved", "zbv", "dualpipev")
ZOO = {"d_model": 16, "vocab": 64, "seq_len": 8}
#: name -> (model, kwargs at p = 2, kwargs at p = 4): one unit per chunk (p v = 2 p units).
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama": ("pipeplan.models.zoo:llama", {**ZOO, "n_layers": 2}, {**ZOO, "n_layers": 6}),
    "gpt2": ("pipeplan.models.zoo:gpt2", {**ZOO, "n_layers": 2}, {**ZOO, "n_layers": 6}),
    "skip": ("_carry_models:skip", {}, {}),
}
DTYPE = torch.float64
pytestmark = pytest.mark.xdist_group("torchrun")


def _reference(model: str, kwargs: dict[str, Any], batch: tuple) -> tuple[float, dict]:
    """The unsplit model's loss and gradients on the full batch, in float64."""
    inputs, target = batch
    torch.manual_seed(3)
    spec = load_model(model, kwargs)
    whole = spec.module.to(DTYPE)
    loss = spec.loss(whole(*(t.to(DTYPE) if t.is_floating_point() else t for t in inputs)), target)
    loss.backward()
    return loss.item(), {n: prm.grad for n, prm in whole.named_parameters() if prm.grad is not None}


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_family_equals_the_unsplit_model(tmp_path: Path, name: str, p: int) -> None:
    """All five families, v = 2, one torchrun launch: loss and every gradient within 1e-9 of
    the unsplit model's (float64; the schedules only reorder sums over micro-batches)."""
    model, kw2, kw4 = MODELS[name]
    kwargs = kw2 if p == 2 else kw4
    m = 2 * p
    batch_size = 2 * m
    spec = load_model(model, kwargs)
    spec.module.to(DTYPE)
    example = tuple(t.to(DTYPE) if t.is_floating_point() else t for t in spec.batch(2)[0])
    traced = trace_model(spec.module, example)
    files = []
    for fam in FAMILIES:
        plan = make_plan(model, kwargs, traced, starts=list(range(2 * p)), batch_size=batch_size,
                         microbatches=m, dtype="float64", checkpoint="never")  # fmt: skip
        plan = plan.model_copy(update={
            "schedule": fam, "stages_per_rank": 2,
            "cluster": plan.cluster.model_copy(update={"devices": plan.cluster.devices[:p]}),
        })  # fmt: skip
        write_json(tmp_path / f"{fam}.json", plan)
        files.append(str(tmp_path / f"{fam}.json"))
    torch.manual_seed(11)
    batch = spec.batch(batch_size)
    torch.save(batch, tmp_path / "batch.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={p}", str(JOB), str(tmp_path / "batch.pt"), str(tmp_path), *files]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    want_loss, want = _reference(model, kwargs, batch)
    for fam in FAMILIES:
        ranks = [torch.load(tmp_path / f"{fam}-rank{r}.pt") for r in range(p)]
        losses = [r["loss"] for r in ranks if r["loss"] is not None]
        assert len(losses) == 1 and losses[0] == pytest.approx(want_loss, rel=1e-12), fam
        got: dict[str, torch.Tensor] = {}
        for r in ranks:
            got.update(r["grads"])
        assert got.keys() == want.keys(), (fam, got.keys() ^ want.keys())
        for k, g in want.items():
            assert got[k].dtype == DTYPE, (fam, k, got[k].dtype)
            torch.testing.assert_close(got[k], g, rtol=1e-9, atol=1e-12, msg=f"{fam} {k}")
