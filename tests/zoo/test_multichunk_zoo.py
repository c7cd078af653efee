"""The schedule solver on a measured zoo profile: GPT-2 (``pipeplan.models.zoo``: tied
embedding and head; I and W measured), profiled once, on 2 and 4 ranks over a finite link.

For ``auto`` and each fixed family, :func:`pipeplan.solvers.multichunk.solve_schedule` returns
a plan whose ``step_time_s`` is the replay (:func:`pipeplan.solvers.chunks.score`, which runs
:func:`pipeplan.planner.replay.replay`) of its own family, v, m, cuts and recompute flags, with
p v contiguous chunks and every rank's replayed peak within its memory.  Where the family can
hold the closed-form DP's plan (``auto`` both GPipe's and 1F1B's, ``gpipe`` and ``1f1b`` their
own), the step is no slower than that plan replayed: the solver seeds from it (or enumerates
every cut), so a plan slower than the DP's is a search that lost its seed.  The DP's own
simulated step equals its replay (docs/schedules.md: the replay reproduces the simulator for
GPipe and 1F1B; the closed form's T(m) bounds the updates' and all-reduces' tail).  A DP plan that torch's class cannot run (1F1B with m < p) holds no seed.
"""

from __future__ import annotations

import pytest

from pipeplan.planner.families import FAMILIES, check
from pipeplan.planner.types import Cluster, Link, Plan, PlanOptions, Profile
from pipeplan.profiler.whole import profile_model
from pipeplan.solvers.chunks import score
from pipeplan.solvers.dp import solve_dp
from pipeplan.solvers.multichunk import solve_schedule

GPT2 = {"n_layers": 4, "d_model": 16, "vocab": 64, "seq_len": 8}


@pytest.fixture(scope="module")
def profile() -> Profile:
    """GPT-2 measured once, one timed pass (the checks hold for any measured times)."""
    return profile_model("pipeplan.models.zoo:gpt2", batch_size=8, model_kwargs=GPT2,
                         warmup=0, repeats=1, progress=False, threads=1)  # fmt: skip


def _cluster(p: int) -> Cluster:
    return Cluster.homogeneous(p, 1 << 34, link=Link(bandwidth_Bps=2e8, latency_s=2e-5))


def _replayed(profile: Profile, cluster: Cluster, options: PlanOptions, plan: Plan) -> float:
    """The replay of ``plan``'s own family, v, m, cuts and recompute flags."""
    rep = score(profile, cluster, options, plan.schedule, plan.stages_per_rank,
                plan.microbatches, [s.first_unit for s in plan.stages],
                [s.recompute for s in plan.stages])  # fmt: skip
    return rep.makespan_s


def _dp_steps(profile: Profile, cluster: Cluster) -> dict[str, float]:
    """Each of GPipe's and 1F1B's DP plans replayed, where torch's class runs it."""
    out = {}
    for fam in ("gpipe", "1f1b"):
        options = PlanOptions(schedule=fam)  # type: ignore[arg-type]
        plan = solve_dp(profile, cluster, options)
        if check(fam, cluster.n_stages, 1, plan.microbatches) is None:
            out[fam] = _replayed(profile, cluster, options, plan)
            # the replay is the simulator's step (the closed form bounds the updates' tail)
            assert out[fam] == pytest.approx(plan.simulated_step_time_s, rel=1e-9), fam
    return out


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", ["auto", *FAMILIES])
def test_plan_is_its_replay_and_no_slower_than_the_dp(
    profile: Profile, schedule: str, p: int
) -> None:
    """The plan is its own replay, covers the units in p v chunks and fits; ``auto``,
    ``gpipe`` and ``1f1b`` are no slower than the DP's runnable plans they can hold."""
    cluster = _cluster(p)
    options = PlanOptions(schedule=schedule)  # type: ignore[arg-type]
    plan = solve_schedule(profile, cluster, options)
    assert schedule in ("auto", plan.schedule)
    starts = [s.first_unit for s in plan.stages]
    assert len(starts) == p * plan.stages_per_rank and starts[0] == 0
    assert all(s.last_unit + 1 == t for s, t in zip(plan.stages, starts[1:]))
    assert plan.stages[-1].last_unit == profile.n_units - 1
    assert _replayed(profile, cluster, options, plan) == pytest.approx(plan.step_time_s, rel=1e-12)
    assert plan.rank_peak_bytes is not None
    assert all(pk <= d.memory_bytes for pk, d in zip(plan.rank_peak_bytes, cluster.devices))
    dp = _dp_steps(profile, cluster)
    held = [f for f in dp if schedule in ("auto", f)]
    if held:
        best = min(dp[f] for f in held)
        assert plan.step_time_s <= best * (1 + 1e-12), (plan.schedule, plan.step_time_s, dp)
