"""The schedule engine's cost fit of ``pipeplan calibrate`` (:mod:`pipeplan.runtime.engine_fit`)."""

from __future__ import annotations

import pytest

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.runtime.engine_fit import engine_overhead, fit_engine, slope_per_microbatch


def test_fit_engine_clamps_and_falls_back() -> None:
    # Slopes that do not grow with the operations: no contention, o from the mean excess.
    assert fit_engine([(1e-3, 2e-3), (5e-3, 5.8e-3)]) == (pytest.approx(4.5e-4), 0.0)
    assert fit_engine([(1e-3, 2e-3)]) == (pytest.approx(5e-4), 0.0)
    with pytest.raises(InvalidRequestError):
        fit_engine([])


def test_fit_engine_one_width_over_launches_fits_no_line() -> None:
    # Two launches at one width time its F + B a little differently; a line through those two
    # points is noise (here k = 9), so one width means k = 0 and o = median(y - x) / 2.
    points = [(1.00e-3, 2.0e-3), (1.01e-3, 2.1e-3)]
    assert fit_engine(points)[1] > 5
    assert fit_engine(points, [256, 256]) == (pytest.approx(5.225e-4), 0.0)
    # Two widths fit the line through all launches' points.
    line = [(x, 1.5 * (x + 2e-4)) for x in (1e-3, 1.1e-3, 7e-3, 7.2e-3)]
    o, k = fit_engine(line, [256, 256, 1024, 1024])
    assert (o, k) == (pytest.approx(1e-4), pytest.approx(0.5))


def test_engine_overhead_from_step_times() -> None:
    # Each extra micro-batch costs one slowest-stage time F + B + 2 o + C.
    o, trip, compute = 4e-4, 1e-4, 2e-3
    steps = {m: [0.01 + (m - 2) * (compute + 2 * o + trip)] * 3 for m in (2, 4, 8, 16)}
    assert engine_overhead(steps, trip, compute) == pytest.approx(o)
    # One wild round does not move the Theil-Sen slope.
    steps[16][1] = 1.0
    assert engine_overhead(steps, trip, compute) == pytest.approx(o)
    assert engine_overhead({2: [0.01], 16: [0.01]}, trip) == 0.0


def test_slope_is_robust_to_an_outlier_round() -> None:
    steps = {m: [0.002 * m + 0.001] * 3 for m in (2, 4, 8, 16)}
    steps[16][1] = 1.0  # one round landed in a slow phase
    assert slope_per_microbatch(steps) == pytest.approx(0.002)
