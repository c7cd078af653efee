"""GPipe and 1F1B steps on the step simulator, as the closed form's tests write them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeplan.planner.replay import ChunkCosts, Replay, replay


def one_chunk(
    fwd: Sequence[float],
    back: Sequence[float],
    comm: Sequence[float],
    m: int,
    schedule: str = "gpipe",
    update_s: Sequence[float] = (),
    **kw: Any,
) -> Replay:
    """The replay of one step of ``schedule`` with one chunk per rank, stage j's F_j, B_j, C_j
    and U_j given (torch's 1F1B needs m >= p); ``kw`` as :func:`replay` takes them."""
    return replay(schedule, len(fwd), 1, m, ChunkCosts(fwd, back, comm, update_s=update_s), **kw)
