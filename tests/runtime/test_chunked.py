"""Multi-chunk schedules (interleaved, looped, zero-bubble, V) on gloo: the loss and every
gradient equal the unsplit model's, tied embedding and head included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _runtime_jobs import chunked, make_plan

import pipeplan
from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.families import action_order
from pipeplan.planner.io import write_json

pytestmark = pytest.mark.multirank

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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
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
