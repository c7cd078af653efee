"""Fixtures shared across the test packages."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeplan.cli import main

CliRunner = Callable[[list[str]], tuple[int, str, str]]

# The runtime's job helpers (tests/runtime/_*.py) import one another by name; so does
# tests/test_cli_runtime.py, which runs ``pipeplan run`` end to end.
sys.path.insert(0, str(Path(__file__).parent / "runtime"))


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker (``make test`` runs two) computes on one thread: two workers with a
    thread per core each, beside the ranks they launch, oversubscribe CI's two cores, and
    OpenMP's waiting threads then spin.  The unsplit MobileNetV3's float64 reference of
    tests/zoo/test_vision_sweep.py took 77 s on two threads and 0.5 s on one on a busy host.
    Whatever measures sets its own threads (``profile_model``, the ranks), so no check moves.
    The processes the tests start (DeepSpeed's and torchtitan's ranks, notebook kernels, the
    command line) inherit one OpenMP thread too: DeepSpeed's build of every export, whose two
    ranks took two threads each, ran 100 s in the suite and 15 s with one (23 s alone)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _pipeplan_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test (and every process it starts) keeps its calibrations in a directory of its own:
    one left on the developer's machine, or by another test, must not change what it plans."""
    monkeypatch.setenv("PIPEPLAN_HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> CliRunner:
    """Run ``pipeplan ARGV`` in-process; returns (exit code, stdout, stderr)."""

    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """``torch.cuda`` as a machine with one GPU, for the CUDA-only branches on a CPU host:
    events read a clock the test advances (``state.now``, seconds), the allocator's counters
    are ``state.allocated`` and ``state.peak``, and ``state.syncs`` counts synchronisations."""
    import torch

    state = SimpleNamespace(now=0.0, allocated=0, peak=0, syncs=0)

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t: float | None = None

        def record(self, stream: object = None) -> None:
            self.t = state.now

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: Event) -> float:
            assert self.t is not None and end.t is not None, "elapsed_time of unrecorded events"
            return (end.t - self.t) * 1e3  # milliseconds, as CUDA's

    def synchronize(device: object = None) -> None:
        state.syncs += 1

    def reset_peak(device: object = None) -> None:
        state.peak = state.allocated

    props = SimpleNamespace(name="Fake H100", total_memory=80 * 2**30, major=9, minor=0)
    fakes = {
        "Event": Event,
        "synchronize": synchronize,
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "reset_peak_memory_stats": reset_peak,
        "memory_allocated": lambda device=None: state.allocated,
        "max_memory_allocated": lambda device=None: state.peak,
        "get_device_properties": lambda device=None: props,
        "mem_get_info": lambda device=None: (70 * 2**30, 80 * 2**30),
    }
    for name, value in fakes.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    return state
