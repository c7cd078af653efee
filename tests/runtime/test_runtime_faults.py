"""Faults during ``pipeplan run`` on 2 CPU ranks: each ends in bounded time, names the stage and
the cause, exits non-zero, leaves no process behind and keeps the last complete save.

- SIGTERM to ``pipeplan run`` (a scheduler's time limit) and SIGINT to its process group
  (Ctrl-C) are forwarded to torchrun and every rank; the job ends within seconds, status
  128 + the signal, and one line names the signal and the step.
- SIGKILL or SIGHUP of ``pipeplan run`` ends torchrun and every rank within seconds and
  ``latest`` stops moving; while the job runs, a ``--resume`` into its folder is refused naming
  the launcher's pid. SIGKILL of torchrun ends every rank, in one line.
- A rank stopped with SIGSTOP (a hung rank) ends the job within ``--timeout`` plus a margin,
  naming the stalled stage.
- A full disk during a save (``ENOSPC``, injected) names the stage that could not write it;
  so does a real one (a 72 KiB tmpfs, where the test may mount one), whose partial save is
  removed so the disk is freed.
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
from _resume_jobs import ENV, PIPEPLAN, beat, state, survivors, wait_for, write_plans

from pipeplan.cli import main
from pipeplan.runtime.checkpoint import shard_name
from pipeplan.runtime.snapshots import step_name
from pipeplan.runtime.supervise import live_processes

pytestmark = pytest.mark.multirank


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


def test_sigterm_to_pipeplan_run_ends_every_process(plan: Path, tmp_path: Path) -> None:
    proc = _start(plan, tmp_path)
    proc.send_signal(signal.SIGTERM)
    err, took = _stopped(proc, tmp_path, "SIGTERM to pipeplan run")
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM at step" in err and len(err.strip().splitlines()) == 1
    assert took < 10


def test_sigint_to_the_process_group_ends_every_process(plan: Path, tmp_path: Path) -> None:
    proc = _start(plan, tmp_path, start_new_session=True)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
    err, took = _stopped(proc, tmp_path, "SIGINT to the process group")
    assert proc.returncode == 128 + signal.SIGINT
    assert "stopped by SIGINT at step" in err and len(err.strip().splitlines()) == 1
    assert took < 10


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


def test_sigkill_of_torchrun_ends_every_rank_in_one_line(plan: Path, tmp_path: Path) -> None:
    proc = _start(plan, tmp_path)
    agents = [pid for pid, cmd in live_processes(str(tmp_path)).items()
              if "torch.distributed.run" in cmd]  # fmt: skip
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
