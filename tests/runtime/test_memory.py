"""A model larger than one rank's memory budget trains on two ranks (issue 22's demonstration).

The MLP below holds 4 x 385 MiB of training state (parameters, gradients and Adam's two
states): 1.5 times the 1 GiB budget each rank is given.  ``pipeplan plan`` splits it into two
stages that fit the budget, and ``pipeplan run`` trains it with each rank building the model
on ``meta`` and materializing only its stage.  Each rank's measured peak (its live tensors,
:mod:`pipeplan.runtime.memory`) stays within its stage's predicted memory plus ``TRACKED_SLACK``, and
its resident growth (everything the process maps: tensors, the heap around them, the graph,
the communication buffers) within the prediction plus ``RESIDENT_OVERHEAD`` and well under the
whole model's training state.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeplan.planner.io import load_plan, load_report

pytestmark = pytest.mark.multirank

MiB = 1 << 20
WIDTH, DEPTH = 4096, 6
MODEL = ["pipeplan.models.mlp:mlp", "--model-arg", f"width={WIDTH}", "--model-arg", f"depth={DEPTH}",
         "--model-arg", f"in_features={WIDTH}"]  # fmt: skip
#: Parameters, gradients and Adam's two states of the whole model.
STATE = 4 * 4 * (DEPTH * (WIDTH * WIDTH + WIDTH) + 10 * (WIDTH + 1))
BUDGET = STATE * 2 // 3
#: What a rank's tracked peak may exceed its prediction by: the loss's scalars and the
#: engine's bookkeeping.
TRACKED_SLACK = 2 * MiB
#: What a rank maps beyond its predicted tensors: the heap around the tensors, the traced graph, the process group's buffers and the profiler that tracks the
#: measured step (40-190 MiB in ``benchmarks/memory``).
RESIDENT_OVERHEAD = 256 * MiB
PIPEPLAN = [sys.executable, "-c", "from pipeplan.cli import main; main()"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args: str, cwd: Path) -> None:
    proc = subprocess.run(
        [*PIPEPLAN, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_model_of_one_and_a_half_budgets_trains_on_two_ranks(tmp_path: Path) -> None:
    _cli("profile", *MODEL, "-b", "8", "--microbatch-sizes", "2", "--warmup", "0",
         "--repeats", "1", "--max-stages", "2", "-o", "p.json", cwd=tmp_path)  # fmt: skip
    # GPipe: the closed form's memory holds to the MiB; the multi-chunk families' replayed
    # peaks are within 11 % (benchmarks/memory), too loose for a budget this tight.
    _cli("plan", "p.json", "--stages", "2", "--memory", str(BUDGET), "--microbatches", "4",
         "--schedule", "gpipe", "-o", "plan.json", cwd=tmp_path)  # fmt: skip
    plan = load_plan(tmp_path / "plan.json")
    assert STATE > 1.45 * BUDGET
    assert all(s.feasible and s.memory.total <= BUDGET for s in plan.stages)
    _cli("run", "plan.json", "--warmup", "2", "--steps", "1", "--report", "r.json", cwd=tmp_path)
    measured = load_report(tmp_path / "r.json").stages
    for stage, rank in zip(plan.stages, measured, strict=True):
        assert rank.peak_memory_bytes is not None and rank.resident_growth_bytes is not None
        predicted = stage.memory.total
        # Within the prediction: a prediction far above the measurement fails too.
        assert 0.9 * predicted <= rank.peak_memory_bytes <= predicted + TRACKED_SLACK
        assert rank.resident_growth_bytes <= predicted + RESIDENT_OVERHEAD
        assert rank.resident_growth_bytes < 0.8 * STATE
