"""The device being profiled: checking the request, describing it, and timing work on it.

CPU work is timed with ``time.perf_counter``; CUDA work with ``torch.cuda.Event`` pairs after a
``torch.cuda.synchronize()`` so that queued kernels are not billed to the next measurement.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.host import host_available_bytes
from pipeplan.planner.types import DeviceInfo

__all__: list[str] = []

T = TypeVar("T")


def resolve_device(device: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, checked against what this machine has."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidRequestError(f"device {device!r} is not a device; use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"device {device!r} is not supported; use cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidRequestError(
                f"device {device!r} requested but CUDA is not available "
                f"(torch {torch.__version__}); profile with --device cpu"
            )
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            raise InvalidRequestError(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA devices are visible"
            )
        dev = torch.device("cuda", index)
    return dev


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_info(dev: torch.device) -> DeviceInfo:
    """What the profile records about the device."""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return DeviceInfo(kind="cuda", name=props.name, memory_bytes=int(props.total_memory))
    try:
        memory: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    return DeviceInfo(
        kind="cpu", name=_cpu_name(), threads=torch.get_num_threads(), memory_bytes=memory
    )


class Clock:
    """Times a callable on one device; optionally tracks CUDA peak memory."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.cuda = dev.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def time(self, fn: Callable[[], T]) -> tuple[T, float]:
        """Run ``fn`` once; return its result and the seconds it took on the device."""
        self.sync()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1000.0
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    def reset_peak(self) -> int:
        """Start a peak-memory window; returns the bytes allocated now (0 on CPU)."""
        if not self.cuda:
            return 0
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.dev)
        return int(torch.cuda.memory_allocated(self.dev))

    def peak_since(self, base: int) -> int | None:
        """Peak bytes allocated above ``base`` since :meth:`reset_peak` (``None`` on CPU)."""
        if not self.cuda:
            return None
        self.sync()
        return max(0, int(torch.cuda.max_memory_allocated(self.dev)) - base)


def available_bytes(dev: torch.device) -> int:
    """Memory available for a profile on ``dev``: CUDA's free device memory, or the host's
    ``MemAvailable`` (``/proc/meminfo``; physical memory where there is none)."""
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    return host_available_bytes()
