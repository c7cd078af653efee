"""The link fit of ``pipeplan calibrate`` (:mod:`pipeplan.runtime.linkbench`)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.runtime.linkbench import fit_affine, fit_link


def test_fit_recovers_a_linear_link() -> None:
    lat, bw, ovh = 50e-6, 2e9, 10e-6
    sizes = [4 * 4**k for k in range(12)]
    samples = [(s, lat + s / bw, lat + s / bw + ovh) for s in sizes]
    link = fit_link(samples)
    assert link.latency_s == pytest.approx(lat, rel=0.05)
    assert link.bandwidth_Bps == pytest.approx(bw, rel=0.05)
    assert link.overhead_s == pytest.approx(ovh, rel=0.01)
    # The samples are kept and interpolated: exact at the measured points.
    got = link.one_way_s(np.array(sizes, dtype=float), np.ones(len(sizes)))
    np.testing.assert_allclose(got, [lat + s / bw + ovh for s in sizes], rtol=1e-9)
    with pytest.raises(InvalidRequestError):
        fit_link(samples[:1])


def test_interpolation_between_and_beyond_samples() -> None:
    link = fit_link([(4, 1e-5, 1e-5), (1000, 2e-5, 2e-5), (100_000, 1e-4, 1e-4)])
    assert link.transfer_s(0) == 0.0
    assert link.transfer_s(500) == pytest.approx(1e-5 + (500 - 4) / (1000 - 4) * 1e-5)
    beyond = link.transfer_s(200_000)
    assert beyond == pytest.approx(1e-4 + 100_000 / link.bandwidth_Bps)
    # Two messages of half the size each pay the per-message part twice.
    assert link.transfer_s(2000, 2) == pytest.approx(2 * link.transfer_s(1000))


def test_affine_fit_of_a_collective() -> None:
    points = [(4 * 4**k, 3e-10 * 4 * 4**k + 2e-5) for k in range(9)]
    per_byte, fixed = fit_affine(points)
    assert per_byte == pytest.approx(3e-10) and fixed == pytest.approx(2e-5)
    # a flat (latency-bound) collective: no negative slope, the mean as its cost
    assert fit_affine([(4, 1e-5), (64, 0.9e-5), (1024, 1e-5)])[0] >= 0
    with pytest.raises(InvalidRequestError, match="two sizes"):
        fit_affine([(4, 1e-5)])
