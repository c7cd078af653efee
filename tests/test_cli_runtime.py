"""``pipeplan run`` end to end (:mod:`pipeplan.cli_runtime`) on 2 and 3 CPU ranks: report and
trace written; a stage that raises or is killed stops the whole run within bounded time and the
message names it; bad requests fail before launch with one line and status 2.

Faults during ``pipeplan run`` on 2 CPU ranks: each ends in bounded time, names the stage and
the cause, exits non-zero, leaves no process behind and keeps the last complete save.

- SIGTERM to ``pipeplan run`` (a scheduler's time limit) and SIGINT to its process group
  (Ctrl-C) are forwarded to torchrun and every rank; the job ends within seconds, status
  128 + the signal, and one line names the signal and the step.
- A rank stopped with SIGSTOP (a hung rank) ends the job within ``--timeout`` plus a margin,
  naming the stalled stage.
- A full disk during a save (``ENOSPC``, injected) names the stage that could not write it.
- A save that is truncated, corrupted or incomplete is refused before launch (``--resume``),
  naming the file, with status 2 (the ranks' own checks are tested in
  ``tests/runtime/test_snapshots.py``).

Each test prints its time to stop (``pytest -s`` shows them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from _resume_jobs import ENV, PIPEPLAN, beat, state, survivors, wait_for, write_plans
from _runtime_jobs import make_plan

from pipeplan.cli import main
from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.io import load_plan, load_report, write_json
from pipeplan.planner.types import Plan
from pipeplan.runtime import saving, worker
from pipeplan.runtime.checkpoint import INDEX, shard_name, write_index, write_shard
from pipeplan.runtime.snapshots import commit, file_record, partial_dir, step_name
from pipeplan.runtime.supervise import live_processes, parent_pid

GPT = (
    "pipeplan.models.gpt:gpt",
    {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8},
)


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
    assert rep.world_size == 2 and len(rep.ranks) == 1  # the run's ranks; the first replica's
    assert "(gloo, 2 ranks," in out
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
    # PIPEPLAN_FAIL's step is 0-based: the third step, numbered as its save would be
    assert "error: stage 1 failed at step 3: RuntimeError: injected failure" in err
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
    assert "error: stage 1 failed at step 2: RuntimeError: injected failure" in err


@pytest.mark.multirank
def test_a_stage_that_dies_stops_every_rank(plans: dict[int, Path]) -> None:
    code, _, err, took = _run([str(plans[2]), "--steps", "3"], {"PIPEPLAN_FAIL": "1:1:kill"})
    assert code == 1 and took < 60
    assert "error: stage 1 died with exit code -9 (SIGKILL)" in err


@pytest.mark.multirank
def test_a_rank_aborting_in_teardown_after_the_run_loses_nothing(
    plans: dict[int, Path], tmp_path: Path
) -> None:
    """gloo's teardown can abort a rank after the run's last barrier ("terminate called
    without an active exception"): every rank had finished, so the run and its report stand,
    with a note."""
    report = tmp_path / "report.json"
    args = [str(plans[2]), "--steps", "2", "--report", str(report)]
    code, _, err, _ = _run(args, {"PIPEPLAN_FAIL": "1:0:teardown"})
    assert code == 0, err
    assert "after every rank finished the run (in its process group's teardown)" in err
    assert len(load_report(report).step_times_s) == 2


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


# Faults: one plan, saved every 5 steps.


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_plans(tmp_path_factory.mktemp("faults"))["gpipe"]


def _start(plan: Path, tmp_path: Path, *args: str, **popen: object) -> subprocess.Popen[str]:
    """``pipeplan run`` of many steps saving every 5 into ``tmp_path/save``; the launcher's run
    folder (the heartbeats) under ``tmp_path``.  Returns once the first save is complete."""
    cmd = [*PIPEPLAN, "run", str(plan), "--quiet", "--warmup", "0", "--steps", "100000",
           "--optimizer", "adam", "--save-every", "5", "--save", str(tmp_path / "save"), *args]  # fmt: skip
    env = {**ENV, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, **popen)  # type: ignore[call-overload]  # fmt: skip
    wait_for(lambda: (tmp_path / "save" / "latest").exists() or proc.poll() is not None)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    return proc  # type: ignore[no-any-return]


def _stopped(proc: subprocess.Popen[str], tmp_path: Path, what: str) -> tuple[str, float]:
    """Wait for the job after a fault sent at this moment: (stderr, seconds to stop); checks
    that nothing is left and that the last complete save reads whole."""
    start = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - start
    print(f"\n{what}: stopped in {took:.1f} s, status {proc.returncode}: {err.strip()}")
    assert not survivors(str(tmp_path))
    assert state(tmp_path / "save")  # the latest save is complete and whole
    return err, took


@pytest.mark.multirank
def test_sigterm_to_pipeplan_run_ends_every_process(plan: Path, tmp_path: Path) -> None:
    proc = _start(plan, tmp_path)
    proc.send_signal(signal.SIGTERM)
    err, took = _stopped(proc, tmp_path, "SIGTERM to pipeplan run")
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM at step" in err and len(err.strip().splitlines()) == 1
    assert took < 10


@pytest.mark.multirank
def test_sigint_to_the_process_group_ends_every_process(plan: Path, tmp_path: Path) -> None:
    proc = _start(plan, tmp_path, start_new_session=True)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
    err, took = _stopped(proc, tmp_path, "SIGINT to the process group")
    assert proc.returncode == 128 + signal.SIGINT
    assert "stopped by SIGINT at step" in err and len(err.strip().splitlines()) == 1
    assert took < 10


@pytest.mark.multirank
def test_a_stopped_rank_ends_the_job_within_the_timeout(plan: Path, tmp_path: Path) -> None:
    timeout = 6.0
    proc = _start(plan, tmp_path, "--timeout", str(timeout))
    target = beat(tmp_path, 1)
    assert target is not None
    os.kill(target[0], signal.SIGSTOP)
    err, took = _stopped(proc, tmp_path, f"SIGSTOP of rank 1 (--timeout {timeout:.0f})")
    assert proc.returncode == 1
    assert "stage 1 (rank 1) stopped making progress" in err
    assert timeout - 1 < took < timeout + 8


@pytest.fixture(scope="module")
def full_disk(plan: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, float]:
    """A run whose stage 1 finds the disk full in the save of step 2: (save, result, seconds)."""
    tmp = tmp_path_factory.mktemp("enospc")
    save = tmp / "save"
    env = {**ENV, "PIPEPLAN_FAIL": "1:2:enospc"}
    cmd = [*PIPEPLAN, "run", str(plan), "--quiet", "--warmup", "0", "--steps", "4",
           "--optimizer", "adam", "--save-every", "1", "--save", str(save)]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=120)
    took = time.monotonic() - start
    print(f"\nENOSPC in stage 1's save: stopped after {took:.1f} s: {proc.stderr.strip()}")
    assert not survivors(str(tmp))
    return save, proc, took


@pytest.mark.multirank
def test_a_full_disk_during_a_save_names_the_stage_and_keeps_the_last_save(
    full_disk: tuple[Path, Any, float],
) -> None:
    save, proc, _ = full_disk
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(
        "error: stage 1 (rank 1) could not write its part of the save of step 2 into "
    )
    assert "save/.partial-step-000002: No space left on device (injected" in proc.stderr
    assert proc.stderr.strip().endswith("is kept (stage 0 stopped as a consequence)")
    assert proc.stderr.count("stage 1") == 1 and "Errno" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert (save / "latest").read_text().strip() == step_name(1)
    assert sorted(p.name for p in save.iterdir()) == ["latest", step_name(1)]  # no partial
    assert state(save)
    manifest = json.loads((save / step_name(1) / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["optimizer"] == "adam"


@pytest.mark.multirank
@pytest.mark.parametrize("damage", ["corrupted", "truncated", "incomplete"])
def test_a_damaged_save_is_refused_before_launch_naming_the_file(
    plan: Path,
    full_disk: tuple[Path, Any, float],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    save = tmp_path / "save"
    shutil.copytree(full_disk[0], save)
    shard = save / step_name(1) / shard_name(0, 2)
    data = bytearray(shard.read_bytes())
    if damage == "corrupted":
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        expected = f"{shard} is corrupted"
    elif damage == "truncated":
        shard.write_bytes(bytes(data[:-9]))
        expected = f"{shard} is truncated"
    else:
        (save / step_name(1) / "manifest.json").unlink()
        expected = f"{save / step_name(1)} is incomplete"
    with pytest.raises(SystemExit) as exc:
        main(["run", str(plan), "--steps", "1", "--optimizer", "adam", "--resume", str(save)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expected in " ".join(err.split()) and len(err.strip().splitlines()) <= 2


@pytest.mark.multirank
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_the_job_ends_with_its_launcher(plan: Path, tmp_path: Path, sig: signal.Signals) -> None:
    """SIGKILL of ``pipeplan run`` (the OOM killer) or SIGHUP (a closed terminal): torchrun and
    the ranks end within 10 s and ``latest`` stops moving.  While the job runs, a ``--resume``
    into its save folder is refused naming the launcher's pid."""
    proc = _start(plan, tmp_path)
    save = tmp_path / "save"
    if sig == signal.SIGHUP:
        cmd = [*PIPEPLAN, "run", str(plan), "--quiet", "--steps", "1", "--optimizer", "adam",
               "--resume", str(save), "--save", str(save)]  # fmt: skip
        refused = subprocess.run(cmd, check=False, capture_output=True, text=True, env=ENV,
                                 timeout=120)  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        assert f"a run still writes {save} (pid {proc.pid} on host" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    proc.send_signal(sig)
    start = time.monotonic()
    _, err = proc.communicate(timeout=60)
    wait_for(lambda: not survivors(str(tmp_path)), timeout=10.0)
    took = time.monotonic() - start
    print(f"\n{sig.name} to pipeplan run: nothing left after {took:.1f} s: {err.strip()[-300:]}")
    assert took < 10
    folders = sorted(p.name for p in save.iterdir())
    latest = (save / "latest").read_text()
    time.sleep(2.0)  # nothing writes the folder any more
    assert sorted(p.name for p in save.iterdir()) == folders
    assert (save / "latest").read_text() == latest
    assert state(save)  # the latest save is complete and whole
    if sig == signal.SIGHUP:
        assert proc.returncode == 128 + signal.SIGHUP
        assert "stopped by SIGHUP at step" in err and len(err.strip().splitlines()) == 1
        assert not [f for f in folders if f.startswith(".")]  # no partial save, no lock
    else:
        assert proc.returncode == -signal.SIGKILL
        from pipeplan.runtime.save_lock import check_free

        check_free("--resume", save)  # the dead job's lock is stale: a resume may start


@pytest.mark.multirank
def test_sigkill_of_torchrun_ends_every_rank_in_one_line(plan: Path, tmp_path: Path) -> None:
    proc = _start(plan, tmp_path)
    # torchrun's agent is pipeplan run's child; its ranks are its forks, with its command line
    agents = [pid for pid in live_processes(str(tmp_path)) if parent_pid(pid) == proc.pid]
    assert len(agents) == 1
    os.kill(agents[0], signal.SIGKILL)
    err, took = _stopped(proc, tmp_path, "SIGKILL of torchrun")
    assert proc.returncode == 1
    assert err.strip() == "error: torchrun ended by SIGKILL; every rank ended"
    assert took < 10


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 72 KiB tmpfs: one save of the test model (48 KiB in pages), its ``latest`` and
    the run's lock fit, a second save does not."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=72k", "tmpfs", str(mnt)],
                           check=False, capture_output=True, text=True)  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mount.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.multirank
