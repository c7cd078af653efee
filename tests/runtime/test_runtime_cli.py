"""``pipeplan run`` end to end on 2 and 3 CPU ranks: report and trace written; a stage that
raises or is killed stops the whole run within bounded time and the message names it; bad
requests fail before launch with one line and status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import typer
from _runtime_jobs import make_plan

from pipeplan.cli import main
from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.io import load_plan, load_report, write_json
from pipeplan.planner.types import Plan
from pipeplan.runtime import saving, worker
from pipeplan.runtime.checkpoint import INDEX, shard_name, write_index, write_shard
from pipeplan.runtime.snapshots import commit, file_record, partial_dir

GPT = (
    "pipeplan.models.gpt:gpt",
    {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8},
)
PIPEPLAN = [sys.executable, "-c", "from pipeplan.cli import main; main()"]


def _plan(path: Path, starts: list[int]) -> Path:
    spec = load_model(*GPT)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(*GPT, traced, starts=starts, batch_size=8, microbatches=4, dtype="float32")
    write_json(path, plan)
    return path


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    d = tmp_path_factory.mktemp("plans")
    return {2: _plan(d / "plan2.json", [0, 3]), 3: _plan(d / "plan3.json", [0, 2, 4])}


def _run(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [*PIPEPLAN, "run", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


@pytest.mark.multirank
def test_run_writes_report_and_trace(plans: dict[int, Path], tmp_path: Path) -> None:
    report, trace = tmp_path / "report.json", tmp_path / "trace.json"
    # A plan whose profile used another thread count than the ranks get: warned, still runs.
    plan_file = tmp_path / "plan.json"
    write_json(plan_file, load_plan(plans[2]).model_copy(update={"profiled_threads": 99}))
    args = [str(plan_file), "--steps", "2", "--warmup", "1", "--optimizer", "adam"]
    code, out, err, _ = _run([*args, "--report", str(report), "--trace", str(trace)])
    assert code == 0, err
    assert "warning: the profile was measured with 99 thread(s)" in err
    assert (
        "warning: the plan was made for sgd (its memory and update time) but the run uses adam"
        in err
    )
    assert "measured vs predicted" in out and "step time" in out and "bubble" in out
    rep = load_report(report)
    assert (rep.world_size, rep.steps, rep.warmup_steps, rep.backend) == (2, 2, 1, "gloo")
    assert len(rep.step_times_s) == 2 and rep.step_time_s > 0
    assert [len(s.forward_s) for s in rep.stages] == [4, 4]
    assert all(s.threads == max(1, len(os.sched_getaffinity(0)) // 2) for s in rep.stages)
    assert len(rep.losses) == 3 and rep.losses[-1] < rep.losses[0]
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["pid"] in (0, 1)]
    assert {(e["pid"], e["name"]) for e in spans} >= {
        (j, f"{k}{i}") for j in (0, 1) for k in "FB" for i in range(4)
    }


@pytest.mark.multirank
def test_run_shows_rank_0s_steps(plans: dict[int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`pipeplan run`'s progress bar follows rank 0 through its steps, warm-up included (it
    reads the step each rank 0 step writes), and is complete when the run ends."""
    import contextlib
    import importlib

    launch_module = importlib.import_module("pipeplan.runtime.launch")
    seen: list[tuple[str, object]] = []

    class Bar:
        def add_task(self, description: str, total: int) -> int:
            seen.append(("total", total))
            return 0

        def update(self, task: int, completed: int, description: str | None = None) -> None:
            seen.append(("completed", completed))

    monkeypatch.setattr(launch_module, "progress_bar", lambda _: contextlib.nullcontext(Bar()))
    launch_module.launch(
        load_plan(plans[2]), plans[2], ["--steps=2", "--warmup=1"], steps=3, progress=True
    )
    done = [c for k, c in seen if k == "completed"]
    assert seen[0] == ("total", 3)
    assert 2 in done  # rank 0 wrote its last step's index (0-based)
    assert done == sorted(done) and done[-1] == 3


