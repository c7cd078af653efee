"""Supervising a torchrun job from ``pipeplan run``: signals forwarded, stalls found, no orphans.

torchrun (``torch.distributed.run``) starts each rank in a session of its own
(``start_new_session``), so a signal sent to ``pipeplan run`` or to its terminal's process group
never reaches the ranks, and when torchrun itself is stopped it asks them to end with SIGTERM
and waits 30 s before SIGKILL.  A stopped (SIGSTOP) or frozen rank does not act on SIGTERM.
:func:`supervise` therefore watches the job itself, every quarter second:

- **a signal** (SIGTERM from a scheduler, SIGINT from Ctrl-C, SIGHUP from a closed terminal)
  received by ``pipeplan run`` is
  forwarded to torchrun and to every rank; whatever is still alive 3 s later is killed
  (SIGKILL); the job ends as :class:`Outcome` ``signal`` with the step rank 0 was at;
- **a stall**: each rank's heartbeat thread rewrites ``beat-<rank>`` every 0.5 s
  (:mod:`pipeplan.runtime.worker`).  A rank blocked on a peer still beats; a rank that is
  stopped or frozen does not.  A rank silent for ``timeout_s`` (``--timeout``, the process
  groups' timeout too) stops the job, naming it; so does the collective timeout, whichever
  comes first;
- **a failure**: once a rank has written its error file, the others get 3 s to end (torchrun
  stops them), then are killed, so a stopped peer does not hold the job for torchrun's 30 s;
- **torchrun killed** (SIGKILL): its ranks, left without an agent, end by their own watchdog
  (:mod:`pipeplan.runtime.worker`); whatever is left after 3 s is killed.

What :func:`supervise` cannot do is outlive ``pipeplan run`` itself.  For that torchrun is
started with a parent-death signal (SIGTERM, Linux ``prctl``: :func:`die_with_parent`), on
which it stops its ranks, and each rank's watchdog ends it when the launcher's pid is gone or
its own parent changed; so a ``pipeplan run`` killed with SIGKILL (the OOM killer) leaves
nothing running within a second or two.

The ranks' pids come from their heartbeat files; a pid is signalled only while its command
line is still a ``pipeplan.runtime.worker``.  torchrun's own signal handling (SIGTERM to each
rank, then SIGKILL) is kept as the first resort; this module only adds the deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeplan.runtime.error_files import any_error

__all__ = [
    "STOP_SIGNALS",
    "Beat",
    "Outcome",
    "beats",
    "die_with_parent",
    "forwarded_signals",
    "live_processes",
    "parent_pid",
    "process_start",
    "supervise",
]

#: The signals that stop a job: a scheduler's, Ctrl-C, a closed terminal.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

#: Seconds the ranks get to end after a signal or a failure before they are killed.
GRACE_S = 3.0
#: A rank whose heartbeat is older than this when the job fails is taken as stopped or frozen.
FROZEN_S = 3.0


@dataclass(frozen=True)
class Beat:
    """A rank's last heartbeat: its pid, the step it was at, when (``time.time()``)."""

    pid: int
    step: int | None
    time: float


def beats(run_dir: Path, n_ranks: int) -> dict[int, Beat]:
    """The heartbeats the ranks have written so far."""
    out = {}
    for rank in range(n_ranks):
        try:
            pid, step, t = json.loads((run_dir / f"beat-{rank}").read_text())
        except (OSError, ValueError, TypeError):
            continue
        out[rank] = Beat(int(pid), None if step is None else int(step), float(t))
    return out


