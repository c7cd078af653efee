"""Pipelines times data-parallel replicas on a 2-D mesh (dp, pp): a step equals the unsplit
model's on the global batch, for p = 1, d = 2 and p = 2, d = 1 on 2 ranks and p = 2, d = 2 on
4 (oversubscribed: correctness only).  Every rank's gradients (averaged over its replicas) and
parameters after a few steps match the unsplit model's; the loss is the global batch's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _runtime_jobs import launch_job, reference

pytestmark = pytest.mark.multirank

TIGHT = {"rtol": 1e-9, "atol": 1e-11}
GPT = {
    "model": "pipeplan.models.gpt:gpt",
    "kwargs": {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8},
}
#: SGD with momentum, not Adam: Adam scales a gradient by its own size, so the key bias's
#: gradient, zero up to rounding (softmax ignores a constant added to every key), would take
#: the sign of the rounding, which the replicas' sum orders differently.
CONFIG = {"key": "momentum", "checkpoint": "except_last", "schedule": "gpipe",
          "optimizer": "momentum", "lr": 0.1, "steps": 3}  # fmt: skip
LAYOUTS = {"p1-d2": ([0], 2), "p2-d1": ([0, 3], 1), "p2-d2": ([0, 3], 2)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replicated_pipeline_equals_unsplit_model(name: str, tmp_path: Any) -> None:
    starts, replicas = LAYOUTS[name]
    world = len(starts) * replicas
    model = {"name": "gpt", **GPT, "starts": starts, "replicas": replicas}
    job = {"models": [model], "batch_size": 8, "microbatches": 2, "configs": [CONFIG]}
    ranks = [r["gpt"]["momentum"] for r in launch_job(job, world, tmp_path, timeout=300)]
    ref_loss, ref_grads, ref_params, ref_losses = reference(GPT, 8, "momentum", 0.1, 3)
    p = len(starts)
    for r, got in enumerate(ranks):
        if r % p == p - 1:  # every replica's last stage reports the global batch's loss
            assert got["loss"] == pytest.approx(ref_loss, rel=1e-12), r
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-9), r
        for pname, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref_grads[pname], **TIGHT, msg=f"rank {r} {pname}")
        for pname, value in got["params"].items():
            torch.testing.assert_close(value, ref_params[pname], **TIGHT, msg=f"rank {r} {pname}")
    for replica in range(replicas):
        mine = ranks[replica * p : (replica + 1) * p]
        assert set().union(*(set(g["params"]) for g in mine)) == set(ref_params)
        assert set().union(*(set(g["grads"]) for g in mine)) == set(ref_grads)


MLP = {
    "model": "pipeplan.models.mlp:mlp",
    "kwargs": {"width": 8, "depth": 4, "in_features": 8, "classes": 4},
}
#: pp 2 x dp 2 with FSDP2 on the dp axis, one family per entry: (model, unit starts, ranks for a
#: multi-chunk family or None).  ZB-V's V puts the model's two ends on rank 0, which FSDP2
#: cannot shard when they share a parameter (the GPT's tied embedding): the MLP has none.
SHARDED = {
    "gpipe": (GPT, [0, 3], None),
    "1f1b": (GPT, [0, 3], None),
    "interleaved1f1b": (GPT, [0, 2, 3, 5], 2),
    "zbv": (MLP, [0, 1, 2, 4], 2),
}


def test_sharded_pipeline_equals_unsplit_model(tmp_path: Any) -> None:
    """pp 2 x dp 2, each stage (chunk) wrapped in FSDP2's fully_shard over its dp group: the
    loss and every gradient (gathered from the shards) equal the unsplit model's for GPipe,
    1F1B, interleaved 1F1B and ZB-V, in float64, and so do the parameters after 3 steps.
    One launch of 4 ranks runs all four."""
    models = []
    for fam, (model, starts, ranks) in SHARDED.items():
        cfg = {**CONFIG, "key": fam, "schedule": fam, "checkpoint": "never", "mode": "shard"}
        if ranks is not None:
            cfg["ranks"] = ranks
        models.append(
            {"name": fam, **model, "starts": starts, "replicas": 2, "keys": [fam], "cfg": cfg}
        )
    job = {
        "models": models,
        "batch_size": 8,
        "microbatches": 2,
        "configs": [m.pop("cfg") for m in models],
    }
    ranks_out = launch_job(job, 4, tmp_path, timeout=600)
    for fam, (model, _, _) in SHARDED.items():
        ref_loss, ref_grads, ref_params, ref_losses = reference(model, 8, "momentum", 0.1, 3)
        seen: set[str] = set()
        for r, out in enumerate(ranks_out):
            got = out[fam][fam]
            assert set(got["sharded"]) == {"DTensor"}, (fam, r)  # FSDP2 holds every parameter
            if got["loss"] is not None:
                assert got["loss"] == pytest.approx(ref_loss, rel=1e-12), (fam, r)
                assert got["losses"] == pytest.approx(ref_losses, rel=1e-9), (fam, r)
            for pname, grad in got["grads"].items():
                torch.testing.assert_close(
                    grad, ref_grads[pname], **TIGHT, msg=f"{fam} {r} {pname}"
                )
            for pname, value in got["params"].items():
                torch.testing.assert_close(
                    value, ref_params[pname], **TIGHT, msg=f"{fam} {r} {pname}"
                )
            seen |= set(got["grads"])
        assert seen == set(ref_grads), fam
