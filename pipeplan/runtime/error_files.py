"""The ranks' error files: how a failed rank tells ``pipeplan run`` what stopped it.

A rank that raises writes ``error-<rank>.json`` into the run folder (:func:`write_error`:
stage, step, error, traceback, whether a peer's failure caused it and whether its message
already names the stage) before it exits; :func:`pipeplan.runtime.launch.failure` reads them
all (:func:`read_errors`) and names the rank that failed first, with the ranks stopped as a
consequence.

Two orders matter, because torchrun's agent stops every rank once it sees one end:

- a rank whose error a peer caused (a closed link, :func:`is_peer_error`) waits
  :data:`PEER_LINGER_S` after writing its file, so the agent sees the culprit end first;
- a rank whose error every rank learnt in one collective (its ``collective`` attribute: a
  save that one rank could not write, all of them raise together) waits, at most :data:`AWAIT_PEERS_S`, for the others'
  files before it exits (:func:`await_errors`), so the agent does not stop a peer before it
  wrote that it stopped as a consequence.

Files are written to a temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = [
    "AWAIT_PEERS_S",
    "PEER_LINGER_S",
    "any_error",
    "await_errors",
    "is_peer_error",
    "read_errors",
    "write_error",
]

#: Seconds a rank whose error a peer's death caused waits before it exits.
PEER_LINGER_S = 1.0

#: The most seconds a rank waits for its peers' error files after an error they all learnt;
#: under :data:`pipeplan.runtime.supervise.GRACE_S`, after which ``pipeplan run`` kills them.
AWAIT_PEERS_S = 2.0

_POLL_S = 0.02
_GLOB = "error-*.json"


def _path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"error-{rank}.json"


def any_error(run_dir: Path) -> bool:
    """Whether some rank wrote its error file in ``run_dir``."""
    return any(run_dir.glob(_GLOB))


def is_peer_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a consequence of another rank failing (a closed or timed-out link)."""
    import torch.distributed as dist

    if getattr(exc, "peer", False):
        return True
    text = str(exc).lower()
    peer_words = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout")
    return isinstance(exc, dist.DistError) or any(w in text for w in peer_words)


def _traceback(exc: BaseException) -> str:
    """The exception being handled, whole (the chain from the rank's entry), where there is
    one; else ``exc``'s own."""
    if sys.exc_info()[1] is not None:
        return traceback.format_exc()
    return "".join(traceback.format_exception(exc))


def write_error(
    run_dir: Path, rank: int, step: int | None, exc: BaseException, request: bool
) -> None:
    """Write rank ``rank``'s error file: ``exc`` at ``step`` (``None`` before the first);
    ``request``: the request was refused before the pipeline started (exit 2)."""
    data = {
        "request": request,
        "rank": rank,
        "stage": rank,
        "step": step,
        "type": type(exc).__name__,
        "message": " ".join(str(exc).split())[:2000],
        "peer": is_peer_error(exc),
        "located": bool(getattr(exc, "located", False)),
        "time": time.time(),
        "traceback": _traceback(exc),
    }
    path = _path(run_dir, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def read_errors(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's error file in ``run_dir``, by rank; an unreadable one is skipped."""
    out = []
    for path in run_dir.glob(_GLOB):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(out, key=lambda e: int(e.get("rank", -1)))


def await_errors(run_dir: Path, world: int, timeout_s: float = AWAIT_PEERS_S) -> bool:
    """Wait until every one of the ``world`` ranks wrote its error file, at most ``timeout_s``
    seconds; whether they all did."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(_path(run_dir, r).exists() for r in range(world)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
