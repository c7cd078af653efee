"""Whatever crosses a cut, the pipeline carries (issue: "a runtime that carries whatever
crosses a cut"), and batch norm's running statistics are updated once per step.

One 2-rank torchrun job (gloo, float64) runs ``_carry_models``: the cuts carry a bool mask, an
integer tensor, a float tensor without gradient, a non-contiguous view and several tensors at
once, and the output is a dict of a tensor, a tuple and a list; a model leaves an optional argument at
its default, applies one module on two stages and returns a namedtuple; loss and every gradient
equal the unsplit model's.  The batch-norm nets check ``deferred`` (each layer's running statistics
updated once, from all its micro-batches' inputs; the first layer's equal the unsplit model's
on the whole batch) and ``microbatch`` (updated once per micro-batch), for torch.fx and
torch.export graphs, with and without recomputation.  Failures inside a stage name the unit, node and values.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from _runtime_jobs import launch_job, make_plan, reference

from pipeplan.intake.graph import group_units
from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.errors import UserCodeError
from pipeplan.runtime.stage_errors import StageComputeError
from pipeplan.runtime.stages import build_stages

TIGHT = {"rtol": 1e-9, "atol": 1e-11}
CARRY = {"carry-a": [0, 1], "carry-b": [0, 2], "reuse": [0, 2]}
if importlib.util.find_spec("transformers") is not None:
    CARRY["hfout"] = [0, 2]  # the output is a transformers ModelOutput
BN = ("batchnorm", "batchnorm_export")
#: ``carry`` in lower precisions (one config each), against the float64 unsplit model: the
#: loss within ``rel`` and each gradient within ``rel`` of its norm.  The bound is a few
#: roundings of the dtype (bfloat16 keeps 8 bits, float16 11, float32 24); the pipeline sums
#: the m micro-batches' gradients in another order than one batch, so bits may differ.
LOW = {"bfloat16": 0.03, "float16": 4e-3, "float32": 2e-6}


def _model(name: str) -> str:
    return f"_carry_models:{name.partition('-')[0]}"


def _configs() -> list[dict[str, Any]]:
    base = {"schedule": "gpipe", "optimizer": "sgd", "lr": 0.1, "steps": 1}
    return [
        {**base, "key": "except_last", "checkpoint": "except_last"},
        {**base, "key": "always", "checkpoint": "always"},
        {**base, "key": "microbatch", "checkpoint": "always", "batch_norm": "microbatch"},
    ]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    models = [
        {"name": name, "model": _model(name), "kwargs": {}, "starts": starts}
        for name, starts in CARRY.items()
    ] + [{"name": n, "model": f"_carry_models:{n}", "kwargs": {}, "starts": [0, 2]} for n in BN]
    models += [
        {"name": f"carry-{dt}", "model": "_carry_models:carry", "kwargs": {}, "starts": [0, 2],
         "dtype": dt, "keys": ["except_last"]}
        for dt in LOW
    ]  # fmt: skip
    job = {"models": models, "batch_size": 8, "microbatches": 4, "configs": _configs()}
    return launch_job(job, 2, tmp_path_factory.mktemp("carry"))


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(CARRY))
def test_every_kind_of_value_crosses_the_cut(ranks: list[Any], name: str) -> None:
    model = {"model": _model(name), "kwargs": {}}
    ref_loss, ref_grads, _, _ = reference(model, 8, "sgd", 0.1, 1)
    for key in ("except_last", "always"):
        assert ranks[-1][name][key]["loss"] == pytest.approx(ref_loss, rel=1e-12)
        seen = set()
        for r, rank in enumerate(ranks):
            for pname, grad in rank[name][key]["grads"].items():
                torch.testing.assert_close(grad, ref_grads[pname], **TIGHT, msg=f"{r} {pname}")
            seen |= set(rank[name][key]["grads"])
        assert seen == set(ref_grads)


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", list(LOW))
def test_lower_precisions_cross_the_cut(ranks: list[Any], dtype: str) -> None:
    """bfloat16 and float16 tensors go over gloo as they are (it sends both, bit for bit)."""
    ref_loss, ref_grads, _, _ = reference({"model": "_carry_models:carry", "kwargs": {}}, 8,
                                          "sgd", 0.1, 1)  # fmt: skip
    rel = LOW[dtype]
    result = [rank[f"carry-{dtype}"]["except_last"] for rank in ranks]
    assert result[-1]["loss"] == pytest.approx(ref_loss, rel=rel)
    grads = {k: g for r in result for k, g in r["grads"].items()}
    assert set(grads) == set(ref_grads)
    for k, grad in grads.items():
        assert grad.dtype == getattr(torch, dtype), k
        err = float((grad.double() - ref_grads[k]).norm() / ref_grads[k].norm())
        assert err < rel, (k, err)


def _unsplit_buffers(name: str, batch: int, chunks: int) -> dict[str, torch.Tensor]:
    """Running statistics after the unsplit model's training forwards on the batch's
    ``chunks`` micro-batches, in order (what ``--batch-norm microbatch`` should give)."""
    spec = load_model(f"_carry_models:{name}", {})
    module = spec.module.double().train()
    (x,), _ = spec.batch(batch)
    with torch.no_grad():
        for piece in x.double().chunk(chunks):
            module(piece)
    return {k: v.clone() for k, v in module.named_buffers()}


def _deferred_reference(name: str, batch: int, chunks: int) -> dict[str, torch.Tensor]:
    """What deferred batch norm should give: each layer's running statistics updated once,
    from everything it saw in the step's micro-batches (each normalised by its own statistics
    upstream, as in the pipeline)."""
    spec = load_model(f"_carry_models:{name}", {})
    module = spec.module.double().train()
    seen: dict[str, list[torch.Tensor]] = {}
    layers = {n: m for n, m in module.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    for n, layer in layers.items():
        layer.register_forward_pre_hook(lambda _, a, n=n: seen.setdefault(n, []).append(a[0]))
    initial = {k: v.clone() for k, v in module.named_buffers()}
    (x,), _ = spec.batch(batch)
    with torch.no_grad():
        for piece in x.double().chunk(chunks):
            module(piece)
    out = dict(initial)
    for n, layer in layers.items():
        xs = torch.cat(seen[n])
        mean, var = xs.mean((0, 2, 3)), xs.var((0, 2, 3), unbiased=True)
        f = layer.momentum
        out[f"{n}.running_mean"] = (1 - f) * initial[f"{n}.running_mean"] + f * mean
        out[f"{n}.running_var"] = (1 - f) * initial[f"{n}.running_var"] + f * var
        out[f"{n}.num_batches_tracked"] = initial[f"{n}.num_batches_tracked"] + 1
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("name", BN)
def test_deferred_batch_norm_updates_running_statistics_once(ranks: list[Any], name: str) -> None:
    expected = _deferred_reference(name, 8, 4)
    per_microbatch = _unsplit_buffers(name, 8, 4)
    whole = _unsplit_buffers(name, 8, 1)
    for key in ("except_last", "always"):  # "always": a recomputation must not count again
        deferred = {k: v for rank in ranks for k, v in rank[name][key]["buffers"].items()}
        assert set(deferred) == set(expected) and any("running_var" in k for k in expected)
        for k, value in expected.items():
            torch.testing.assert_close(deferred[k], value, **TIGHT, msg=f"{key} {k}")
        first = "blocks.0.1.running_var"  # its input is the model's: the whole batch's statistics
        torch.testing.assert_close(deferred[first], whole[first], **TIGHT)
    micro = {k: v for rank in ranks for k, v in rank[name]["microbatch"]["buffers"].items()}
    for k, value in per_microbatch.items():
        torch.testing.assert_close(micro[k], value, **TIGHT, msg=k)
    assert int(micro["blocks.0.1.num_batches_tracked"]) == 4
    assert int(deferred["blocks.0.1.num_batches_tracked"]) == 1


def test_a_failing_stage_names_its_unit_node_and_values() -> None:
    spec = load_model("_carry_models:carry", {})
    inputs, _ = spec.batch(2)
    traced = trace_model(spec.module, inputs)
    plan = make_plan("carry", {}, traced, starts=[0, 2], batch_size=4, microbatches=2)
    programs = build_stages(plan, traced, group_units(traced), inputs)
    received = [t.detach() for t in programs[1].example_inputs]
    bad = [t[..., :3] if t.dim() == 3 and t.shape[-1] == 8 else t for t in received]
    with pytest.raises(StageComputeError) as info:
        programs[1].module(*bad)
    message = str(info.value)
    assert message.startswith("stage 1, unit 'blocks.2'") or "unit 'blocks." in message, message
    assert "node " in message and "tensor (2, 6, 3) float32" in message, message


def test_the_profiler_takes_an_optional_argument_and_a_namedtuple_output() -> None:
    """The namedtuple is built by a graph node; its tensor must be a leaf of the pass, or the
    loss's backward would run through the last unit twice."""
    from pipeplan.profiler import profile_model

    p = profile_model("_carry_models:reuse", batch_size=4, warmup=0, repeats=1, progress=False)
    assert p.n_units >= 4 and all(u.timings[4].backward_s > 0 for u in p.units)


