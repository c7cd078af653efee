"""Execute a plan as a checkpointed GPipe (or 1F1B) pipeline on torch.distributed, and measure it.

    pipeplan run plan.json --steps 20 --report report.json --trace trace.json

starts one rank per stage on this machine (:mod:`pipeplan.runtime.launch`); each rank
(:mod:`pipeplan.runtime.worker`) cuts the traced model at the plan's boundaries (:mod:`pipeplan.runtime.stages`)
and runs its stage with ``torch.distributed.pipelining`` (:mod:`pipeplan.runtime.engine`); rank 0
writes the run report and a Chrome trace (:mod:`pipeplan.runtime.records`).  In a program,
:class:`PipelineRunner` runs one rank's stage inside an initialised process group.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeplan.runtime.engine import PipelineRunner
    from pipeplan.runtime.launch import preflight
    from pipeplan.runtime.stages import build_stages, check_plan

__all__ = ["PipelineRunner", "build_stages", "check_plan", "preflight"]

#: Where each export lives, imported on first use: the launcher (``pipeplan run``) needs
#: :mod:`~pipeplan.runtime.launch` alone (its ``launch``, which a package attribute would
#: confuse with the module), and the engine imports torch's pipelining (about 2 s), which
#: only the ranks use.
_HOME = {
    "PipelineRunner": "engine",
    "build_stages": "stages",
    "check_plan": "stages",
    "preflight": "launch",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipeplan.runtime.{_HOME[name]}"), name)
