"""Pieces of the random instances that test_cpsat and test_dp draw (Hypothesis strategies)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from planner.synthetic import synthetic_profile
from planner.types import (
    CheckpointPolicy,
    Device,
    OptimizerName,
    PlanOptions,
    Profile,
    ScheduleName,
)

SEEDS = st.integers(0, 10**6)
SPREADS = st.sampled_from([0.1, 0.5, 1.5])
CURVATURES = st.sampled_from([0.0, 0.0, 1.5])  # 1.5: a superlinear U(w)
CALL_COSTS = st.sampled_from([(0.0, 0.0), (3e-5, 6e-5)])  # a checkpoint call's (fwd, bwd) s
CHECKPOINTS: st.SearchStrategy[CheckpointPolicy] = st.sampled_from(
    ["always", "except_last", "never"]
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
