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