def test_a_failing_probe_or_loss_names_where_and_what() -> None:
    from pipeplan.runtime.loss import StageLoss
    from pipeplan.runtime.timing import StepTimer

    spec = load_model("_carry_models:carry", {})
    (x, ids), target = spec.batch(2)
    traced = trace_model(spec.module, (x, ids))
    plan = make_plan("carry", {}, traced, starts=[0, 2], batch_size=4, microbatches=2)
    with pytest.raises(StageComputeError) as info:  # an id past the vocabulary
        build_stages(plan, traced, group_units(traced), (x, ids + 10))
    message = str(info.value)
    assert "building the stages): stage 0, unit 'embed', node embed" in message, message
    assert "tensor (2, 6) int64): IndexError" in message, message

    last = build_stages(plan, traced, group_units(traced), (x, ids))[1]
    loss = StageLoss(lambda out, y: out["out"] @ y, last.module, StepTimer(torch.device("cpu")), 1)
    leaves = last.module(*(t.detach() for t in last.example_inputs))
    rebuilt = last.module.rebuild_output(leaves)  # the types the model returns
    assert type(rebuilt) is dict and type(rebuilt["aux"]) is tuple
    assert type(rebuilt["aux"][1]) is list
    with pytest.raises(UserCodeError) as loss_info:
        loss(leaves, target)
    message = str(loss_info.value)
    assert message.startswith(
        "the model's loss (stage 1) on output dict {['out']: tensor (2, 6, 8)"
    )
    assert "['aux'][1][1]: tensor (2, 6) bool" in message, message
    assert "and target tensor (2, 6, 8) float32 raised RuntimeError" in message, message


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
def test_an_fx_traced_model_output_keeps_its_type() -> None:
    """torch.fx records a ModelOutput as a plain dict; the trace rebuilds it, so the profiler's
    (and the runtime's) loss gets what the model returns."""
    from pipeplan.profiler import profile_model

    spec = load_model("_carry_models:hfout", {})
    inputs, _ = spec.batch(2)
    traced = trace_model(spec.module, inputs)
    assert traced.tracer == "fx" and type(traced.gm(*inputs)) is type(spec.module(*inputs))
    p = profile_model("_carry_models:hfout", batch_size=4, warmup=0, repeats=1, progress=False)
    assert (
        p.n_units >= 8
    )  # 4 blocks and glue, cut for the default 8 stages (pipeplan.intake.refine)
