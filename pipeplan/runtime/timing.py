"""Timers for one rank's pipeline step: spans of forward and backward per micro-batch and
stage (chunk), the backward whole (B) or split into its input and weight halves (I, W).

On CPU a span is two ``time.perf_counter()`` readings; on CUDA two CUDA events, read after the
step's final synchronisation, so timing never stalls the stream.  Every time is relative to
the start of the step on the rank that measured it (ranks start each step after a barrier).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Span", "SpanKind", "StepTimer"]

SpanKind = Literal[
    "forward",
    "backward",
    "backward_input",
    "backward_weight",
    "loss",
    "tied",
    "replicas",
    "optimizer",
]
"""``backward_input``/``backward_weight``: the zero-bubble schedules' I and W; ``tied``: summing
tied gradients across ranks; ``optimizer``: the optimizer step (both once per step,
micro-batch -1)."""


@dataclass(frozen=True, slots=True)
class Span:
    kind: SpanKind
    microbatch: int
    start_s: float
    end_s: float
    stage: int = -1
    """The stage (chunk) it ran; -1 for the rank's own spans (loss, tied, optimizer)."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class StepTimer:
    """Collects :class:`Span` s between :meth:`begin` and :meth:`end` of a step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._t0 = 0.0
        self._start_event: torch.cuda.Event | None = None
        self._cpu: list[Span] = []
        self._gpu: list[tuple[SpanKind, int, int, torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self) -> None:
        self._cpu, self._gpu = [], []
        if self.cuda:
            torch.cuda.synchronize()
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        self._t0 = time.perf_counter()

    def end(self) -> tuple[float, list[Span]]:
        """Wait for the device; return the step's wall time and its spans in start order."""
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        spans = list(self._cpu)
        if self.cuda and self._start_event is not None:
            ref = self._start_event
            for kind, mb, st, a, b in self._gpu:
                start, end = ref.elapsed_time(a) / 1e3, ref.elapsed_time(b) / 1e3
                spans.append(Span(kind, mb, start, end, st))
        return wall, sorted(spans, key=lambda s: s.start_s)

    @contextlib.contextmanager
    def span(self, kind: SpanKind, microbatch: int, stage: int = -1) -> Iterator[None]:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self._gpu.append((kind, microbatch, stage, a, b))
            return
        start = time.perf_counter() - self._t0
        yield
        self._cpu.append(Span(kind, microbatch, start, time.perf_counter() - self._t0, stage))
