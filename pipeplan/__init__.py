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

from types import ModuleType

from pipeplan.intake.torchvision_ops import define_missing_ops

define_missing_ops()  # before anything imports torchvision (transformers, timm): see its module

from pipeplan import _compat
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

_compat.install()

#: Views loaded on first use (they import matplotlib): ``pipeplan.plots.compare_figure``,
#: ``pipeplan.timeline_plots.gantt``.
_LAZY = {"plots": "pipeplan.report.plots", "timeline_plots": "pipeplan.report.timeline_plots"}


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY:
        import importlib

        return importlib.import_module(_LAZY[name])
    raise AttributeError(f"module 'pipeplan' has no attribute {name!r}")
