"""The runtime's step timer on CUDA (pipeplan.runtime.timing), on a faked one-GPU
``torch.cuda``: spans are event pairs read after the step's synchronisation, relative to the
step's start event."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeplan.runtime.timing import StepTimer


def test_cuda_spans_are_events_relative_to_the_steps_start(fake_cuda: SimpleNamespace) -> None:
    timer = StepTimer(torch.device("cuda", 0))
    fake_cuda.now = 10.0
    timer.begin()
    fake_cuda.now = 10.5
    with timer.span("forward", 0):
        fake_cuda.now = 11.0
    with timer.span("backward", 0):
        fake_cuda.now = 12.5
    syncs = fake_cuda.syncs
    _, spans = timer.end()
    assert fake_cuda.syncs == syncs + 1  # read once, after the step's work is done
    got = [(s.kind, s.microbatch, s.start_s, s.end_s) for s in spans]
    assert got == [
        ("forward", 0, pytest.approx(0.5), pytest.approx(1.0)),
        ("backward", 0, pytest.approx(1.0), pytest.approx(2.5)),
    ]


def test_cuda_spans_keep_the_stage_a_multi_chunk_rank_ran(fake_cuda: SimpleNamespace) -> None:
    """A rank of several chunks names each span's chunk, on CUDA as on CPU (the I and W of a
    zero-bubble schedule included)."""
    timer = StepTimer(torch.device("cuda", 0))
    fake_cuda.now = 0.0
    timer.begin()
    for stage, kind in ((3, "forward"), (3, "backward_input"), (0, "backward_weight")):
        with timer.span(kind, 1, stage):  # type: ignore[arg-type]
            fake_cuda.now += 1.0
    _, spans = timer.end()
    assert [(s.kind, s.stage) for s in spans] == [
        ("forward", 3),
        ("backward_input", 3),
        ("backward_weight", 0),
    ]
