"""Fixtures of the figure tests (test_plots, test_timeline_plots, test_canvas): plans to draw."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
from matplotlib.figure import Figure

from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.types import Cluster, Device, Plan, PlanOptions, Profile
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.dp import solve_dp

MiB = 2**20


@pytest.fixture(scope="module")
def profile() -> Profile:
    return synthetic_profile(12, batch_size=16, seed=3, heavy_ends=True)


@pytest.fixture(scope="module")
def plans(profile: Profile) -> list[Plan]:
    """A DP plan with 3 stages and a uniform 4-stage split that overflows a small device."""
    dp = solve_dp(  # stages 0 and 1 recompute: the figures draw every kind of operation
        profile,
        Cluster.homogeneous(3, 512 * MiB),
        PlanOptions(microbatches=4, checkpoint="except_last"),
    )
    small = Cluster(
        devices=tuple(Device(name=f"d{j}", memory_bytes=(12 + j) * MiB) for j in range(4))
    )
    uniform = evaluate(profile, small, PlanOptions(), [3, 6, 9], 4, solver="uniform")
    return [dp, uniform]


@pytest.fixture
def renders() -> Callable[[Figure], None]:
    """A check that a figure saves as a PNG."""

    def check(fig: Figure) -> None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=40)
        assert buf.getvalue()[:4] == b"\x89PNG"

    return check
