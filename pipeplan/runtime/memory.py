"""A rank's peak memory: its tensors, not its libraries.

On CUDA it is ``torch.cuda.max_memory_allocated`` after the warm-up steps (the caching
allocator's own count of live tensor bytes).

On CPU there is no allocator counter, so the rank runs one more step after the measured ones
with the profiler recording every allocation and free of the CPU allocator
(``torch.profiler``, ``profile_memory=True``; :class:`TensorPeak`).  The peak is the bytes of
the tensors alive when that step starts (:func:`held_bytes`: parameters, their gradients,
buffers, optimizer state) plus the highest running sum of the step's allocations minus frees:
the same quantity as CUDA's, tracked allocations rather than what the process maps.

Beside it, :class:`ResidentPeak` gives the process's peak *resident-set growth*:
the kernel's high-water mark ``VmHWM`` (``/proc/self/status``) minus the resident size at a
baseline taken after torch, the process group and the libraries are loaded and before the
model is built.  The high-water mark is reset at the baseline (``/proc/self/clear_refs``, value
5, Linux 4.0+).  The heap keeps freed memory mapped (:mod:`pipeplan.planner.allocator`), so the growth
counts the largest set of tensors alive at once plus what the allocator keeps around them; it
also counts the model's Python objects (the traced graph) and the communication buffers, which
is why a stage's measurement exceeds its predicted tensors by a small fixed amount
(``benchmarks/memory``).  Where ``/proc`` is not available the measurement is ``None``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from pipeplan.runtime.mesh import local

if TYPE_CHECKING:  # importing torch.distributed.pipelining takes seconds
    from torch.distributed.pipelining import PipelineStage

__all__ = ["ResidentPeak", "TensorPeak", "held_bytes", "live_bytes"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(key: str) -> int | None:
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    match = re.search(rf"^{key}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


class ResidentPeak:
    """Peak resident-set growth since :meth:`start` (bytes), for a CPU rank.

    >>> peak = ResidentPeak()
    >>> peak.start()
    >>> import mmap
    >>> block = mmap.mmap(-1, 64 << 20)  # fresh pages: a freed heap could hold a bytearray
    >>> for i in range(0, 64 << 20, 4096):
    ...     block[i] = 1
    >>> (peak.growth() or 0) >= 60 << 20 or peak.growth() is None
    True
    """

    def __init__(self) -> None:
        self._base: int | None = None

    def start(self) -> None:
        """Take the baseline now and reset the kernel's high-water mark to it."""
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:
            self._base = None
            return
        self._base = _status_kib("VmRSS")

    def growth(self) -> int | None:
        """Bytes the resident set grew to, at its peak, over the baseline (``None``: unknown)."""
        hwm = _status_kib("VmHWM")
        if self._base is None or hwm is None:
            return None
        return max(0, hwm - self._base) * 1024


def live_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.is_meta:
            continue
        t = local(t)  # a sharded (FSDP2) tensor holds its shard
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _pipeline_buffers(stages: Sequence[PipelineStage]) -> list[Tensor]:
    """The pipeline's receive buffers, one per micro-batch for the stage's inputs and for
    its output's gradient: made at the first step and kept."""
    infos = [
        info
        for stage in stages
        for info in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
    ]
    return [i.buffer for info in infos for i in info if getattr(i, "buffer", None) is not None]


def held_bytes(
    stages: Sequence[PipelineStage],
    modules: Sequence[nn.Module],
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    inputs: Sequence[Tensor] = (),
) -> int:
    """Bytes a rank holds at the start of a step: its stages' parameters, gradients, buffers
    and optimizer state (``modules``, ``params``, ``optimizer``), the pipeline's receive
    buffers (``stages``'), and ``inputs`` (the first stage's batch, made before the step)."""
    state = [t for s in optimizer.state.values() for t in s.values()]
    buffers = dict.fromkeys(b for m in modules for b in m.buffers())
    return live_bytes(
        [
            *inputs,
            *_pipeline_buffers(stages),
            *params,
            *(p.grad for p in params),
            *buffers,
            *(t for t in state if isinstance(t, Tensor)),
        ]
    )


class TensorPeak:
    """Peak bytes of live CPU tensors over a block: ``live`` (bytes alive at its start) plus the
    highest running sum of the allocations and frees the profiler records inside it.

    >>> tracker = TensorPeak()
    >>> with tracker.track(live=0):
    ...     a = torch.ones(1 << 20)
    ...     del a
    ...     b = torch.ones(1 << 19)
    >>> tracker.peak_bytes >= 4 << 20
    True
    """

    def __init__(self) -> None:
        self.peak_bytes: int | None = None

    @contextmanager
    def track(self, live: int) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        cpu = torch._C._autograd.DeviceType.CPU
        running = highest = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            if e.device_type() == cpu:
                running += e.nbytes()
                highest = max(highest, running)
        self.peak_bytes = live + highest
