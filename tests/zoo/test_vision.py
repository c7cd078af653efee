"""Issue 31: torchvision and timm classifiers as they are.  One test per failure class, each on
a real model of :mod:`pipeplan.models.vision` (small images), and one new user's path from
``pipeplan profile`` to ``pipeplan run`` with the default options.  The full sweep (profile,
plan 2 and 4, a 2-rank run with every gradient against the unsplit model) is
``benchmarks/zoo/vision.py``; its table is in benchmarks/zoo/README.md.

1. an in-place op opening a unit (torchvision ResNet-18): no unit mutates a value it receives,
   and the profile's leaves survive the sweep;
2. ``forward(x, is_causal=False)`` (timm ViT): fx's ``eq`` + ``_assert`` check goes with the
   placeholder;
3. bare parameters (torchvision ViT's ``class_token``; a ``transformers`` model in a wrapper):
   ``--init auto`` builds the whole model where something has no initializer, and a wrapper
   does not hide ``_init_weights``;
4. the meta probe's autograd graph (torchvision EfficientNet): the probe's values hold no
   graph, so a parameter swaps while they are alive;
5. a stage without parameters: an empty optimizer steps, and the DP prefers a balanced plan
   at equal step time;
6. threads: profile times with cores // 2 threads, and ``plan`` warns where its ranks get other.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeplan.intake.graph import group_units
from pipeplan.intake.inplace import mutated_args
from pipeplan.intake.meta import materialize, trace_meta, uninitialised
from pipeplan.intake.model import load_model
from pipeplan.intake.refine import node_costs, refine_units
from pipeplan.intake.trace import trace_model
from pipeplan.models.vision import build
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.host import threads_per_rank
from pipeplan.planner.optim import make_optimizer
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.profiler import profile_model
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.runtime.probe import probe
from pipeplan.runtime.worker import _whole_build_needed
from pipeplan.solvers.dp import solve_dp

pytest.importorskip("timm")


@pytest.mark.parametrize("name", ["resnet18", "timm_resnetd"])
def test_inplace_op_never_opens_a_unit(name: str) -> None:
    """Class 1: refinement splits ResNet-18's blocks into their children, and a
    ``ReLU(inplace=True)`` would open a unit; it stays with the node that made its input, also
    through an alias (timm's ResNet-D: ``act2`` in place on a disabled ``drop_block``, an
    ``nn.Identity``), and the profiler's sweep (leaves that require grad, checkpointed passes)
    runs."""
    spec = build(name, image=32)
    inputs, _ = spec.batch(2)
    traced = trace_model(spec.module, inputs)
    units, opened = refine_units(traced, node_costs(traced, inputs), 8)
    assert opened and len(units) >= 8
    for u in [*units, *group_units(traced, "node")]:
        nodes = {n.name: n for n in traced.gm.graph.nodes}
        inside = set(u.nodes)
        written = [a.name for x in u.nodes for a in mutated_args(traced.gm, nodes[x])]
        assert set(written) <= inside, (u.name, written)
    prof = profile_model(
        f"pipeplan.models.vision:{name}",
        batch_size=2,
        microbatch_sizes=[2],
        model_kwargs={"image": 32},
        warmup=0,
        repeats=1,
        progress=False,
    )
    assert [u.name for u in prof.units] == [u.name for u in units]


def test_mutated_args_kinds() -> None:
    """Class 1: the forms an in-place op takes in a graph."""

    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            torch.nn.functional.relu(y, inplace=True)
            z = y + 1
            z.add_(1)
            return torch.relu_(z)

    gm = torch.fx.symbolic_trace(Net())
    written = {n.name: [a.name for a in mutated_args(gm, n)] for n in gm.graph.nodes}
    assert written["relu"] == ["mul"] and written["add_"] == ["add"]
    assert written["relu_"] == ["add"]
    exported = torch.export.export(Net(), (torch.randn(2),)).module()
    ops = [(n, mutated_args(exported, n)) for n in exported.graph.nodes]
    assert sum(1 for _, w in ops if w) == 3


def test_fixed_default_argument_leaves_no_input() -> None:
    """Class 2: timm's ViT takes ``is_causal=False``; fx checks it with eq + _assert."""
    spec = build("timm_vit", image=32)
    inputs, _ = spec.batch(2)
    traced = trace_model(spec.module, inputs)
    assert [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"] == ["x"]


def test_auto_init_builds_whole_where_nothing_initialises() -> None:
    """Class 3: torchvision's ViT has a bare ``class_token``: ``--init auto`` builds the whole
    model; ResNet-18's modules all reset, so each rank builds its stage."""
    vit = load_model("pipeplan.models.vision:vit", {"image": 32}, meta=True)
    assert "VisionTransformer.class_token" in uninitialised(vit.module)
    assert _whole_build_needed(vit, 2, 1)
    resnet = load_model("pipeplan.models.vision:resnet18", {"image": 32}, meta=True)
    assert uninitialised(resnet.module) == [] and not _whole_build_needed(resnet, 2, 1)


def test_transformers_model_in_a_wrapper_initialises() -> None:
    """Class 3: a user's wrapper around a ``transformers`` T5 stack does not hide its
    ``_init_weights`` (T5LayerNorm has no ``reset_parameters``)."""
    tf = pytest.importorskip("transformers")
    config = tf.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, vocab_size=32)

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t5 = tf.T5EncoderModel(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.t5(input_ids=ids).last_hidden_state  # type: ignore[no-any-return]

    from pipeplan.intake.meta import empty_parameters

    with empty_parameters():
        net = Wrapper()
    assert uninitialised(net) == []
    materialize(net, [n for n, _ in net.named_parameters()], torch.device("cpu"))
    assert not any(torch.isnan(p).any() for p in net.parameters())


def test_probe_holds_no_autograd_graph() -> None:
    """Class 4: the meta probe's values held no graph to keep the parameters' AccumulateGrad
    nodes alive; while they live (a reference cycle kept them until gc), a parameter swaps."""
    spec = load_model("pipeplan.models.vision:efficientnet", {"image": 32}, meta=True)
    inputs, _ = spec.batch(2)
    traced = trace_meta(spec.module, inputs)
    values = probe(traced, {n.name for n in traced.gm.graph.nodes}, inputs)
    held = [v for v in values.values() if isinstance(v, torch.Tensor)]
    assert any(v.requires_grad for v in held)
    assert all(v.grad_fn is None for v in held)
    materialize(spec.module, [n for n, _ in spec.module.named_parameters()], torch.device("cpu"))


def test_empty_stage_steps_and_ties_prefer_balance() -> None:
    """Class 5: an optimizer over no parameters steps; at m = 1, where every partition of a
    profile gives the same step, the DP's plan is the most balanced one."""
    opt = make_optimizer("adam", [], 0.1)
    opt.zero_grad()
    opt.step()
    prof = synthetic_profile(7, batch_size=8, microbatch_sizes=[8], seed=3)
    cluster = Cluster.homogeneous(4, 1 << 40)
    options = PlanOptions(microbatches=1, optimizer="sgd")
    plan = solve_dp(prof, cluster, options)

    def worst(cuts: tuple[int, ...]) -> float:
        p = evaluate(prof, cluster, options, cuts, 1, solver="dp")
        return max(s.forward_s + s.backward_s for s in p.stages)

    best = min(worst(c) for c in itertools.combinations(range(1, 7), 3))
    got = tuple(s.first_unit for s in plan.stages[1:])
    assert worst(got) == pytest.approx(best, rel=1e-12)


def test_profile_threads_agree_with_a_two_stage_run(tmp_path: Path) -> None:
    """Class 6: ``profile`` times with the threads each rank of a 2-stage run gets; ``plan``
    says, before anything runs, when its stage count gives each rank other threads."""
    prof = profile_model("pipeplan.models.mlp:mlp", batch_size=4, warmup=0, repeats=1,
                         microbatch_sizes=[4], progress=False)  # fmt: skip
    assert prof.device.threads == threads_per_rank(2)
    from pipeplan.planner.io import write_json

    write_json(tmp_path / "p.json", prof.model_copy(update={"device": prof.device.model_copy(
        update={"threads": threads_per_rank(1) + 1})}))  # fmt: skip
    cmd = [sys.executable, "-m", "pipeplan", "plan", "p.json", "--stages", "2", "--memory",
           "1GiB", "-o", "plan.json"]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False,
                         env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "each rank runs" in out.stderr and "--threads" in out.stderr


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # data-dependent: neither fx nor export traces it
            h = h * 2
        return h


def test_untraceable_forward_is_one_line_naming_the_users_line(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Also seen in issue 31: export's partial graphs (some 65 lines) no longer precede the
    error, and the error names the user's file and line."""
    from pipeplan.planner.errors import TraceError

    with pytest.raises(TraceError, match=r"branches on a tensor's value at .*test_vision.py:\d+"):
        trace_model(_DataDependent(), (torch.randn(2, 4),))
    assert "def forward" not in capfd.readouterr().err
