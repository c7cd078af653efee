"""A partition's chunk costs under a schedule family (the replay's input)."""

from __future__ import annotations

from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.chunks import ChunkPlan
from pipeplan.solvers.request import ResolvedRequest


def test_a_weight_two_chunks_of_one_rank_share_counts_once() -> None:
    """A tied first and last unit: on one rank in a V (zbv), on two in a loop."""
    plain = synthetic_profile(8, batch_size=8, microbatch_sizes=[2], tied=True)
    split = {"backward_input_s": 1e-3, "backward_weight_s": 1e-3, "weight_held_bytes": 0}
    units = tuple(
        u.model_copy(update={"timings": {b: t.model_copy(update=split)
                                         for b, t in u.timings.items()}})
        for u in plain.units
    )  # fmt: skip
    profile = plain.model_copy(update={"units": units})
    tied = profile.shared_params[0].bytes
    cluster = Cluster.homogeneous(2, 1 << 40)
    starts = [0, 2, 4, 6]
    params = {}
    for fam in ("zbv", "zb-interleaved"):
        options = PlanOptions(schedule=fam, checkpoint="never", microbatches=4)
        plan = ChunkPlan(ResolvedRequest(profile, cluster, options), fam, 2, 4)
        params[fam] = plan.costs_of(starts, [False] * 4).grad_bytes
    assert params["zb-interleaved"][0] - params["zbv"][0] == tied  # counted on chunk 3 only
    assert params["zbv"][3] == params["zb-interleaved"][3]
    assert sum(params["zb-interleaved"]) - sum(params["zbv"]) == tied
