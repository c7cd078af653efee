"""One live job per save folder (:mod:`pipeplan.runtime.save_lock`): a live owner is refused
naming its pid and host, a dead one's lock is taken over, and taking it removes the partial
saves a dead job left."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.runtime.save_lock import LOCK, check_free, hold
from pipeplan.runtime.supervise import process_start


def _lock(folder: Path, pid: int, start: int | None, host: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"pid": pid, "host": host or socket.gethostname(), "start": start}
    (folder / LOCK).write_text(json.dumps(data))


def test_a_live_owner_is_refused_and_a_dead_one_taken_over(tmp_path: Path) -> None:
    save = tmp_path / "save"
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(save, owner.pid, process_start(owner.pid))
        with pytest.raises(InvalidRequestError) as exc:
            check_free("--resume", save / "step-000002")  # a step folder: its parent's lock
        assert f"a run still writes {save} (pid {owner.pid} on host " in str(exc.value)
        with pytest.raises(InvalidRequestError), hold(save):
            pass
        _lock(save, owner.pid, 12345)  # the pid, reused by another process: stale
        check_free("--save", save)
    finally:
        owner.kill()
        owner.wait()
    _lock(save, owner.pid, process_start(owner.pid))  # its owner ended: stale
    (save / ".partial-step-000004").mkdir()
    (save / ".partial-step-000004" / "train-00000-of-00002.pt").write_bytes(b"x")
    with hold(save):
        assert json.loads((save / LOCK).read_text())["pid"] != owner.pid
        assert not (save / ".partial-step-000004").exists()
    assert not (save / LOCK).exists()


def test_a_lock_from_another_host_is_taken_as_live(tmp_path: Path) -> None:
    _lock(tmp_path, 1, None, host="elsewhere")
    with pytest.raises(InvalidRequestError, match=r"\(pid 1 on host elsewhere\); .* remove "):
        check_free("--save", tmp_path)


def test_what_a_killed_save_left_goes_when_the_job_ends(tmp_path: Path) -> None:
    """A rank killed inside a save (a SIGHUP to ``pipeplan run`` between the pointer's write
    and its rename, seen in CI) leaves ``.latest.tmp`` and perhaps a ``.partial-`` folder:
    the launcher removes them once its ranks are gone, and a dead job's at the next start.
    The complete saves, ``latest`` and a repeated step's ``.old-`` copy stay."""
    root = tmp_path / "save"
    (root / ".partial-step-000001-a").mkdir(parents=True)
    (root / ".latest.tmp").write_text("step-000001\n")
    with hold(root):
        assert not (root / ".partial-step-000001-a").exists()
        assert not (root / ".latest.tmp").exists()
        (root / "step-000001").mkdir()
        (root / "latest").write_text("step-000001\n")
        (root / ".old-step-000001-b").mkdir()
        (root / ".partial-step-000002-c").mkdir()
        (root / ".latest.tmp").write_text("step-000002\n")  # killed before the rename
    assert sorted(p.name for p in root.iterdir()) == [
        ".old-step-000001-b", "latest", "step-000001"
    ]  # fmt: skip