@pytest.mark.multirank
def test_run_a_replicated_plan(tmp_path: Path) -> None:
    """One stage, two data-parallel replicas: two ranks, the global batch's loss, one copy of
    the weights saved."""
    spec = load_model(*GPT)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan_file, report, saved = tmp_path / "plan.json", tmp_path / "r.json", tmp_path / "w"
    plan = make_plan(*GPT, traced, starts=[0], batch_size=8, microbatches=2, dtype="float32",
                     replicas=2)  # fmt: skip
    write_json(plan_file, plan)
    args = [str(plan_file), "--steps", "2", "--warmup", "1", "--lr", "0", "--seed", "3"]
    code, out, err, _ = _run([*args, "--report", str(report), "--save", str(saved)])
    assert "measured vs predicted" in out
    assert code == 0, err
    rep = load_report(report)
    assert len(rep.stages) == 1 and len(rep.losses) == 3
    whole = load_model(*GPT, meta=True).module
    from pipeplan.intake.meta import materialize

    materialize(whole, [n for n, _ in whole.named_parameters()], torch.device("cpu"), seed=3)
    inputs, target = spec.batch(8)
    expected = float(spec.loss(whole(*inputs), target))
    assert rep.losses[0] == pytest.approx(expected, rel=1e-5)  # the global batch, not a share
    assert sorted(p.name for p in (saved / "step-000003").iterdir()) == [
        "manifest.json",
        "model-00001-of-00001.safetensors",  # one copy of the weights
        "model.safetensors.index.json",
        "train-00000-of-00002.pt",  # each replica its own optimizer and RNG states
        "train-00001-of-00002.pt",
    ]


@pytest.mark.multirank
def test_a_stage_that_raises_stops_every_rank(plans: dict[int, Path], tmp_path: Path) -> None:
    # An Adam plan run without --optimizer trains with Adam: no mismatch warning.
    adam = tmp_path / "adam.json"
    write_json(adam, load_plan(plans[3]).model_copy(update={"optimizer": "adam"}))
    code, _, err, took = _run([str(adam), "--steps", "3"], {"PIPEPLAN_FAIL": "1:2"})
    assert code == 1 and took < 60
    assert "error: stage 1 failed at step 2: RuntimeError: injected failure" in err
    assert "Traceback" not in err
    assert "the plan was made for" not in err


@pytest.mark.multirank
def test_debug_shows_the_failing_rank_traceback(plans: dict[int, Path]) -> None:
    """Issue 31: ``--debug`` (``PIPEPLAN_DEBUG=1``) prints the rank's own traceback, which its
    error file held and the run's temporary folder took away."""
    code, _, err, _ = _run([str(plans[2]), "--steps", "2"],
                           {"PIPEPLAN_FAIL": "1:1", "PIPEPLAN_DEBUG": "1"})  # fmt: skip
    assert code == 1
    assert "Traceback (most recent call last)" in err and "worker.py" in err
    assert "error: stage 1 failed at step 1: RuntimeError: injected failure" in err


