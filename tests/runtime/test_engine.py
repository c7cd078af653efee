"""The runner (:mod:`pipeplan.runtime.engine`): a pipelined step equals the unsplit model's step on the full batch (torchgpipe's
``test_transparency``), for every bundled model, on 2 and 3 ranks (gloo, CPU, float64).

For each model and rank count one torchrun job runs every checkpoint policy with GPipe (and
``except_last`` with 1F1B) and returns each rank's loss, gradients and parameters after a few
optimizer steps; here they are compared with the unsplit model's, parameter by parameter.

The multi-chunk schedules too (interleaved, looped, zero-bubble, V), on gloo: the loss and
every gradient equal the unsplit model's, tied embedding and head included.
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
from _runtime_jobs import POLICIES, chunked, launch_job, make_plan, reference

import pipeplan
from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.families import action_order
from pipeplan.planner.io import write_json

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


# Multi-chunk schedules on gloo (interleaved, looped, zero-bubble, V).

GPT = (
    "pipeplan.models.gpt:gpt",
    {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8},
)
JOB = Path(__file__).with_name("_chunked_job.py")
FAMILIES = {"interleaved1f1b": 2, "loopedbfs": 2, "zb-interleaved": 2, "zbv": 2, "dualpipev": 2,
            "zbv-always": 2}  # fmt: skip


def _launch(tmp_path: Path, gpt: tuple, p: int, m: int, starts: list[int], families: dict) -> None:
    """Run every family's plan over ``starts`` on p gloo ranks; check loss and gradients."""
    batch = 2 * m
    spec = load_model(*gpt)
    traced = trace_model(spec.module, spec.batch(batch // m)[0])
    files = []
    for name in families:  # "<family>-always": every chunk recomputes
        fam = name.removesuffix("-always")
        plan = make_plan(*gpt, traced, starts=starts, batch_size=batch, microbatches=m,
                         dtype="float32", checkpoint="never" if fam == name else "always")  # fmt: skip
        plan = chunked(plan, fam, p)
        write_json(tmp_path / f"{name}.json", plan)
        files.append(str(tmp_path / f"{name}.json"))
    torch.manual_seed(11)
    inputs, target = spec.batch(batch)
    torch.save({gpt[0]: (inputs, target)}, tmp_path / "batch.pt")
    cmd = [sys.executable, "-m", "pipeplan.runtime.forkrun", "--standalone",
           f"--nproc-per-node={p}", str(JOB), str(tmp_path / "batch.pt"), str(tmp_path), *files]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    torch.manual_seed(3)
    whole = load_model(*gpt).module
    loss = spec.loss(whole(*inputs), target)
    loss.backward()
    want = {n: prm.grad for n, prm in whole.named_parameters()}
    for fam in families:
        ranks = [torch.load(tmp_path / f"{fam}-rank{r}.pt") for r in range(p)]
        losses = [r["loss"] for r in ranks if r["loss"] is not None]
        assert len(losses) == 1 and losses[0] == pytest.approx(loss.item(), rel=1e-5), fam
        got: dict[str, torch.Tensor] = {}
        for r in ranks:
            got.update(r["grads"])
        assert got.keys() == want.keys(), fam
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=f"{fam} {name}")


def test_every_family_on_2_ranks_gets_the_unsplit_models_loss_and_gradients(
    tmp_path: Path,
) -> None:
    _launch(tmp_path, GPT, 2, 4, [0, 2, 3, 5], FAMILIES)


def test_interleaved_and_v_on_4_ranks(tmp_path: Path) -> None:
    """p = 4, v = 2: 8 chunks of one unit each (embedding, 6 blocks, head)."""
    gpt6 = (GPT[0], {**GPT[1], "n_layers": 6})
    _launch(tmp_path, gpt6, 4, 8, list(range(8)), {"interleaved1f1b": 2, "zbv": 2})


def test_pipeplan_run_reports_and_traces_a_zbv_plan_per_chunk(tmp_path: Path) -> None:
    """``pipeplan run`` on ZB-V: the worker's loop, its report (F and I + W per chunk, memory
    per rank) and its Chrome trace (a process per rank, a thread per chunk)."""
    spec = load_model(*GPT)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(*GPT, traced, starts=[0, 2, 3, 5], batch_size=8, microbatches=4,
                     dtype="float32", checkpoint="never")  # fmt: skip
    write_json(tmp_path / "zbv.json", chunked(plan, "zbv", 2))
    report, trace = tmp_path / "report.json", tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "pipeplan", "run", str(tmp_path / "zbv.json"), "--steps", "2",
           "--warmup", "1", "--lr", "0.05", "--optimizer", "adam", "--threads", "1",
           "--report", str(report), "--trace", str(trace)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memory per rank" in proc.stdout
    got = pipeplan.load(report)
    assert isinstance(got, pipeplan.RunReport)
    assert len(got.losses) == 3 and got.losses[2] < got.losses[0]
    assert [(s.stage, s.rank) for s in got.stages] == [(0, 0), (1, 1), (2, 1), (3, 0)]
    assert all(len(s.backward_input_s) == len(s.backward_weight_s) == 4 for s in got.stages)
    assert [(r.rank, r.stages) for r in got.ranks] == [(0, (0, 3)), (1, (1, 2))]
    assert all(r.peak_memory_bytes and r.peak_memory_bytes > 0 for r in got.ranks)
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    measured = {(e["pid"], e["tid"], e["name"]) for e in events if e["pid"] < 1000}
    for rank, chunks in ((0, (0, 3)), (1, (1, 2))):
        for c in chunks:
            assert {f"{a}{i}" for a in "FIW" for i in range(4)} <= {
                name for pid, tid, name in measured if (pid, tid) == (rank, c)
            }
    assert any(e["pid"] >= 1000 for e in events)  # the replayed prediction
    # The order each rank ran its actions in is the order the planner replayed (torch's own
    # pipeline_order, planner.families.action_order): the last measured step's spans.
    for rank, want in enumerate(action_order("zbv", 2, 2, 4)):
        spans = sorted(
            (e["ts"], e["name"][0], e["tid"], int(e["name"][1:]))
            for e in events
            if e["pid"] == rank and e["name"][:1] in "FBIW" and e["name"][1:].isdigit()
        )
        assert [s[1:] for s in spans] == [(a.kind, a.stage, a.microbatch) for a in want], rank
