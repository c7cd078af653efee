"""The runtime's stages (:mod:`pipeplan.runtime.stages`) and the pieces around them, in one
process: stage modules, plan checks, tied parameters, recomputation, timers, the run report and
the choice of the failed stage.  And whatever crosses a cut, the pipeline carries (issue: "a
runtime that carries whatever crosses a cut"), batch norm's running statistics updated once per
step.

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
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _runtime_jobs import chunked, launch_job, make_plan, reference
from rich.console import Console
from torch import Tensor, nn

from pipeplan.intake.graph import cut_tensors, group_units
from pipeplan.intake.meta import empty_parameters, trace_meta
from pipeplan.intake.model import load_model
from pipeplan.intake.trace import trace_model
from pipeplan.planner.errors import FingerprintMismatchError, UserCodeError
from pipeplan.runtime.engine import Recompute
from pipeplan.runtime.launch import failure
from pipeplan.runtime.records import (
    RankRecord,
    build_report,
    chrome_trace,
    measured_bubble,
    print_comparison,
)
from pipeplan.runtime.stage_errors import StageComputeError
from pipeplan.runtime.stages import build_stages, check_plan, tied_parameters
from pipeplan.runtime.timing import Span, StepTimer

GPT = (
    "pipeplan.models.gpt:gpt",
    {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8},
)


class Skip(nn.Module):
    """Four blocks and a skip from the first block's output to the end."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        h = skip = self.blocks[0](x)
        for block in self.blocks[1:]:
            h = torch.tanh(block(h))
        return h + skip


def _run_stages(programs: list, inputs: tuple[Tensor, ...]) -> object:
    """The stages in a row; the last one's tensors rebuilt into the model's output."""
    out: object = inputs
    for prog in programs:
        out = prog.module(*out)
    return programs[-1].module.rebuild_output(out)


@pytest.mark.parametrize("starts", [[0, 2], [0, 1, 3], [0, 1, 2, 3]])
def test_stages_forward_pass_through_tensors(starts: list[int]) -> None:
    torch.manual_seed(0)
    model = Skip()
    x = torch.randn(3, 4)
    traced = trace_model(model, (x,))
    units = group_units(traced)
    plan = make_plan("skip", {}, traced, starts=starts, batch_size=6, microbatches=2)
    programs = build_stages(plan, traced, units, (x,))
    cuts = cut_tensors(traced, units)
    for j, prog in enumerate(programs[1:], start=1):
        assert prog.inputs == cuts[starts[j] - 1]  # the skip arrives at every later stage
        assert programs[j - 1].outputs == prog.inputs
    assert all(any("blocks_0" in n for n in p.inputs) for p in programs[1:])
    torch.testing.assert_close(_run_stages(programs, (x,)), model(x))
    assert [t.shape for t in programs[1].example_inputs] == [torch.Size([3, 4])] * len(
        programs[1].inputs
    )


def test_a_value_passed_through_leaves_as_no_view() -> None:
    """Pins a bug: stage 1 passes the skip on as a view of what it received, and torch's
    zero-bubble backward (``stage_backward_input``, the I of zb-interleaved, zbv and
    dualpipev) detaches a stage's outputs in place, which a view refuses."""
    from torch.distributed.pipelining._backward import stage_backward_input

    torch.manual_seed(0)
    model = Skip()
    x = torch.randn(3, 4)
    traced = trace_model(model, (x,))
    plan = make_plan("skip", {}, traced, starts=[0, 1, 3], batch_size=6, microbatches=2)
    middle = build_stages(plan, traced, group_units(traced), (x,))[1]
    received = [t.detach().clone().requires_grad_(True) for t in middle.example_inputs]
    outs = middle.module(*received)
    assert not any(o._is_view() for o in outs)
    grads, _ = stage_backward_input(list(outs), [torch.ones_like(o) for o in outs], received,
                                    iter(middle.module.parameters()))  # fmt: skip
    assert all(g is not None for g in grads)


