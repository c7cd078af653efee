"""pipeplan.intake.meta: a model built on meta traces to the real graph, and a stage materialized alone
gets exactly the values the whole model gets; the known traps each have a test (tied weights
after ``to_empty``, rotary tables after ``to_empty``, tensors made with an explicit device,
parameters nothing initialises)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from pipeplan.intake.meta import (
    MetaInterpreter,
    empty_parameters,
    has_meta,
    materialize,
    module_seed,
    owners,
    trace_meta,
)
from pipeplan.intake.model import ModelSpec, load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.errors import ModelLoadError

GPT = (
    "pipeplan.models.gpt:gpt",
    {"vocab": 64, "d_model": 16, "n_layers": 3, "n_heads": 2, "seq_len": 8},
)
LLAMA = ("pipeplan.models.zoo:llama", {})


def _names(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters()]


class Explicit(nn.Module):
    """A parameter and a buffer made with an explicit ``device=``: they escape a
    ``torch.device("meta")`` block, not ``empty_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4, device="cpu"))
        self.register_buffer("table", torch.arange(4.0, device="cpu"), persistent=False)


def test_parameters_go_to_meta_whatever_their_device_and_buffers_stay_real() -> None:
    with torch.device("meta"):
        escaped = Explicit()
    assert not escaped.scale.is_meta  # the trap: torch.device("meta") does not catch it
    with empty_parameters():
        m = Explicit()
    assert m.scale.is_meta and m.scale.requires_grad
    assert torch.equal(m.table, torch.arange(4.0))  # the buffer keeps its value
    assert has_meta(m) and not has_meta(nn.Linear(2, 2))
    assert not nn.Linear(2, 2).weight.is_meta  # the patch ends with the block


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt-fx", "llama-export"])
def test_a_meta_model_traces_to_the_real_graph(model: tuple[str, dict[str, int]]) -> None:
    real = load_model(*model)
    inputs = real.batch(2)[0]
    empty = load_model(*model, meta=True)
    assert has_meta(empty.module)
    traced = trace_meta(empty.module, inputs)
    reference = trace_model(real.module, inputs)
    assert (traced.tracer, traced.fingerprint) == (reference.tracer, reference.fingerprint)
    assert {id(p) for p in traced.gm.parameters()} <= {id(p) for p in empty.module.parameters()}


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_a_stage_materialized_alone_equals_the_whole_model(
    model: tuple[str, dict[str, int]],
) -> None:
    whole = load_model(*model, meta=True).module
    materialize(whole, _names(whole), torch.device("cpu"), seed=7)
    assert not has_meta(whole)
    names = _names(whole)
    stage = load_model(*model, meta=True).module
    materialize(stage, names[len(names) // 2 :], torch.device("cpu"), seed=7)
    expected = dict(whole.named_parameters())
    real = {n: p for n, p in stage.named_parameters() if not p.is_meta}
    assert 0 < len(real) < len(names)
    for n, p in real.items():
        assert torch.equal(p, expected[n]), n
    other = load_model(*model, meta=True).module
    materialize(other, names, torch.device("cpu"), seed=8)
    matrix = next(n for n in names if expected[n].dim() == 2)  # random, unlike a zero bias
    assert not torch.equal(dict(other.named_parameters())[matrix], expected[matrix])


def test_the_traced_graph_runs_on_the_materialized_tensors() -> None:
    spec = load_model(*LLAMA, meta=True)
    inputs = spec.batch(2)[0]
    traced = trace_meta(spec.module, inputs)
    materialize(spec.module, _names(spec.module), torch.device("cpu"), seed=0)
    out, ref = traced.gm(*inputs), spec.module(*inputs)
    assert torch.equal(out.logits, ref.logits)


def test_tied_weights_stay_tied() -> None:
    kwargs = {**GPT[1], "tie_weights": True}
    module = load_model(GPT[0], kwargs, meta=True).module
    ties = {(a, b) for a, b in [("embed.tok.weight", "head.proj.weight")]}
    broken = load_model(GPT[0], kwargs, meta=True).module.to_empty(device="cpu")
    assert broken.embed.tok.weight is not broken.head.proj.weight  # the trap
    materialize(module, ["head.proj.weight"], torch.device("cpu"), seed=0)
    for a, b in ties:
        assert module.get_parameter(a) is module.get_parameter(b)
    assert not module.embed.tok.weight.is_meta
    assert owners(module, ["head.proj.weight"]) == ["embed.tok", "head.proj"]


def test_rotary_tables_are_recomputed_for_a_model_built_under_torch_device_meta() -> None:
    real = load_model(*LLAMA).module
    with torch.device("meta"):
        built = load_model(*LLAMA).module
    rotary = "model.model.rotary_emb"
    assert built.get_buffer(f"{rotary}.inv_freq").is_meta
    broken = load_model(*LLAMA).module
    with torch.device("meta"):
        broken = load_model(*LLAMA).module
    broken.to_empty(device="cpu")  # the trap: garbage where the table was
    assert not torch.equal(
        broken.get_buffer(f"{rotary}.inv_freq"), real.get_buffer(f"{rotary}.inv_freq")
    )
    materialize(built, [f"{rotary}.inv_freq"], torch.device("cpu"), seed=0)
    assert torch.equal(
        built.get_buffer(f"{rotary}.inv_freq"), real.get_buffer(f"{rotary}.inv_freq")
    )
    # with pipeplan's builder the table never leaves the CPU
    empty = load_model(*LLAMA, meta=True).module
    assert torch.equal(
        empty.get_buffer(f"{rotary}.inv_freq"), real.get_buffer(f"{rotary}.inv_freq")
    )


class Bare(nn.Module):
    """A parameter of its own and no ``reset_parameters``: nothing initialises it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))
        self.lin = nn.Linear(3, 3)


def test_a_parameter_nothing_initialises_is_named() -> None:
    with empty_parameters():
        m = Bare()
    with pytest.raises(ModelLoadError, match=r"parameter gain \(Bare\) .*init_weights"):
        materialize(m, ["gain", "lin.weight"], torch.device("cpu"))
    with empty_parameters():
        m = Bare()

    def init(module: nn.Module) -> None:
        if isinstance(module, Bare):
            nn.init.constant_(module.gain, 2.0)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    materialize(m, ["gain", "lin.weight"], torch.device("cpu"), init_weights=init)
    assert torch.equal(m.gain, torch.full((3,), 2.0)) and not torch.isnan(m.lin.weight).any()
    assert (
        ModelSpec(m, lambda b: (torch.zeros(b, 3), torch.zeros(b)), torch.dist).init_weights is None
    )


def test_without_initialising_the_storage_is_left_for_a_checkpoint() -> None:
    with empty_parameters():
        m = nn.Linear(3, 3)
    materialize(m, ["weight"], torch.device("cpu"), initialize=False)
    assert not m.weight.is_meta and torch.isnan(m.weight).all()


def _shapes(value: object) -> object:
    return tree_map(
        lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t, value
    )


def test_meta_interpreter_gives_the_real_shapes_without_values() -> None:
    spec = load_model(*GPT)
    inputs = spec.batch(2)[0]
    traced = trace_model(spec.module, inputs)
    real, meta = [], []

    class Real(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            out = super().run_node(n)
            real.append(_shapes(out))
            return out

    class Meta(MetaInterpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            out = super().run_node(n)
            assert all(t.is_meta for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            meta.append(_shapes(out))
            return out

    Real(traced.gm).run(*inputs)
    Meta(traced.gm).run(*inputs)
    assert real == meta


class _NoGradTable(nn.Module):
    """HF's rotary embedding in small: a ``no_grad`` region that moves a buffer to the input's
    device, which ``torch.export`` makes a ``wrap_with_set_grad_enabled`` holding a graph
    with the device baked in (``cuda`` on a GPU: what failed there)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.table[None].float().to(x.device) * 2
        return self.lin(x) * scale


def test_meta_interpreter_runs_the_graphs_of_higher_order_operators_on_meta() -> None:
    x = torch.randn(2, 4)
    traced = trace_model(_NoGradTable().train(), (x,), "export")
    hops = [
        n
        for n in traced.gm.graph.nodes
        if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled
    ]
    assert hops  # the region is a higher-order operator whose graph holds `device=cpu`
    out = MetaInterpreter(traced.gm).run(x)
    assert all(t.is_meta for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    assert _shapes(out) == _shapes(traced.gm(x))


def test_module_seeds_depend_on_the_seed_and_the_name() -> None:
    assert module_seed(0, "a") == module_seed(0, "a")
    assert len({module_seed(0, "a"), module_seed(1, "a"), module_seed(0, "b")}) == 3


class _ConstantFromBuffer(nn.Module):
    """fx evaluates ``~self.keep`` while tracing: a tensor constant computed from a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("keep", torch.ones(4, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(~self.keep, 0.0)


def test_a_constant_made_in_forward_from_a_buffer_is_refused_not_left_fake() -> None:
    with empty_parameters():
        module = _ConstantFromBuffer()
    with pytest.raises(ModelLoadError, match="tensor constant '_tensor_constant0'"):
        trace_meta(module, (torch.randn(2, 4),))
