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

The packages: :mod:`pipeplan.profiler` measures a model's units, :mod:`pipeplan.solvers`
chooses the cuts and the micro-batch count, :mod:`pipeplan.planner` holds the shared types, the
cost model, the simulator and the plan file, :mod:`pipeplan.runtime` runs a plan on
``torch.distributed.pipelining``, and :mod:`pipeplan.models` holds the bundled example models.
The command line (:mod:`pipeplan.cli`) stands on top of them all.
"""

from pipeplan.api import calibration, load, make_cluster, plan, profile, save, split
from pipeplan.planner.errors import InfeasiblePlanError, PipeplanError
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile, RunReport

__all__ = [
    "Cluster",
    "InfeasiblePlanError",
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
