"""Issue 31's sweep in the suite: every torchvision and timm classifier of
:mod:`pipeplan.models.vision` (64 x 64 images, float64) profiled with the default options (one
timed pass), planned for 2 and 4 stages, and its 2-stage plan run for 2 steps on 2 ranks as
``pipeplan run`` builds it by default (``--init auto``), with the loss and every gradient
against the unsplit model run micro-batch by micro-batch (BatchNorm on micro-batch
statistics).  :mod:`benchmarks.zoo.vision` is the same sweep with two timed passes; its table is
in benchmarks/zoo/README.md.
"""

from __future__ import annotations

from functools import partial

import pytest
from _cached import once_per_session

from benchmarks.zoo.main import ZooRun, compare
from benchmarks.zoo.vision import reference, run_vision
from pipeplan.models.vision import VISION

pytest.importorskip("timm")
# One worker profiles and runs the whole sweep once (make test runs xdist with --dist loadfile).


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> ZooRun:
    return once_per_session(
        tmp_path_factory, "vision_sweep", lambda out: run_vision(out, list(VISION), repeats=1)
    )


@pytest.mark.parametrize("name", list(VISION))
def test_profiles_and_plans_2_and_4_stages(sweep: ZooRun, name: str) -> None:
    assert sweep.profiles[name].n_units >= 4
    for p in (2, 4):
        plan = sweep.plans[name][p]
        assert plan.n_stages == p and plan.feasible, (p, plan.status)
        assert all(s.unit_names for s in plan.stages)


@pytest.mark.parametrize("name", list(VISION))
def test_two_rank_run_equals_the_unsplit_model(sweep: ZooRun, name: str) -> None:
    result = compare(name, sweep, partial(reference, image=64))
    assert result["error"] is None, f"{result['error']}\n{sweep.stderr[-3000:]}"
    assert not result["missing"], result["missing"]
    assert result["loss_rel"] <= 1e-12 and result["grad_rel"] <= 1e-12, result
