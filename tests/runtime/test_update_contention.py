"""The optimizer-update contention of ``pipeplan calibrate`` (:mod:`pipeplan.runtime.update_contention`)."""

from __future__ import annotations

import pytest

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.runtime.update_contention import update_contention


def test_update_contention_from_times_alone_and_together() -> None:
    # Two updates of the same length that start together both take (1 + kappa_u) as long;
    # medians, so one slow round does not move it.
    assert update_contention([0.010, 0.011, 0.009], [0.012, 0.013, 0.030]) == pytest.approx(0.3)
    assert update_contention([0.010], [0.010]) == 0.0
    # Faster together (noise): negative for one rank; the worker clamps the ranks' mean.
    assert update_contention([0.010], [0.009]) == pytest.approx(-0.1)
    with pytest.raises(InvalidRequestError):
        update_contention([], [0.01])
