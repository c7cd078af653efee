"""pipeplan.profiler.sweep: every unit's backward gets the gradient the whole model gives it, plain or
recomputing, and the timed passes report every unit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeplan.intake.graph import group_units
from pipeplan.intake.model import ModelSpec, load_model
from pipeplan.intake.trace import trace_model
from pipeplan.profiler.assemble import LossModule
from pipeplan.profiler.device import Clock
from pipeplan.profiler.measure import storage_keys
from pipeplan.profiler.sweep import _Pass, _run_pass, measure_sweep
from pipeplan.profiler.unit_modules import split_units

GPT = {"vocab": 64, "d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}  # tied head
RESNET = {"width": 4, "blocks": "1,1", "image": 8}  # skip connections, batch norm
CPU = Clock(torch.device("cpu"))


def _setup(model: str, kwargs: dict[str, Any], batch: int) -> tuple[Any, ...]:
    spec: ModelSpec = load_model(model, kwargs)
    module = spec.module.train()
    x, y = spec.batch(batch)
    traced = trace_model(module, tuple(x), "auto")
    pieces = split_units(traced, group_units(traced, "auto"))
    names = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
    (node,) = [n for n in traced.gm.graph.nodes if n.op == "output"]

    def output(lookup: Any) -> Any:
        flat = torch.fx.node.map_arg(node.args[0], lambda n: lookup(n.name))
        return traced.gm.graph.process_outputs(flat)

    return spec, traced, pieces, dict(zip(names, x)), LossModule(spec.loss, y), output


def _grads(traced: Any) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in traced.gm.named_parameters() if p.grad is not None}
    traced.gm.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(
    "model, kwargs", [("pipeplan.models.gpt:gpt", GPT), ("pipeplan.models.resnet:resnet", RESNET)]
)
@pytest.mark.parametrize(("recompute", "split"), [(False, False), (True, False), (False, True)])
def test_a_pass_gives_the_whole_models_gradients(
    model: str, kwargs: dict[str, Any], recompute: bool, split: bool
) -> None:
    """Plain, recomputing, and split into torch's I and W (the zero-bubble backward)."""
    spec, traced, pieces, inputs, loss, output = _setup(model, kwargs, 4)
    assert len(pieces) >= 3
    buffers = [b.clone() for b in traced.gm.buffers()]
    spec.loss(traced.gm(*inputs.values()), loss.target).backward()
    whole = _grads(traced)
    with torch.no_grad():
        for b, v in zip(traced.gm.buffers(), buffers):
            b.copy_(v)
    _run_pass(pieces, inputs, loss, output, clock=CPU, frozen=frozenset(inputs),
              recompute=recompute, record=None, split=split)  # fmt: skip
    split = _grads(traced)
    assert split.keys() == whole.keys() and whole
    for name, g in whole.items():
        torch.testing.assert_close(split[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_the_models_inputs_get_no_gradient() -> None:
    """Regression: a gradient for the model's input, which no stage computes, doubled the first
    linear layer's backward."""
    state = _Pass({"x": torch.ones(2, 3), "h": torch.ones(2, 3)}, frozenset({"x"}))
    assert not state.leaf("x").requires_grad
    assert state.leaf("h").requires_grad and state.leaf("h") is state.leaf("h")  # one leaf


def test_measure_sweep_times_every_unit_plain_and_recomputing() -> None:
    _, traced, pieces, inputs, loss, output = _setup("pipeplan.models.gpt:gpt", GPT, 4)
    exclude = storage_keys([*traced.gm.parameters(), *traced.gm.buffers()])
    result = measure_sweep(pieces, inputs, loss, output, clock=CPU, warmup=1, repeats=2,
                           exclude=exclude)  # fmt: skip
    assert len(result.units) == len(pieces)
    for t in result.units:
        assert t.forward_s > 0 and t.backward_s > 0 and t.peak_bytes is None
        assert t.recompute_forward_s and t.recompute_backward_s and t.output_bytes > 0
        assert t.backward_weight_s and t.backward_weight_s > 0
    # The first unit reads only the model's inputs: no I, its W the full backward (torch's
    # first stage); every later unit runs both.
    assert result.units[0].backward_input_s == 0
    assert all(t.backward_input_s and t.weight_held_bytes is not None for t in result.units[1:])
    assert all(t.saved_bytes > 0 for t in result.units[1:])  # the embedding saves only ids
    assert result.loss.forward_s > 0 and result.loss.saved_bytes > 0
    made = {n for p in pieces for n in p.outputs}
    assert made <= result.values.keys()
    assert all(not v.requires_grad for n, v in result.values.items() if n in made)


def test_an_unused_output_gets_a_zero_gradient() -> None:
    """A unit output no consumer differentiates through still gets a (zero) gradient."""
    state = _Pass({"x": torch.ones(2)}, frozenset({"x"}))
    out = torch.ones(2, requires_grad=True) * 2
    tensors, grads = state.output_grads(["never_read"], (out,))
    assert tensors == [out] and torch.equal(grads[0], torch.zeros(2))


def test_recomputing_times_close_on_one_checkpoint_around_every_unit() -> None:
    """The units' recomputing times, net of one checkpoint call each, sum to what one
    checkpoint around all of them takes (also net of one call)."""
    from pipeplan.profiler import sweep

    _, traced, pieces, inputs, loss, output = _setup("pipeplan.models.gpt:gpt", GPT, 4)
    exclude = storage_keys([*traced.gm.parameters(), *traced.gm.buffers()])
    wholes: list[tuple[float, float]] = []

    def spy(*args: Any) -> tuple[float, float]:
        wholes.append(sweep_whole(*args))
        return (0.5, 0.75)  # fixed, so the expected sums are exact

    sweep_whole = sweep._whole_pass
    call = (1e-5, 2e-5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep, "_whole_pass", spy)
        result = measure_sweep(pieces, inputs, loss, output, clock=CPU, warmup=1, repeats=2,
                               exclude=exclude, call_s=call)  # fmt: skip
    assert len(wholes) == 2 and all(f > 0 and b > 0 for f, b in wholes)
    n = len(result.units)
    rf = sum(t.recompute_forward_s or 0.0 for t in result.units)
    rb = sum(t.recompute_backward_s or 0.0 for t in result.units)
    assert rf - n * call[0] == pytest.approx(0.5 - call[0])
    assert rb - n * call[1] == pytest.approx(0.75 - result.loss.backward_s - call[1])
