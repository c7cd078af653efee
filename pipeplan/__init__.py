"""pipeplan: automatic pipeline-partition planning for PyTorch.

The packages: :mod:`pipeplan.profiler` measures a model's units, :mod:`pipeplan.solvers`
chooses the cuts and the micro-batch count, :mod:`pipeplan.planner` holds the shared types, the
cost model, the simulator and the plan file, and :mod:`pipeplan.runtime` runs a plan on
``torch.distributed.pipelining``.  :mod:`pipeplan.models` holds the bundled example models.
"""
