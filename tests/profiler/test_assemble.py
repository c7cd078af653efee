"""pipeplan.profiler.assemble: the one constructor of a Profile, which both methods call."""

from __future__ import annotations

import torch
from torch import nn

from pipeplan.intake.trace import trace_model
from pipeplan.planner.types import Timing
from pipeplan.profiler.assemble import Recipe, assemble_profile, split_model


def test_assemble_profile_copies_units_cuts_and_the_last_update_point() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    example = (torch.randn(2, 4),)
    traced = trace_model(module, example, "fx")
    split = split_model(traced, example, "top", 4)
    values = {n.name: torch.zeros(2, 4) for n in traced.gm.graph.nodes if n.op != "output"}
    timing = Timing(forward_s=1e-3, backward_s=2e-3, saved_bytes=32, output_bytes=32)
    n = len(split.pieces)
    recipe = Recipe(
        model="m:f",
        model_kwargs={},
        dtype="float32",
        batch_size=2,
        sizes=(1, 2),
        granularity="top",
        warmup=1,
        repeats=1,
        rounds=1,
    )
    prof = assemble_profile(
        recipe,
        split,
        module=module,
        dev=torch.device("cpu"),
        values=values,
        timings=[{1: timing, 2: timing}] * n,
        loss={2: timing},
        update_curve={"sgd": ((16, 1e-5), (80, 4e-5))},
        call_s=(1e-6, 2e-6),
        method="units",
        measured_as=[0] * n,
    )
    assert prof.n_units == n == len(prof.cuts) + 1 == 4 and prof.grouping is None
    assert split.placeholders == [n.name for n in traced.gm.graph.nodes][:1]
    assert [u.measured_as for u in prof.units] == [None] + [0] * (n - 1)
    assert prof.update_s == {"sgd": 4e-5}
    assert prof.input_bytes_per_sample == 16  # 4 float32 per sample
    assert prof.method == "units" and prof.model_sha256 is None
