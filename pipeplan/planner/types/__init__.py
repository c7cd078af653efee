"""The types that cross package boundaries: Profile, Cluster, Plan and RunReport.

These are the only coupling between ``profiler``, ``solvers`` and ``runtime``.  Each is a frozen
pydantic model, so a file read from disk is validated field by field and an error names the bad
field (see :mod:`pipeplan.planner.io`).  They live in one module per file kind (``profile``,
``cluster``, ``plan``, ``run_report``) on a common ``base``; import them from here.

Notation used throughout pipeplan:

    n = number of units (partition atoms, "layers"), u = 1..n in topological order
    p = number of stages (one device each), j = 0..p-1
    B = batch size, m = number of micro-batches, b = B / m = micro-batch size
    f_u(b), g_u(b) = forward / backward seconds of unit u at micro-batch size b
    a_u(b) = bytes saved for backward by unit u, w_u = parameter bytes of unit u
    x_k(b) = bytes live across the cut before unit k (x_0 = the model's inputs)
"""

from __future__ import annotations

from pipeplan.planner.types.base import (
    CLUSTER_SCHEMA,
    OPTIMIZER_STATES,
    OPTIMIZERS,
    PLAN_SCHEMA,
    PROFILE_SCHEMA,
    REPORT_SCHEMA,
    CheckpointPolicy,
    OptimizerName,
    ScheduleChoice,
    ScheduleName,
)
from pipeplan.planner.types.cluster import Cluster, Device, Link
from pipeplan.planner.types.plan import (
    MemoryBreakdown,
    Plan,
    PlanOptions,
    Stage,
    TiedSync,
    WeighedFamily,
)
from pipeplan.planner.types.profile import (
    Cut,
    CutTensor,
    DeviceInfo,
    Grouping,
    Profile,
    SharedParam,
    Timing,
    Unit,
    UnitTensorParallel,
)
from pipeplan.planner.types.run_report import RankMeasurement, RunReport, StageMeasurement

__all__ = [
    "CLUSTER_SCHEMA",
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "PLAN_SCHEMA",
    "PROFILE_SCHEMA",
    "REPORT_SCHEMA",
    "CheckpointPolicy",
    "Cluster",
    "Cut",
    "CutTensor",
    "Device",
    "DeviceInfo",
    "Grouping",
    "Link",
    "MemoryBreakdown",
    "OptimizerName",
    "Plan",
    "PlanOptions",
    "Profile",
    "RankMeasurement",
    "RunReport",
    "ScheduleChoice",
    "ScheduleName",
    "SharedParam",
    "Stage",
    "StageMeasurement",
    "TiedSync",
    "Timing",
    "Unit",
    "UnitTensorParallel",
    "WeighedFamily",
]
