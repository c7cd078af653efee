"""Pieces of the random instances that test_cpsat and test_dp draw (Hypothesis strategies), and
the held-back instances both check against brute force."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from hypothesis import strategies as st

from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.types import (
    CheckpointPolicy,
    Cluster,
    Device,
    Link,
    OptimizerName,
    PlanOptions,
    Profile,
    ScheduleName,
)
from pipeplan.planner.types.profile import Timing
from pipeplan.planner.unitcosts import microbatch_choices
from pipeplan.profiler.synthetic import synthetic_profile

SEEDS = st.integers(0, 10**6)
SPREADS = st.sampled_from([0.1, 0.5, 1.5])
CURVATURES = st.sampled_from([0.0, 0.0, 1.5])  # 1.5: a superlinear U(w)
CALL_COSTS = st.sampled_from([(0.0, 0.0), (3e-5, 6e-5)])  # a checkpoint call's (fwd, bwd) s
CHECKPOINTS: st.SearchStrategy[CheckpointPolicy] = st.sampled_from(
    ["auto", "always", "except_last", "never"]
)
SCHEDULES: st.SearchStrategy[ScheduleName] = st.sampled_from(["gpipe", "1f1b"])
ALL_OPTIMIZERS: st.SearchStrategy[OptimizerName] = st.sampled_from(["sgd", "momentum", "adam"])


def _drawn(draw: st.DrawFn, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with every strategy among the values replaced by a draw, in the given order."""
    return {k: draw(v) if isinstance(v, st.SearchStrategy) else v for k, v in fields.items()}


def draw_sizes(draw: st.DrawFn, lo: int, max_units: int, max_stages: int) -> tuple[int, int]:
    """Units n in [lo, max_units], then stages p in [lo, min(n, max_stages)]."""
    n = draw(st.integers(lo, max_units))
    return n, draw(st.integers(lo, min(n, max_stages)))


def draw_profile(draw: st.DrawFn, n: int, **fields: Any) -> Profile:
    """``synthetic_profile(n, batch_size=8, **fields)``, each field given as a strategy drawn."""
    return synthetic_profile(n, batch_size=8, **_drawn(draw, fields))


def draw_devices(
    draw: st.DrawFn, p: int, memory: st.SearchStrategy[int], speed: st.SearchStrategy[float]
) -> tuple[Device, ...]:
    """Devices d0 .. d{p-1}, each with its memory and then its speed drawn."""
    return tuple(
        Device(name=f"d{j}", memory_bytes=draw(memory), speed=draw(speed)) for j in range(p)
    )


def draw_options(
    draw: st.DrawFn, optimizers: st.SearchStrategy[OptimizerName] = ALL_OPTIMIZERS, **fields: Any
) -> PlanOptions:
    """Options with a drawn checkpoint policy, schedule and optimizer, then ``fields`` (each
    given as a strategy drawn)."""
    return PlanOptions(
        checkpoint=draw(CHECKPOINTS),
        schedule=draw(SCHEDULES),
        optimizer=draw(optimizers),
        **_drawn(draw, fields),
    )


HELD_BACK = [
    (update, tied, tight, policy, schedule)
    for update in (0.0, 3e-8)
    for tied in (False, True)
    for tight in (False, True)
    for policy in ("auto", "always", "except_last", "never")
    for schedule in ("gpipe", "1f1b")
]
"""Every combination of the terms the solvers model: (Adam seconds per byte, tied first and
last units, memory that rules out about half the partitions, checkpoint policy, schedule)."""


def held_back(
    index: int, update: float, tied: bool, tight: bool, policy: str, schedule: str
) -> tuple[Profile, Cluster, PlanOptions]:
    """Held-back instance ``index`` of ``HELD_BACK``: 7 units on 3 or 4 stages (alternately),
    m in {1, 4}, a slow link on every other one, engine and checkpoint-call costs."""
    p = 3 + index % 2
    prof = synthetic_profile(
        7,
        batch_size=8,
        microbatch_sizes=[2, 8],
        seed=100 + index,
        heavy_ends=True,
        tied=tied,
        loss=True,
        update_s_per_byte=update,
        checkpoint_call_s=(3e-5, 6e-5),
    )
    options = PlanOptions.model_validate(
        {"checkpoint": policy, "schedule": schedule, "optimizer": "adam"}
    )
    link = Link(bandwidth_Bps=1e8, latency_s=1e-4) if index % 4 < 2 else Link()
    cluster = Cluster.homogeneous(p, 2**50, link, op_overhead_s=2e-4)
    if tight:  # the median over every partition and m of its largest stage's memory
        peaks = [
            max(
                s.memory.total for s in evaluate(prof, cluster, options, cuts, m, solver="x").stages
            )
            for m in microbatch_choices(prof, options, p)
            for cuts in itertools.combinations(range(1, 7), p - 1)
        ]
        cluster = Cluster.homogeneous(p, int(np.median(peaks)), link, op_overhead_s=2e-4)
    return prof, cluster, options


def with_split(profile: Profile) -> Profile:
    """The profile with I = 0.4 B and W = 0.6 B, as a profiler that measured them would give."""
    units = []
    for u in profile.units:
        timings = {
            b: Timing(**{**t.model_dump(), "backward_input_s": 0.4 * t.backward_s,
                         "backward_weight_s": 0.6 * t.backward_s})
            for b, t in u.timings.items()
        }  # fmt: skip
        units.append(u.model_copy(update={"timings": timings}))
    return profile.model_copy(update={"units": tuple(units)})


def brute_step(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    family: str,
    v: int,
    m: int,
    *,
    memory: bool = True,
) -> float:
    """The least replayed step of ``family`` with v chunks per rank and m micro-batches over
    every cut among the allowed ones (``min_units``/``max_units`` kept) and every recompute
    mask the policy allows, of those that fit (all of them without ``memory``); ``inf`` when
    none does."""
    from pipeplan.solvers.chunks import ChunkPlan, fixed_flags
    from pipeplan.solvers.request import ResolvedRequest

    cp = ChunkPlan(ResolvedRequest(profile, cluster, options), family, v, m)
    k, n = cluster.n_stages * v, profile.n_units
    fixed = fixed_flags(options, k)
    masks = [tuple(fixed)] if fixed is not None else itertools.product((False, True), repeat=k)
    inner = options.allowed_cuts if options.allowed_cuts is not None else range(1, n)
    best = np.inf
    for rc in masks:
        for cuts in itertools.combinations(inner, k - 1):
            sizes = np.diff([0, *cuts, n])
            if sizes.min() < options.min_units or sizes.max() > (options.max_units or n):
                continue
            rep = cp.replay([0, *cuts], list(rc))
            if not memory or cp.fits(rep):
                best = min(best, rep.makespan_s)
    return float(best)
