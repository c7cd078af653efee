"""One live job per save folder: a lock file naming its owner, checked for liveness.

``pipeplan run --save DIR`` holds ``DIR/.pipeplan-lock`` (JSON: the launcher's pid, its host
and its start time) while the job runs (:func:`hold`).  A second ``run`` whose ``--save`` or
``--resume`` names that folder is refused in one line naming the pid and the host
(:func:`check_free`), since its ranks would race the live job's ``latest``.  A lock whose
owner is gone (killed, so it could not remove it) is stale and taken over; so is it when the
pid now belongs to another process (its start time differs).  Until the ranks of a killed
launcher have ended too (within a second: :mod:`pipeplan.runtime.worker`'s watchdog), their
``--save=DIR`` command lines keep the folder busy.

Taking the lock also removes what a dead job's cut-short save left (the ``.partial-step-N``
folders and the unrenamed ``latest`` pointer, :func:`pipeplan.runtime.snapshots.remove_partials`):
no live job writes into the folder then; so does releasing it, once the job's ranks have ended.

A lock written on another host cannot be checked from here; it is taken as live, and the
message says to remove it once that job has ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.runtime.snapshots import remove_partials
from pipeplan.runtime.supervise import live_processes, process_start

__all__ = ["LOCK", "check_free", "hold"]

LOCK = ".pipeplan-lock"


def _owner(folder: Path) -> str | None:
    """``pid P on host H`` of the live job that holds ``folder``, or ``None``."""
    try:
        data = json.loads((folder / LOCK).read_text())
        pid, host, start = int(data["pid"]), str(data["host"]), data.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        data = None
    if data is not None:
        if host != socket.gethostname():
            return f"pid {pid} on host {host}"
        if pid != os.getpid() and process_start(pid) is not None and process_start(pid) == start:
            return f"pid {pid} on host {host}"
    marker = f"--save={folder}"
    ranks = sorted(
        pid for pid, cmd in live_processes(marker).items() if f"{marker} " in f"{cmd} "
    )  # the ranks of a launcher that was killed, not yet ended by their watchdog
    if ranks:
        return f"pid {ranks[0]} on host {socket.gethostname()}"
    return None


def check_free(option: str, path: str | os.PathLike[str]) -> None:
    """Refuse ``option path`` (``--save``, ``--resume``) while a live job writes the folder
    (``path`` or, for a step folder, its parent)."""
    p = Path(path).resolve()
    for folder in (p, p.parent):
        owner = _owner(folder)
        if owner is not None:
            raise InvalidRequestError(
                f"{option} {path}: a run still writes {folder} ({owner}); wait for it to end or "
                f"stop it, or remove {folder / LOCK} if that job has ended"
            )


@contextlib.contextmanager
def hold(folder: str | os.PathLike[str] | None) -> Iterator[None]:
    """Hold ``folder``'s lock while the job runs (nothing for ``None``); refuses a folder a
    live job holds, removes what a cut-short save left, on taking it and on release."""
    if folder is None:
        yield
        return
    root = Path(folder).resolve()
    check_free("--save", root)
    root.mkdir(parents=True, exist_ok=True)
    lock, tmp = root / LOCK, root / f"{LOCK}.{os.getpid()}"
    tmp.write_text(
        json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start(os.getpid())}
        )
    )
    os.replace(tmp, lock)
    remove_partials(root)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if json.loads(lock.read_text()).get("pid") == os.getpid():
                remove_partials(root)  # the job's ranks are gone: what a killed save left
                lock.unlink()
