"""pipeplan.intake.graph: tracing, unit grouping and cut tensors on every bundled model."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from pipeplan.intake.graph import (
    UnitSpec,
    compute_nodes,
    cut_tensors,
    group_units,
    subgraph_module,
)
from pipeplan.intake.model import load_model
from pipeplan.intake.trace import TracedModel, trace_model
from pipeplan.planner.errors import InvalidRequestError, TraceError

SMALL = {
    "pipeplan.models.gpt:gpt": {
        "vocab": 128,
        "d_model": 16,
        "n_layers": 3,
        "n_heads": 2,
        "seq_len": 8,
    },
    "pipeplan.models.resnet:resnet": {"width": 4, "blocks": "1,2", "image": 8},
    "pipeplan.models.mlp:mlp": {"width": 16, "depth": 4, "in_features": 8},
}
HF = {"vocab": 64, "d_model": 16, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "seq_len": 8}


def _traced(name: str, kwargs: dict[str, object], batch: int = 3) -> tuple[TracedModel, tuple]:
    spec = load_model(name, kwargs)
    inputs, _ = spec.batch(batch)
    return trace_model(spec.module, inputs), inputs


@pytest.fixture(scope="module")
def llama() -> tuple[TracedModel, tuple]:
    pytest.importorskip("transformers")
    return _traced("pipeplan.models.hf:llama", HF)


def check_partition(traced: TracedModel, units: list[UnitSpec]) -> None:
    """Every compute node in exactly one unit, units contiguous, inputs never from later units."""
    names = [n.name for n in compute_nodes(traced.gm)]
    assert [x for u in units for x in u.nodes] == names
    assert len({u.name for u in units}) == len(units)
    where = {x: k for k, u in enumerate(units) for x in u.nodes}
    for node in compute_nodes(traced.gm):
        for arg in node.all_input_nodes:
            assert arg.op == "placeholder" or where[arg.name] <= where[node.name]


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("granularity", ["auto", "top", "depth:2", "node"])
def test_bundled_models_trace_with_fx_and_group(name: str, granularity: str) -> None:
    traced, _ = _traced(name, SMALL[name])
    assert traced.tracer == "fx"
    check_partition(traced, group_units(traced, granularity))


def test_auto_units_are_the_blocks() -> None:
    gpt, _ = _traced("pipeplan.models.gpt:gpt", SMALL["pipeplan.models.gpt:gpt"])
    assert [u.name for u in group_units(gpt)] == [
        "embed",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "head",
    ]
    resnet, _ = _traced("pipeplan.models.resnet:resnet", SMALL["pipeplan.models.resnet:resnet"])
    names = [u.name for u in group_units(resnet)]
    assert names[1:4] == ["stages.0.0", "stages.1.0", "stages.1.1"] and names[0] == "stem"


def test_hf_model_falls_back_to_export(llama: tuple[TracedModel, tuple]) -> None:
    traced, _ = llama
    assert traced.tracer == "export"
    units = group_units(traced)
    check_partition(traced, units)
    assert [u.name for u in units][1:3] == ["model.layers.0", "model.layers.1"]
    spec = load_model("pipeplan.models.hf:llama", HF)
    (other,), _ = spec.batch(5)  # the batch dimension is dynamic
    torch.testing.assert_close(traced.gm(other), spec.module(other))


def test_units_chained_equal_the_model() -> None:
    traced, inputs = _traced(
        "pipeplan.models.resnet:resnet", SMALL["pipeplan.models.resnet:resnet"]
    )
    units = group_units(traced, "node")
    cuts = cut_tensors(traced, units)
    placeholders = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
    values = dict(zip(placeholders, inputs))
    for k, unit in enumerate(units):
        live = placeholders if k == 0 else list(cuts[k - 1])
        outs = list(cuts[k]) if k < len(cuts) else [unit.nodes[-1]]
        values.update(
            zip(outs, subgraph_module(traced, unit.nodes, live, outs)(*[values[n] for n in live]))
        )
    torch.testing.assert_close(values[units[-1].nodes[-1]], traced.gm(*inputs))


def test_cut_inside_a_residual_block_carries_the_skip() -> None:
    traced, _ = _traced("pipeplan.models.resnet:resnet", SMALL["pipeplan.models.resnet:resnet"])
    units = group_units(traced, "node")
    cuts = cut_tensors(traced, units)
    k = next(i for i, u in enumerate(units) if u.nodes[-1] == "stages_0_0_conv1")
    assert len(cuts[k]) == 2 and "stages_0_0_conv1" in cuts[k]  # main path + the block input
    assert all(len(c) >= 1 for c in cuts)


def test_tied_weight_never_crosses_a_cut() -> None:
    traced, _ = _traced("pipeplan.models.gpt:gpt", SMALL["pipeplan.models.gpt:gpt"])
    units = group_units(traced, "node")
    ops = {n.name: n.op for n in traced.gm.graph.nodes}
    assert all(ops[x] != "get_attr" for cut in cut_tensors(traced, units) for x in cut)


def test_fingerprint_ignores_batch_and_dtype_and_process() -> None:
    name, kwargs = "pipeplan.models.gpt:gpt", SMALL["pipeplan.models.gpt:gpt"]
    a, _ = _traced(name, kwargs, batch=2)
    b, _ = _traced(name, kwargs, batch=7)
    spec = load_model(name, kwargs)
    c = trace_model(spec.module.double(), spec.batch(2)[0])
    code = (
        "from pipeplan.intake.model import load_model; from pipeplan.intake.trace import trace_model; "
        f"s = load_model({name!r}, {kwargs!r}); print(trace_model(s.module, s.batch(4)[0]).fingerprint)"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert a.fingerprint == b.fingerprint == c.fingerprint == other.stdout.strip()
    d, _ = _traced(name, {**kwargs, "n_layers": 4})
    assert d.fingerprint != a.fingerprint


def test_bad_granularity_names_the_choices() -> None:
    traced, _ = _traced("pipeplan.models.mlp:mlp", SMALL["pipeplan.models.mlp:mlp"])
    for bad in ("blocks", "depth:0", "depth:x"):
        with pytest.raises(InvalidRequestError, match=r"auto, top, depth:N, node"):
            group_units(traced, bad)


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: neither tracer can follow it
            return x * 2
        return x - 1


def test_untraceable_model_says_where_it_branches_in_one_short_line() -> None:
    """Both tracers stop at data-dependent control flow: the error names the user's line and
    the fix in at most 200 characters (torch's guard text runs to some 600), with either
    tracer."""
    for tracer in ("auto", "fx"):
        with pytest.raises(TraceError) as info:
            trace_model(Branchy(), (torch.randn(2, 3),), tracer=tracer)  # type: ignore[arg-type]
        message = str(info.value)
        assert "\n" not in message and len(message) <= 200, message
        assert re.search(r"branches on a tensor's value at \S*test_graph.py:\d+", message), message
        assert "torch.where" in message


class Unsupported(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(x.tolist()) * 2  # neither tracer, and not a branch


def test_other_trace_failures_keep_both_tracers_reasons() -> None:
    with pytest.raises(TraceError) as info:
        trace_model(Unsupported(), (torch.randn(2, 3),))
    message = str(info.value)
    assert "torch.fx failed" in message and "torch.export failed" in message, message
    assert "\n" not in message