def _command_line(pid: int) -> str | None:
    """The command line of process ``pid`` (arguments joined by spaces), ``None`` when it is
    gone, a zombie or dead (Linux ``/proc``)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else cmdline.replace(b"\0", b" ").decode(errors="replace")


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, Linux ``/proc``), ``None`` when it
    is gone or a zombie: with the pid, it names one process even after the pid is reused."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux ``/proc``), ``None`` when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send the child ``sig`` when this process (its
    parent) ends (Linux ``PR_SET_PDEATHSIG``; ``None`` elsewhere).  Everything it needs is
    looked up here, before the fork: the child only calls ``prctl``, ``getppid`` and ``kill``
    (no import, no lock), which is what makes a ``preexec_fn`` safe in a process with threads."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent, getpid, getppid, kill = os.getpid(), os.getpid, os.getppid, os.kill

    def arm() -> None:
        prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        if getppid() != parent:  # the parent ended before the signal was armed
            kill(getpid(), sig)

    return arm


def live_processes(marker: str) -> dict[int, str]:
    """pid -> command line of every live process but this one whose command line contains
    ``marker`` (a run's folder, say): what a stopped job may have left behind. A process in
    the middle of ``exec`` reads an empty command line for a moment and is missed: poll when
    looking for one just started."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            cmdline = _command_line(int(proc.name))
            if cmdline is not None and marker in cmdline:
                found[int(proc.name)] = cmdline
    return found


def _is_rank(pid: int) -> bool:
    """Whether ``pid`` is alive and still a pipeplan worker (not a reused pid)."""
    cmdline = _command_line(pid)
    return cmdline is not None and "pipeplan.runtime.worker" in cmdline


@dataclass
class Outcome:
    """How the job ended: torchrun's exit status (``None`` if it was killed), the signal that
    stopped it, the ranks that were stopped or frozen (rank -> seconds without a heartbeat,
    measured when the job ended or stalled) and the step rank 0 was at."""

    code: int | None
    signal: int | None = None
    frozen: dict[int, float] = field(default_factory=dict)
    step: int | None = None
    stalled: bool = False
    agent_killed: bool = False
    """torchrun itself was ended by a signal (``-code``); its ranks were ended after it."""


@contextlib.contextmanager
def forwarded_signals() -> Iterator[list[int]]:
    """Catch SIGTERM, SIGINT and SIGHUP while the job runs: the list receives each signal
    number (the main thread only; elsewhere nothing is caught)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def handler(signum: int, _frame: Any) -> None:
        received.append(signum)

    for s in previous:
        signal.signal(s, handler)
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _stop(proc: subprocess.Popen[Any], pids: list[int], sig: int | None) -> int | None:
    """Send ``sig`` to torchrun and the ranks, wait ``GRACE_S``, then SIGKILL what is left;
    ``sig=None`` skips to the wait (torchrun is already stopping them)."""
    if sig is not None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        for pid in pids:
            if _is_rank(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and (proc.poll() is None or any(_is_rank(p) for p in pids)):
        time.sleep(0.05)
    for pid in pids:
        if _is_rank(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    return None if sig is not None else proc.returncode


def supervise(
    proc: subprocess.Popen[Any],
    run_dir: Path,
    n_ranks: int,
    poll: Callable[[], None],
    timeout_s: float,
    received: list[int],
) -> Outcome:
    """Watch the job until it ends (module docstring), calling ``poll`` every quarter second
    and once after it ends."""
    failed_at: float | None = None
    while True:
        try:
            code: int | None = proc.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            code = None
        poll()
        now = time.time()
        seen = beats(run_dir, n_ranks)
        pids = [b.pid for b in seen.values()]
        step = seen[0].step if 0 in seen else None
        silent = {r: now - b.time for r, b in seen.items() if _is_rank(b.pid)}
        if code is not None and code < 0:  # torchrun itself was killed: end its ranks
            _stop(proc, pids, None)
            return Outcome(code, signal=None, step=step, agent_killed=True)
        if code is not None:
            return Outcome(code, step=step)
        if received:
            _stop(proc, pids, received[0])
            return Outcome(None, signal=received[0], step=step)
        stalled = {r: age for r, age in silent.items() if age > timeout_s}
        if stalled:
            _stop(proc, pids, signal.SIGKILL)
            return Outcome(None, frozen=stalled, step=step, stalled=True)
        if failed_at is None and any_error(run_dir):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            frozen = {r: age for r, age in silent.items() if age > FROZEN_S}
            return Outcome(_stop(proc, pids, None), frozen=frozen, step=step)