def test_a_real_full_disk_is_one_line_and_leaves_the_disk_as_it_was(
    plan: Path, small_disk: Path
) -> None:
    save = small_disk / "save"
    cmd = [*PIPEPLAN, "run", str(plan), "--quiet", "--warmup", "0", "--steps", "4",
           "--optimizer", "adam", "--save-every", "1", "--save", str(save)]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=ENV, timeout=180)
    print(f"\na real full disk: stopped after {time.monotonic() - start:.1f} s: {proc.stderr}")
    assert not survivors(str(save))
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert (
        f"could not write its part of the save of step 2 into {save}/.partial-step-000002: " in err
    )
    assert "No space left on device; the last complete save in" in err
    assert sorted(p.name for p in save.iterdir()) == ["latest", step_name(1)]  # no partial
    assert (save / "latest").read_text().strip() == step_name(1)
    assert state(save)
    used = shutil.disk_usage(small_disk).used
    assert used <= 56 * 1024  # the first save, latest and nothing else: the disk was freed


@pytest.mark.multirank
def test_a_multi_chunk_failure_names_the_rank_and_its_chunks(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """ZB-V on 2 ranks: rank 0 holds stages 0 and 3; its full disk names both (issue 45)."""
    tmp = tmp_path_factory.mktemp("zbv")
    plan = write_plans(tmp)["zbv"]
    cmd = [*PIPEPLAN, "run", str(plan), "--quiet", "--warmup", "0", "--steps", "2",
           "--optimizer", "adam", "--save-every", "1", "--save", str(tmp / "save")]  # fmt: skip
    env = {**ENV, "PIPEPLAN_FAIL": "0:2:enospc"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(
        "error: rank 0 (stages 0 and 3) could not write its part of the save of step 2 into "
    )
    assert proc.stderr.strip().endswith("is kept (rank 1 stopped as a consequence)")
    assert not survivors(str(tmp))
