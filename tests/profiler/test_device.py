"""The profiler's CUDA branches (pipeplan.profiler.device) on a faked one-GPU ``torch.cuda``:
times come from CUDA events, peaks from the allocator's counters, never from the host."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.profiler.device import Clock, available_bytes, device_info, resolve_device

GPU = torch.device("cuda", 0)


def test_clock_times_cuda_work_with_events_not_the_host(fake_cuda: SimpleNamespace) -> None:
    def work() -> str:
        fake_cuda.now += 0.25  # the kernels take 250 ms on the device
        return "done"

    t0 = time.perf_counter()
    out, seconds = Clock(GPU).time(work)
    assert time.perf_counter() - t0 < 0.25  # the host did not wait that long: events did
    assert (out, seconds) == ("done", pytest.approx(0.25))
    assert fake_cuda.syncs >= 1  # queued work is not billed to this measurement


def test_clock_peak_is_the_allocators_high_water_mark_above_the_base(
    fake_cuda: SimpleNamespace,
) -> None:
    clock = Clock(GPU)
    fake_cuda.allocated = 100
    base = clock.reset_peak()
    fake_cuda.peak, fake_cuda.allocated = 400, 150  # a step allocated 300 B above, freed most
    assert (base, clock.peak_since(base)) == (100, 300)
    assert Clock(torch.device("cpu")).peak_since(0) is None


def test_cuda_devices_are_checked_against_what_is_visible(fake_cuda: SimpleNamespace) -> None:
    assert resolve_device("cuda") == GPU
    with pytest.raises(InvalidRequestError, match="only 1 CUDA devices are visible"):
        resolve_device("cuda:1")


def test_a_cuda_profile_records_the_gpu(fake_cuda: SimpleNamespace) -> None:
    info = device_info(GPU)
    assert (info.kind, info.name, info.memory_bytes) == ("cuda", "Fake H100", 80 * 2**30)
    assert available_bytes(GPU) == 70 * 2**30  # free device memory, not the host's
