"""The accuracy benchmark's own arithmetic: re-evaluating a plan with another profile, and the
noise floor of its rounds."""

from __future__ import annotations

import pandas as pd
import pytest

from benchmarks.accuracy.main import _simulated
from benchmarks.accuracy.noise import across_runs, split_halves, summary
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.dp import solve_dp


def test_reevaluating_a_plan_with_its_own_profile_gives_its_prediction() -> None:
    prof = synthetic_profile(6, batch_size=8, seed=3)
    cluster = Cluster.homogeneous(2, 2**40)
    plan = solve_dp(prof, cluster, PlanOptions(microbatches=4, checkpoint="except_last"))
    assert _simulated(plan, prof, cluster) == pytest.approx(plan.simulated_step_time_s)


def test_reevaluating_with_a_slower_profile_scales_the_prediction() -> None:
    # A host twice as slow (every timing doubled, no link or engine cost) doubles the makespan.
    prof = synthetic_profile(6, batch_size=8, seed=3)
    slow = prof.model_copy(
        update={
            "units": tuple(
                u.model_copy(update={"timings": {
                    b: t.model_copy(update={
                        k: 2 * getattr(t, k)
                        for k in ("forward_s", "backward_s", "recompute_backward_s",
                                  "recompute_forward_s")
                        if getattr(t, k) is not None
                    })
                    for b, t in u.timings.items()
                }})
                for u in prof.units
            ),
            "loss": {},
        }
    )  # fmt: skip
    cluster = Cluster.homogeneous(2, 2**40)
    plan = solve_dp(prof.model_copy(update={"loss": {}}), cluster, PlanOptions(microbatches=2))
    assert _simulated(plan, slow, cluster) == pytest.approx(2 * plan.simulated_step_time_s)


def _rounds(model: str, ratios: list[float]) -> list[dict]:
    """rounds.csv rows whose round r has measured / bracketed = ratios[r] (bracket 10 ms)."""
    return [
        {"model": model, "stages": 2, "m": 4, "checkpoint": "never", "round": r,
         "measured_ms": 10.0 * q, "before_ms": 9.0, "after_ms": 11.0}
        for r, q in enumerate(ratios)
    ]  # fmt: skip


def test_split_halves_compares_the_first_rounds_with_the_last() -> None:
    frame = pd.DataFrame(_rounds("a", [1.2, 1.2, 1.0, 1.0]) + _rounds("b", [1.0, 2.0, 1.0]))
    halves = split_halves(frame.sample(frac=1.0, random_state=0)).set_index("model")
    # a: halves 1.2 and 1.0; the median ratio 1.1 is its bracketed error.
    assert halves.loc["a", "split"] == pytest.approx(0.2)
    assert halves.loc["a", "spread"] == pytest.approx(0.2)
    assert halves.loc["a", "error"] == pytest.approx(0.1)
    # b: three rounds, the middle one left out of both halves.
    assert halves.loc["b", "split"] == pytest.approx(0.0)
    assert halves.loc["b", "spread"] == pytest.approx(1.0)
    assert halves.loc["b", "error"] == pytest.approx(0.0)
    s = summary(halves, limit=0.15)
    assert (s["configurations"], s["split_over"], s["error_over"]) == (2, 1, 0)
    assert s["split_worst"] == pytest.approx(0.2)


def test_across_runs_separates_a_lasting_bias_from_noise() -> None:
    # "a" errs +10 % in every run (a bias of the model); "b" swings around 0 (noise).
    errors = {"a": [0.1, 0.12, 0.08], "b": [0.3, -0.25, 0.01]}
    runs = [
        pd.DataFrame(
            [
                {"model": k, "stages": 2, "m": 4, "checkpoint": "never", "bracketed_error": e[r]}
                for k, e in errors.items()
            ]
        )
        for r in range(3)
    ]
    bias = across_runs(runs).set_index("model")
    assert list(bias.index) == ["a", "b"]  # largest |bias| first
    assert bias.loc["a", "bias"] == pytest.approx(0.1)
    assert bias.loc["a", "agree"] == pytest.approx(1.0)
    assert (bias.loc["a", "least"], bias.loc["a", "greatest"]) == (0.08, 0.12)
    assert bias.loc["b", "bias"] == pytest.approx(0.01)
    assert bias.loc["b", "agree"] == pytest.approx(2 / 3)
    assert bias.loc["b", "runs"] == 3
