"""o_tp from the calibration MLP's times: what the cost model then charges reproduces them."""

from __future__ import annotations

import pytest

from pipeplan.planner.collectives import ring_cost
from pipeplan.planner.types import Link
from pipeplan.runtime.tp_overhead import TOKENS, WIDTH, tp_overhead

LINK = Link(bandwidth_Bps=1e9, latency_s=2e-5)
X = float(TOKENS * WIDTH * 4)


def test_the_model_charged_o_tp_reproduces_the_split_mlp() -> None:
    """T_1 / 2 (every FLOP split) + 2 all-reduces of the output + 4 o_tp (2 projections x 2
    passes) is the measured T_2."""
    alpha, beta = ring_cost(LINK, 2, "all_reduce")
    measured = {"whole_s": 0.012, "split_s": 0.0115, "bytes": X}
    o = tp_overhead(measured, LINK)
    assert o > 0
    assert 0.012 / 2 + 2 * (alpha * X + beta) + 4 * o == pytest.approx(0.0115)


def test_a_split_no_slower_than_the_model_costs_nothing() -> None:
    """o_tp is never negative, and nothing measured (one rank, an odd count) is 0."""
    assert tp_overhead({"whole_s": 0.012, "split_s": 0.006, "bytes": X}, LINK) == 0.0
    assert tp_overhead({}, LINK) == 0.0
