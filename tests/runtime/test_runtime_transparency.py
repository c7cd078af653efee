"""A pipelined step equals the unsplit model's step on the full batch (torchgpipe's
``test_transparency``), for every bundled model, on 2 and 3 ranks (gloo, CPU, float64).

For each model and rank count one torchrun job runs every checkpoint policy with GPipe (and
``except_last`` with 1F1B) and returns each rank's loss, gradients and parameters after a few
optimizer steps; here they are compared with the unsplit model's, parameter by parameter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _runtime_jobs import POLICIES, launch_job, reference

pytestmark = pytest.mark.multirank

TIGHT = {"rtol": 1e-9, "atol": 1e-11}
STEPS = 3

MODELS: dict[str, dict[str, Any]] = {
    "gpt": {
        "model": "pipeplan.models.gpt:gpt",
        "kwargs": {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8},
        "starts": {2: [0, 3], 3: [0, 2, 4]},
    },
    "resnet": {
        "model": "pipeplan.models.resnet:resnet",
        "kwargs": {"width": 4, "blocks": "1,1", "image": 8},
        "starts": {2: [0, 2], 3: [0, 1, 3]},
    },
    "mlp": {
        "model": "pipeplan.models.mlp:mlp",
        "kwargs": {"width": 8, "depth": 4, "in_features": 6, "classes": 3},
        "starts": {2: [0, 2], 3: [0, 2, 3]},
    },
    "hf-gpt2": {
        "model": "pipeplan.models.hf:gpt2",
        "kwargs": {"vocab": 32, "d_model": 16, "n_layers": 3, "n_heads": 2, "seq_len": 8},
        "starts": {2: [0, 2], 3: [0, 2, 4]},
    },
}

CONFIGS = [
    {"key": f"{p}-gpipe", "checkpoint": p, "schedule": "gpipe", "optimizer": "sgd", "lr": 0.1}
    for p in POLICIES
] + [
    {  # auto's per-stage choices, as a plan records them: stage 1 recomputes, 0 and 2 keep
        "key": "mixed-gpipe",
        "checkpoint": "auto",
        "recompute": "odd",
        "schedule": "gpipe",
        "optimizer": "sgd",
        "lr": 0.1,
    },
    {
        "key": "except_last-1f1b",
        "checkpoint": "except_last",
        "schedule": "1f1b",
        "optimizer": "adam",
        "lr": 0.01,
    },
]


def _available(name: str) -> bool:
    if not name.startswith("hf"):
        return True
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _job(world: int) -> dict[str, Any]:
    models = [
        {"name": name, "model": m["model"], "kwargs": m["kwargs"], "starts": m["starts"][world]}
        for name, m in MODELS.items()
        if _available(name)
    ]
    configs = [{**c, "steps": STEPS} for c in CONFIGS]
    return {"models": models, "batch_size": 8, "microbatches": 4, "configs": configs}


def _where(*parts: object) -> Any:
    return lambda message: " ".join(map(str, parts)) + f": {message}"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``results(world)``: the job for ``world`` ranks (all models), run once per module."""
    cache: dict[int, tuple[dict[str, Any], list[Any]]] = {}

    def get(world: int) -> tuple[dict[str, Any], list[Any]]:
        if world not in cache:
            job = _job(world)
            cache[world] = job, launch_job(job, world, tmp_path_factory.mktemp(f"world{world}"))
        return cache[world]

    return get


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_equals_unsplit_model(results: Any, name: str, world: int) -> None:
    if not _available(name):
        pytest.skip("transformers is not installed")
    job, all_ranks = results(world)
    ranks = [r[name] for r in all_ranks]
    # each rank recomputes exactly as its stage in the plan says (mixed: the odd stages)
    assert [r["mixed-gpipe"]["recomputed"] for r in ranks] == [j % 2 == 1 for j in range(world)]
    assert [r["always-gpipe"]["recomputed"] for r in ranks] == [True] * world
    for cfg in job["configs"]:
        key = cfg["key"]
        ref_loss, ref_grads, ref_params, ref_losses = reference(
            MODELS[name], job["batch_size"], cfg["optimizer"], cfg["lr"], cfg["steps"]
        )
        last = ranks[-1][key]
        assert last["loss"] == pytest.approx(ref_loss, rel=1e-12), key
        assert last["losses"] == pytest.approx(ref_losses, rel=1e-9), key
        seen: set[str] = set()
        with_grad: set[str] = set()
        for r, rank in enumerate(ranks):
            got = rank[key]
            for pname, grad in got["grads"].items():
                torch.testing.assert_close(
                    grad, ref_grads[pname], **TIGHT, msg=_where(key, r, pname)
                )
            for pname, value in got["params"].items():
                torch.testing.assert_close(
                    value,
                    ref_params[pname],
                    **TIGHT,
                    msg=_where(key, r, f"{pname} after {STEPS} steps"),
                )
            seen |= set(got["params"])
            with_grad |= set(got["grads"])
        assert seen == set(ref_params), f"{key}: parameters missing from every stage"
        assert with_grad == set(ref_grads), f"{key}: gradients missing from every stage"


@pytest.mark.parametrize("world", [2, 3])
def test_tied_embedding_and_head_stay_tied(results: Any, world: int) -> None:
    _, all_ranks = results(world)
    ranks = [r["gpt"] for r in all_ranks]
    key = CONFIGS[-1]["key"]  # Adam, several steps
    tied = ranks[0][key]["tied"]
    assert tied == [("embed.tok.weight", (0, world - 1))]
    first, last = ranks[0][key], ranks[-1][key]
    name = tied[0][0]
    assert torch.equal(first["grads"][name], last["grads"][name])
    assert torch.equal(first["params"][name], last["params"][name])
