"""pipeplan: automatic pipeline-partition planning for PyTorch.

Profile a model, plan where to cut it and how many micro-batches to run, then run the plan
(``pipeplan run``) or take this rank's stage into a training loop of your own::

    import pipeplan

    prof = pipeplan.profile("pipeplan.models.gpt:gpt", batch_size=32)
    plan = pipeplan.plan(prof, stages=4, memory="256MiB")
    pipeplan.save(plan, "plan.json")

    # on every rank, under torchrun --nproc-per-node 4, after init_process_group():
    split = pipeplan.split("plan.json")
    module, stage = split                 # nn.Module, torch.distributed.pipelining.PipelineStage

The packages, in the order data flows through them: :mod:`pipeplan.intake` loads a user's
model (:class:`ModelSpec`) and traces it into units, :mod:`pipeplan.profiler` measures them,
:mod:`pipeplan.solvers` chooses the cuts and the micro-batch count, :mod:`pipeplan.runtime` runs
a plan on ``torch.distributed.pipelining``, :mod:`pipeplan.report` draws and tabulates profiles
and plans (``pipeplan.plots``, ``pipeplan.timeline_plots``), and :mod:`pipeplan.export` writes a
plan for torchtitan, Megatron-LM and DeepSpeed.  :mod:`pipeplan.planner` is the ground they all
stand on: the shared types, the cost model, the simulator and the plan file.
:mod:`pipeplan.models` holds the bundled example models.  The command line
(:mod:`pipeplan.cli`) stands on top of them all.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pipeplan import _compat

if TYPE_CHECKING:
    from pipeplan.api import calibration, load, make_cluster, plan, profile, save, split
    from pipeplan.intake.spec import ModelSpec
    from pipeplan.planner.errors import InfeasiblePlanError, PipeplanError
    from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile, RunReport

__all__ = [
    "Cluster",
    "InfeasiblePlanError",
    "ModelSpec",
    "PipeplanError",
    "Plan",
    "PlanOptions",
    "Profile",
    "RunReport",
    "calibration",
    "load",
    "make_cluster",
    "plan",
    "profile",
    "save",
    "split",
]

#: Every public name, loaded on first use from the module that defines it: ``import pipeplan``
#: imports neither torch nor pandas, so the command line starts at once.  The views
#: ``pipeplan.plots`` and ``pipeplan.timeline_plots`` are modules (they import matplotlib).
_LAZY = {
    **dict.fromkeys(
        ("Cluster", "Plan", "PlanOptions", "Profile", "RunReport"), "pipeplan.planner.types"
    ),
    **dict.fromkeys(("InfeasiblePlanError", "PipeplanError"), "pipeplan.planner.errors"),
    "ModelSpec": "pipeplan.intake.spec",
    **dict.fromkeys(
        ("calibration", "load", "make_cluster", "plan", "profile", "save", "split"), "pipeplan.api"
    ),
}
_VIEWS = {"plots": "pipeplan.report.plots", "timeline_plots": "pipeplan.report.timeline_plots"}


def __getattr__(name: str) -> Any:
    if name in _VIEWS:
        return importlib.import_module(_VIEWS[name])
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next use does not come here
        return value
    raise AttributeError(f"module 'pipeplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _TorchvisionOps(importlib.abc.MetaPathFinder):
    """Defines torchvision's missing op schemas (:mod:`pipeplan.intake.torchvision_ops`) just
    before torchvision is first imported, by anyone (transformers, timm, a user's model), in a
    process that imported pipeplan, then leaves the import to the other finders.  So every
    such process can import them, as when ``import pipeplan`` defined the ops itself, without
    importing torch before it is needed."""

    done = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" and not self.done:
            self.done = True  # first: define_missing_ops looks torchvision up itself
            from pipeplan.intake.torchvision_ops import define_missing_ops

            define_missing_ops()
        return None


if "torchvision" not in sys.modules:
    sys.meta_path.insert(0, _TorchvisionOps())

_compat.install()
