"""Issue 31's sweep in the suite: every torchvision and timm classifier of
:mod:`pipeplan.models.vision` (64 x 64 images, float64) profiled with the default options (one
timed pass), planned for 2 and 4 stages, and its 2-stage plan run for 2 steps on 2 ranks as
``pipeplan run`` builds it by default (``--init auto``), with the loss and every gradient
against the unsplit model run micro-batch by micro-batch (BatchNorm on micro-batch
statistics); two BatchNorm models also as ZB-V plans.  :mod:`benchmarks.zoo.vision` is the
same sweep with two timed passes; its table is in benchmarks/zoo/README.md.
"""

from __future__ import annotations

from functools import partial

import pytest
from _cached import once_per_session

from benchmarks.zoo.main import ZooRun, compare
from benchmarks.zoo.vision import reference, run_vision
from pipeplan.models.vision import VISION

pytestmark = pytest.mark.multirank

pytest.importorskip("timm")
#: BatchNorm models also run as ZB-V plans: 2 ranks x 2 chunks, torch's split backward.
ZBV = ("resnet18", "mobilenet_v3")
#: The models ``make test`` sweeps, one of each kind (BatchNorm and residuals, squeeze-excite,
#: torchvision's and timm's attention, an MLP mixer, a conv-attention hybrid); the other seven
#: (densenet, regnet, convnext, swin, timm_resnetd, timm_deit, timm_convnext) are marked
#: ``slow`` (``make test-all``; benchmarks/zoo sweeps all fourteen).  They took half the
#: suite's time on 2 cores.
SUITE = ("resnet18", "mobilenet_v3", "efficientnet", "vit", "timm_vit", "timm_mixer",
         "timm_mobilevit")  # fmt: skip
REST = tuple(n for n in VISION if n not in SUITE)
NAMES = [*SUITE, *(pytest.param(n, marks=pytest.mark.slow) for n in REST)]
# One worker profiles and runs each sweep once (make test runs xdist with --dist loadfile).


@pytest.fixture(scope="module")
def suite_sweep(tmp_path_factory: pytest.TempPathFactory) -> ZooRun:
    return once_per_session(
        tmp_path_factory,
        "vision_sweep",
        lambda out: run_vision(out, list(SUITE), repeats=1, zbv=ZBV),
    )


@pytest.fixture(scope="module")
def rest_sweep(tmp_path_factory: pytest.TempPathFactory) -> ZooRun:
    return once_per_session(
        tmp_path_factory, "vision_sweep_rest", lambda out: run_vision(out, list(REST), repeats=1)
    )


@pytest.fixture
def sweep(request: pytest.FixtureRequest, name: str) -> ZooRun:
    """The sweep that holds model ``name``."""
    return request.getfixturevalue("suite_sweep" if name in SUITE else "rest_sweep")  # type: ignore[no-any-return]


def test_the_suite_sweeps_one_model_of_each_kind_and_marks_the_rest_slow() -> None:
    assert set(SUITE) <= set(VISION) and set(ZBV) <= set(SUITE)
    assert sorted([*SUITE, *REST]) == sorted(VISION) and len(REST) == 7


@pytest.mark.parametrize("name", NAMES)
def test_profiles_and_plans_2_and_4_stages(sweep: ZooRun, name: str) -> None:
    assert sweep.profiles[name].n_units >= 4
    for p in (2, 4):
        plan = sweep.plans[name][p]
        assert plan.n_stages == p and plan.feasible, (p, plan.status)
        assert all(s.unit_names for s in plan.stages)


@pytest.mark.parametrize("name", NAMES)
def test_two_rank_run_equals_the_unsplit_model(sweep: ZooRun, name: str) -> None:
    result = compare(name, sweep, partial(reference, image=64))
    assert result["error"] is None, f"{result['error']}\n{sweep.stderr[-3000:]}"
    assert not result["missing"], result["missing"]
    assert result["loss_rel"] <= 1e-12 and result["grad_rel"] <= 1e-12, result


@pytest.mark.parametrize("name", ZBV)
def test_batch_norm_models_under_zbv_equal_the_unsplit_model(sweep: ZooRun, name: str) -> None:
    """ZB-V runs each BatchNorm of a chunk on micro-batch statistics and splits its backward
    into I and W; the loss and every gradient still equal the unsplit model's, run micro-batch
    by micro-batch."""
    plan = sweep.plans[f"{name}+zbv"][2]
    assert plan.schedule == "zbv" and plan.stages_per_rank == 2 and plan.microbatches == 2
    result = compare(f"{name}+zbv", sweep, lambda _: reference(name, image=64))
    assert result["error"] is None, f"{result['error']}\n{sweep.stderr[-3000:]}"
    assert not result["missing"], result["missing"]
    assert result["loss_rel"] <= 1e-12 and result["grad_rel"] <= 1e-12, result


@pytest.mark.parametrize("name", ["vit", pytest.param("swin", marks=pytest.mark.slow), "timm_vit"])
def test_zero_bubble_chunks_keep_what_their_weight_gradient_needs(sweep: ZooRun, name: str) -> None:
    """Every chunk of one or two of the profile's units, as a zero-bubble stage runs it in one
    process: forward, torch's input gradient (which detaches the outputs in place), then its
    weight gradient.  Pins the bug that failed ViT's default run when ``auto`` chose a
    zero-bubble plan cutting between a block's LayerNorm and its residual add."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from pipeplan.intake.graph import group_units
    from pipeplan.intake.model import load_model
    from pipeplan.intake.trace import trace_model
    from pipeplan.runtime.stages import build_stages

    plan = sweep.plans[name][2].model_copy(update={"schedule": "zbv", "stages_per_rank": 1})
    spec = load_model(plan.model, dict(plan.model_kwargs))
    spec.module.to(torch.float64)
    x = tuple(t.to(torch.float64) for t in spec.batch(plan.microbatch_size)[0])
    traced = trace_model(spec.module, x, tracer=plan.tracer)
    units = group_units(traced, plan.granularity, plan.unit_expansions)
    n, stage = len(units), plan.stages[0]
    windows = [(lo, hi) for lo in range(1, n - 2) for hi in (lo, lo + 1)][:80]
    for lo, hi in windows:
        stages = tuple(
            stage.model_copy(update={"index": j, "first_unit": a, "last_unit": b,
                                     "unit_names": tuple(u.name for u in units[a : b + 1])})
            for j, (a, b) in enumerate([(0, lo - 1), (lo, hi), (hi + 1, n - 1)])
        )  # fmt: skip
        three = plan.model_copy(update={"stages": stages})
        middle = build_stages(three, traced, units, x)[1]
        received = [t.detach().clone().requires_grad_(t.is_floating_point())
                    for t in middle.example_inputs]  # fmt: skip
        outs = [o for o in middle.module(*received) if o.requires_grad]
        params = list(middle.module.parameters())
        _, groups = stage_backward_input(outs, [torch.ones_like(o) for o in outs], received,
                                         iter(params))  # fmt: skip
        stage_backward_weight(iter(params), groups)  # raised "detached in-place" before