class PreNorm(nn.Module):
    """Pre-norm residual blocks, unit by unit: a cut after ``ln2`` sends the residual stream
    ``h`` on (the next stage adds to it) after this stage's LayerNorm read and saved it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln2, self.fc2 = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.fc1(x)
        return h + self.fc2(self.ln2(h))


@pytest.mark.parametrize("schedule", ["zbv", "zb-interleaved", "dualpipev", "interleaved1f1b"])
def test_a_residual_a_stage_read_itself_survives_the_zero_bubble_detach(schedule: str) -> None:
    """Pins the bug behind torchvision ViT failing under zero-bubble plans: torch's I detaches
    a stage's outputs in place, and the W after it needs what the LayerNorm saved, the same
    tensor.  The zero-bubble families send such an output as a copy; the others send it as it
    is (nothing detaches it before their backward is done)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    model = PreNorm()
    x = torch.randn(3, 4)
    traced = trace_model(model, (x,))
    units = group_units(traced)
    assert [u.name for u in units][:3] == ["fc1", "ln2", "fc2"]
    plan = make_plan("prenorm", {}, traced, starts=[0, 2], batch_size=6, microbatches=2)
    plan = plan.model_copy(update={"schedule": schedule})
    first = build_stages(plan, traced, units, (x,))[0]
    xs = (x.clone().requires_grad_(True),)
    outs = list(first.module(*xs))
    params = list(first.module.parameters())
    _, groups = stage_backward_input(outs, [torch.ones_like(o) for o in outs], list(xs),
                                     iter(params))  # fmt: skip
    if schedule == "interleaved1f1b":  # no copy: torch detaches nothing before W here
        with pytest.raises(RuntimeError, match="detached in-place"):
            stage_backward_weight(iter(params), groups)
        return
    stage_backward_weight(iter(params), groups)
    whole = PreNorm()
    whole.load_state_dict(model.state_dict())
    h = x + whole.fc1(x)
    torch.autograd.backward([h, whole.ln2(h)], [torch.ones(3, 4)] * 2)  # what stage 0 sends
    assert len(outs) == 2
    for (name, mine), theirs in zip(model.named_parameters(), whole.parameters(), strict=True):
        if name.startswith(("fc1", "ln2")):
            torch.testing.assert_close(mine.grad, theirs.grad, msg=name)