@pytest.mark.multirank
def test_a_stage_that_dies_stops_every_rank(plans: dict[int, Path]) -> None:
    code, _, err, took = _run([str(plans[2]), "--steps", "3"], {"PIPEPLAN_FAIL": "1:1:kill"})
    assert code == 1 and took < 60
    assert "error: stage 1 died with exit code -9 (SIGKILL)" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "pipeplan.models.mlp:mlp"], "plan was made for graph fingerprint"),
        (["--model-arg", "n_layers=5"], "plan was made for graph fingerprint"),
        (["--model", "no_such_module:model"], "cannot import 'no_such_module'"),
        (["--threads", "0"], "--threads 0 must be at least 1"),
        (["--report", "/no/such/dir/report.json"], "directory does not exist"),
        (["--batch-norm", "sometimes"], "--batch-norm 'sometimes' is not deferred or microbatch"),
        (["--save-every", "2"], "--save-every 2 needs --save DIR"),
        (["--keep", "2"], "--keep 2 needs --save DIR, the folder whose saves it keeps"),
    ],
)
def test_bad_requests_fail_before_launch(
    plans: dict[int, Path], capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", str(plans[2]), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_fails_before_launch(
    plans: dict[int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", str(plans[2]), "--device", "cuda"])
    assert exc.value.code == 2 and "0 CUDA devices" in capsys.readouterr().err


def test_worker_rejects_a_world_size_other_than_the_stage_count(
    plans: dict[int, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        worker.main([str(plans[2])])
    assert exc.value.code == 2
    assert "has 2 stages x 1 replicas but the world size is 3" in capsys.readouterr().err


def _save_of(root: Path, info: dict[str, object]) -> None:
    """A complete save of one tensor into ``root`` whose manifest records ``info``."""
    save_id, tmp = "0123456789abcdef", partial_dir(root, 2)
    size = write_shard(tmp, 0, 1, {"x": torch.zeros(2)}, {"save_id": save_id, "step": "2"})
    write_index(tmp, [["x"]], size)
    files = [file_record(tmp / name) for name in (shard_name(0, 1), INDEX)]
    commit(root, 2, save_id, files, info)


def _dp2_plans(tmp_path: Path) -> tuple[Plan, Plan]:
    """1 stage x 2 replicas, replicated and sharded by FSDP2 (the latter written to plan.json)."""
    spec = load_model(*GPT)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(*GPT, traced, starts=[0], batch_size=8, microbatches=2, replicas=2)
    sharded = plan.model_copy(
        update={"cluster": plan.cluster.model_copy(update={"data_parallel_mode": "shard"})}
    )
    write_json(tmp_path / "plan.json", sharded)
    return plan, sharded


def test_resuming_a_save_on_another_mesh_is_one_line_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rank's training state holds its own shards, so a save resumes only on its mesh:
    a save of 1 stage x 2 replicas resumed by the same plan sharded by FSDP2 is one line,
    exit 2, before any rank starts (issue 42)."""
    plan, _ = _dp2_plans(tmp_path)
    _save_of(tmp_path / "save", saving.run_info(plan, "sgd", 1e-3, 0))
    with pytest.raises(SystemExit) as exc:
        main(["run", str(tmp_path / "plan.json"), "--resume", str(tmp_path / "save")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "made on the mesh pp 1 x dp 2 (replicate) but this plan runs pp 1 x dp 2 (shard)" in err


def test_the_ranks_check_the_mesh_of_a_save_and_take_an_older_one_as_replicated(
    tmp_path: Path,
) -> None:
    """The worker checks the mesh as well (a launch of your own torchrun has no preflight); a
    save made before manifests recorded it was replicated, and resumes as it did."""
    plan, sharded = _dp2_plans(tmp_path)
    info = saving.run_info(plan, "sgd", 1e-3, 0)
    _save_of(tmp_path / "old", {k: v for k, v in info.items() if k != "mesh"})
    assert saving.resume_point(tmp_path / "old", info)[1] == 2
    with pytest.raises(InvalidRequestError, match=r"pp 1 x dp 2 \(replicate\) but this plan"):
        saving.resume_point(tmp_path / "old", saving.run_info(sharded, "sgd", 1e-3, 0))


def test_resume_falls_back_to_the_newest_complete_save_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--resume DIR`` whose ``latest`` save is damaged resumes the newest complete one, and
    says so in one line; with none complete it is refused, naming the damaged file."""
    from pipeplan.cli_runtime import check_resume
    from pipeplan.runtime.snapshots import step_name

    root = tmp_path / "save"
    for step in (2, 4, 3):  # committed in this order: 3 is the newest after 4
        save_id, tmp = f"{step:016x}", partial_dir(root, step)
        size = write_shard(tmp, 0, 1, {"x": torch.full((2,), step)}, {"save_id": save_id})
        write_index(tmp, [["x"]], size)
        files = [file_record(tmp / name) for name in (shard_name(0, 1), INDEX)]
        commit(root, step, save_id, files, {})
    assert check_resume(root) == root  # whole: resumed at latest
    shard = root / step_name(3) / shard_name(0, 1)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert check_resume(root) == root / step_name(4)
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"warning: --resume {root}: the save latest names is damaged ")
    assert f"{shard} is corrupted" in err and err.endswith(
        "resuming from step-000004, the newest complete save"
    )
    for step in (2, 4):
        (root / step_name(step) / INDEX).unlink()
    with pytest.raises(typer.Exit) as exc:
        check_resume(root)
    assert exc.value.exit_code == 2
    assert f"{shard} is corrupted" in " ".join(capsys.readouterr().err.split())