class Transposed(nn.Module):
    """A transposed view crosses the cut (as attention's ``q.transpose(1, 2)`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x).view(x.shape[0], 2, 3).transpose(0, 1)
        return self.b(h).sum(0)


def test_receive_buffers_are_contiguous_for_a_model_on_meta() -> None:
    """Regression: a stage built from meta values got a strided receive buffer, and gloo's
    ``irecv`` refused it ("input tensor has to be contiguous") at step 0."""
    x = torch.randn(5, 4)
    with empty_parameters():
        model = Transposed()
    traced = trace_meta(model, (x,))
    units = group_units(traced)
    cut = next(k for k, u in enumerate(units) if "a" in u.name) + 1
    plan = make_plan("t", {}, traced, starts=[0, cut], batch_size=10, microbatches=2)
    programs = build_stages(plan, traced, units, (x,))
    assert not programs[0].example_outputs[0].is_meta
    assert all(t.is_contiguous() for p in programs for t in (*p.example_inputs, *p.example_outputs))


@pytest.mark.parametrize(
    ("name", "kwargs", "starts"),
    [
        (*GPT, [0, 2, 4]),
        ("pipeplan.models.resnet:resnet", {"width": 4, "blocks": "1,1", "image": 8}, [0, 1, 3]),
    ],
)
def test_stage_modules_compose_to_the_model(name: str, kwargs: dict, starts: list[int]) -> None:
    spec = load_model(name, kwargs)
    inputs, _ = spec.batch(2)
    traced = trace_model(spec.module, inputs)
    plan = make_plan(name, kwargs, traced, starts=starts, batch_size=4, microbatches=2)
    programs = build_stages(plan, traced, group_units(traced), inputs)
    assert programs[-1].outputs == ()
    torch.testing.assert_close(_run_stages(programs, inputs), spec.module(*inputs))


def test_plan_for_another_graph_is_rejected() -> None:
    spec = load_model(*GPT)
    inputs, _ = spec.batch(2)
    traced = trace_model(spec.module, inputs)
    units = group_units(traced)
    plan = make_plan(GPT[0], GPT[1], traced, starts=[0, 3], batch_size=4, microbatches=2)
    check_plan(plan, traced, units)
    other = plan.model_copy(update={"graph_fingerprint": "0123456789abcdef"})
    with pytest.raises(FingerprintMismatchError, match=f"0123456789abcdef.*{traced.fingerprint}"):
        check_plan(other, traced, units)
    renamed = plan.stages[1].model_copy(update={"unit_names": ("blocks.2", "bogus", "head")})
    bad = plan.model_copy(update={"stages": (plan.stages[0], renamed)})
    with pytest.raises(FingerprintMismatchError, match="unit 4 'bogus'.*'blocks.3'"):
        check_plan(bad, traced, units)
    with pytest.raises(
        FingerprintMismatchError, match="plan covers 6 units but the model groups into 7"
    ):
        check_plan(plan, traced, units[:5] + units[5:] + units[:1])


@pytest.mark.parametrize("tie", [True, False])
def test_tied_embedding_and_head_are_found(tie: bool) -> None:
    spec = load_model(GPT[0], {**GPT[1], "tie_weights": tie})
    inputs, _ = spec.batch(2)
    traced = trace_model(spec.module, inputs)
    kwargs = {**GPT[1], "tie_weights": tie}
    plan = make_plan(GPT[0], kwargs, traced, starts=[0, 2, 4], batch_size=4, microbatches=2)
    programs = build_stages(plan, traced, group_units(traced), inputs)
    tied = tied_parameters([p.module for p in programs])
    assert [(t.name, t.stages) for t in tied] == ([("embed.tok.weight", (0, 2))] if tie else [])


def test_recompute_counts_batch_norm_statistics_once() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    wrapped = Recompute(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    wrapped.inner.load_state_dict(plain.state_dict())
    x = torch.randn(5, 3)
    plain(x).square().sum().backward()
    wrapped(x).square().sum().backward()
    torch.testing.assert_close(wrapped.inner.state_dict(), plain.state_dict())
    torch.testing.assert_close(wrapped.inner[0].weight.grad, plain[0].weight.grad)


def test_step_timer_spans_are_relative_and_ordered() -> None:
    timer = StepTimer(torch.device("cpu"))
    timer.begin()
    for i in range(2):
        with timer.span("forward", i):
            torch.randn(64, 64).sum()
    wall, spans = timer.end()
    assert [(s.kind, s.microbatch) for s in spans] == [("forward", 0), ("forward", 1)]
    assert 0 <= spans[0].start_s <= spans[0].end_s <= spans[1].start_s <= wall


def test_report_medians_trace_and_bubble() -> None:
    spec = load_model(*GPT)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(GPT[0], GPT[1], traced, starts=[0, 3], batch_size=4, microbatches=2)

    def step(stage: int, f: float, b: float) -> list[Span]:
        t0 = stage * 0.1
        return [
            Span("forward", 0, t0, t0 + f),
            Span("forward", 1, t0 + f, t0 + 2 * f),
            Span("backward", 0, 0.5, 0.5 + b),
            Span("backward", 1, 0.5 + b, 0.5 + 2 * b),
        ]

    records = [
        RankRecord(0, 1, walls=[1.0, 2.0, 1.5], spans=[step(0, 0.1, 0.2)] * 3),
        RankRecord(1, 1, walls=[1.1, 1.0, 1.0], spans=[step(1, 0.1, 0.2)] * 3, losses=[3, 2, 1]),
    ]
    report = build_report(plan, records, backend="gloo", warmup_steps=1)
    assert report.step_times_s == (1.1, 2.0, 1.5) and report.step_time_s == 1.5
    assert report.stages[0].forward_s == pytest.approx((0.1, 0.1))
    assert report.stages[1].backward_s == pytest.approx((0.2, 0.2))
    assert report.losses == (3, 2, 1)
    assert measured_bubble(report) == pytest.approx(1 - 0.6 / 1.5)
    trace = chrome_trace(report, plan)["traceEvents"]
    measured = [e for e in trace if e["ph"] == "X" and e["pid"] < 1000]
    assert {e["pid"] for e in measured} == {0, 1} and len(measured) == 8
    assert any(e["pid"] >= 1000 for e in trace if e["ph"] == "X")  # predicted timeline


def test_a_multi_chunk_report_has_times_per_chunk_and_memory_per_rank() -> None:
    """zbv on 2 ranks: rank 0 runs chunks 0 and 3 (the loss on 3), rank 1 chunks 1 and 2; the
    table compares each chunk's F, B, I and W, and each rank's peak with rank_peak_bytes."""
    spec = load_model(*GPT)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(GPT[0], GPT[1], traced, starts=[0, 1, 2, 3], batch_size=4, microbatches=2)
    plan = chunked(plan, "zbv", 2).model_copy(update={"rank_peak_bytes": (1000, 2000)})

    def step(chunks: tuple[int, int]) -> list[Span]:
        return [
            *(Span("forward", i, 0.1 * i, 0.1 * i + 0.01, c) for c in chunks for i in range(2)),
            *([Span("loss", 0, 0.3, 0.302)] if 3 in chunks else []),
            *(Span("backward_input", i, 0.4, 0.403, c) for c in chunks for i in range(2)),
            *(Span("backward_weight", i, 0.5, 0.501, c) for c in chunks for i in range(2)),
        ]

    records = [
        RankRecord(0, 1, walls=[1.0], spans=[step((0, 3))], losses=[1.0],
                   peak_memory_bytes=1100, chunks=[0, 3]),
        RankRecord(1, 1, walls=[1.0], spans=[step((1, 2))], peak_memory_bytes=1800,
                   chunks=[1, 2]),
    ]  # fmt: skip
    report = build_report(plan, records, backend="gloo", warmup_steps=0)
    assert [(s.stage, s.rank) for s in report.stages] == [(0, 0), (1, 1), (2, 1), (3, 0)]
    assert report.stages[3].forward_s == pytest.approx((0.012, 0.01))  # the loss on chunk 3
    assert report.stages[1].forward_s == pytest.approx((0.01, 0.01))
    assert report.stages[1].backward_s == pytest.approx((0.004, 0.004))  # I + W
    assert report.stages[1].backward_weight_s == pytest.approx((0.001, 0.001))
    assert report.stages[0].peak_memory_bytes is None  # memory is the rank's
    assert [(r.stages, r.peak_memory_bytes) for r in report.ranks] == [((0, 3), 1100),
                                                                       ((1, 2), 1800)]  # fmt: skip
    console = Console(width=200, record=True)
    print_comparison(report, plan, console)
    text = console.export_text()
    assert "memory per rank" in text and "I ms" in text and "W ms" in text
    rows = [[c.strip() for c in x.split("│")] for x in text.splitlines() if "│" in x]
    assert ["0", "0, 3", "1"] == rows[-2][1:4] and rows[-2][-3] == "+10.0%"
    assert ["1", "1, 2", "1"] == rows[-1][1:4] and rows[-1][-3] == "-10.0%"
    trace = chrome_trace(report)["traceEvents"]
    assert {(e["pid"], e["tid"]) for e in trace if e["ph"] == "X"} == {(0, 0), (0, 3), (1, 1),
                                                                       (1, 2)}  # fmt: skip


def test_comparison_table_shows_measured_memory_against_predicted() -> None:
    spec = load_model(*GPT)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(GPT[0], GPT[1], traced, starts=[0, 3], batch_size=4, microbatches=2)
    spans = [Span("forward", 0, 0.0, 0.1), Span("backward", 0, 0.2, 0.3)]
    predicted = plan.stages[0].memory.total
    records = [
        RankRecord(0, 1, walls=[1.0], spans=[spans], peak_memory_bytes=predicted * 11 // 10,
                   resident_growth_bytes=300 << 20),
        RankRecord(1, 1, walls=[1.0], spans=[spans], losses=[1.0]),
    ]  # fmt: skip
    report = build_report(plan, records, backend="gloo", warmup_steps=0)
    console = Console(width=200, record=True)
    print_comparison(report, plan, console)
    lines = console.export_text().splitlines()
    header = [c.strip() for c in next(x for x in lines if "┃" in x).split("┃")]
    first, second = ([c.strip() for c in x.split("│")] for x in lines if "│" in x)
    col = header.index("resident")
    assert first[col - 1] == "+10.0%" and first[col] == "300.00 MiB"
    assert second[col - 3] == "-" and second[col - 1] == "-" and second[col] == "-"


def _error(run_dir: Path, stage: int, message: str, peer: bool, time: float) -> None:
    data = {"stage": stage, "step": 1, "type": "RuntimeError", "message": message}
    data |= {"peer": peer, "time": time}
    (run_dir / f"error-{stage}.json").write_text(json.dumps(data))


SUMMARY = """Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 10849)  (SIGKILL)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 10848)
"""


def test_failure_names_the_stage_that_failed_first(tmp_path: Path) -> None:
    _error(tmp_path, 0, "Connection reset by peer", True, 1.0)
    _error(tmp_path, 2, "Connection closed by peer", True, 2.0)
    assert "stage 1 died with exit code -9 (SIGKILL)" in str(failure(tmp_path, 3, 1, SUMMARY))
    _error(tmp_path, 1, "boom", False, 3.0)
    msg = str(failure(tmp_path, 3, 1, SUMMARY))
    assert msg.startswith("stage 1 failed at step 1: RuntimeError: boom")
    assert "stages 0, 2 stopped" in msg


def test_a_rank_of_several_chunks_is_named_with_every_chunk(tmp_path: Path) -> None:
    """A V on 2 ranks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (issue 45)."""
    chunks = [[0, 3], [1, 2]]
    _error(tmp_path, 1, "Connection reset by peer", True, 1.0)
    msg = str(failure(tmp_path, 2, 1, SUMMARY.replace("rank      : 1", "rank      : 0"), None, 2,
                      chunks))  # fmt: skip
    assert msg.startswith("rank 0 (stages 0 and 3) died with exit code -9 (SIGKILL)")
    assert msg.endswith("(rank 1 stopped as a consequence)")
    _error(tmp_path, 0, "boom", False, 2.0)
    msg = str(failure(tmp_path, 2, 1, SUMMARY, None, 2, chunks))
    assert msg.startswith("rank 0 (stages 0 and 3) failed at step 1: RuntimeError: boom")
    msg = str(failure(tmp_path, 2, None, "", {1: 7.0}, 2, chunks))
    assert msg.startswith("rank 0 (stages 0 and 3) failed at step 1")  # its own error first
    (tmp_path / "error-0.json").unlink()
    (tmp_path / "error-1.json").unlink()
    msg = str(failure(tmp_path, 2, None, "", {1: 7.0}, 2, chunks))
    assert msg.startswith("rank 1 (stages 1 and 2) stopped making progress: no heartbeat for 7 s")


def test_a_tensor_parallel_rank_is_named_with_its_stage(tmp_path: Path) -> None:
    """pp 2 x tp 2: global rank 3 runs stage 1 (tp rank 1), rank 1 stage 0; a V's chunks
    follow the pipeline rank, not the global one."""
    _error(tmp_path, 3, "boom", False, 1.0)
    _error(tmp_path, 1, "Connection reset by peer", True, 2.0)
    msg = str(failure(tmp_path, 4, 1, SUMMARY, None, 2, None, 2))
    assert msg.startswith("stage 1 (rank 3) failed at step 1: RuntimeError: boom"), msg
    msg = str(failure(tmp_path, 4, 1, SUMMARY, None, 2, [[0, 3], [1, 2]], 2))
    assert msg.startswith("rank 3 (stages 1 and 2) failed at step 1"), msg


def test_a_rank_that_aborts_in_native_code_shows_why(tmp_path: Path) -> None:
    native = "terminate called after throwing an instance of 'gloo::IoException'\n"
    native += "  what():  [pair.cc:589] Connection closed by peer [127.0.0.1]:1234\n"
    _error(tmp_path, 0, "Connection reset by peer", True, 1.0)
    _error(tmp_path, 2, "Connection closed by peer", True, 2.0)
    msg = str(failure(tmp_path, 3, 1, native + SUMMARY))
    assert msg.startswith("stage 1 died with exit code -9 (SIGKILL) without a Python error: ")
    assert "terminate called after throwing an instance of 'gloo::IoException'" in msg
    assert "(killed, os._exit" not in msg


def test_the_same_error_on_every_rank_is_not_blamed_on_stage_0(tmp_path: Path) -> None:
    for stage in range(2):  # e.g. building the stages runs the model once on every rank
        _error(tmp_path, stage, "stage 1, unit 'emb': IndexError", False, 1.0 + stage)
    msg = str(failure(tmp_path, 2, 1, SUMMARY))
    assert msg == "every stage failed at step 1: RuntimeError: stage 1, unit 'emb': IndexError"


def test_failure_without_error_files_shows_the_log(tmp_path: Path) -> None:
    msg = str(failure(tmp_path, 2, 1, "line 1\nsomething broke\n"))
    assert "status 1" in msg and "something broke" in msg


def test_stages_built_for_another_device_run_there() -> None:
    """Export writes ``device=cpu`` literals into the graph; a stage on CUDA must not create
    tensors on the CPU.  ``meta`` stands in for CUDA here."""
    pytest.importorskip("transformers")
    kwargs = {"vocab": 32, "d_model": 16, "n_layers": 3, "n_heads": 2, "seq_len": 8}
    spec = load_model("pipeplan.models.hf:gpt2", kwargs)
    inputs, _ = spec.batch(2)
    traced = trace_model(spec.module, inputs)
    assert traced.tracer == "export"
    plan = make_plan(
        "pipeplan.models.hf:gpt2", kwargs, traced, starts=[0, 2, 4], batch_size=4, microbatches=2
    )
    meta = torch.device("meta")
    programs = build_stages(plan, traced, group_units(traced), inputs, device=meta)
    out: object = tuple(t.to(meta) for t in inputs)
    for prog in programs:
        out = prog.module.to(meta)(*out)
    out = programs[-1].module.rebuild_output(out)  # type: ignore[arg-type]
    assert isinstance(out, Tensor) and out.device == meta and out.shape == (2, 8, 32)


# What crosses a cut (multi-rank: one torchrun job for the module's carry tests).

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
