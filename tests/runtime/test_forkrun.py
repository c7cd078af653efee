"""``python -m pipeplan.runtime.forkrun``: torchrun's agent with ranks forked from it.

Each test launches 2 ranks of a small script and reads what they wrote: the environment
torchrun gives (rank, world, ``OMP_NUM_THREADS`` in effect), a session per rank, a module
run as ``__main__``, torchrun's failure summary for a rank that raises and one that is killed,
and how long the agent takes to stop a rank blocked in a collective once its peer died."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

RANK = """
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(t),
       "threads": torch.get_num_threads(), "argv": sys.argv[1:], "name": __name__,
       "session_leader": os.getsid(0) == os.getpid(), "forked": os.environ.get("PIPEPLAN_FORKED_RANK"),
       "pipelining_preloaded": "torch.distributed.pipelining" in sys.modules,
       "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}
what = sys.argv[1]
if what == "raise" and dist.get_rank() == 1:
    raise ValueError("rank 1 raised")
if what == "kill":  # 3 ranks: 2 dies; 0 and 1 wait in gloo's recv for each other, alive
    import signal
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.recv(torch.zeros(1), src=1 - dist.get_rank())
open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}.json"), "w").write(json.dumps(out))
dist.destroy_process_group()
sys.exit(0)
"""


def _forkrun(
    tmp_path: Path, *target: str, preload: str | None = None, ranks: int = 2
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pipeplan.runtime.forkrun",
           *(["--preload", preload] if preload else []), "--standalone",
           "--nproc-per-node", str(ranks), "--monitor-interval", "0.1", *target]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=120)
    return proc, time.monotonic() - start


def _ranks(tmp_path: Path) -> list[dict[str, object]]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_script_runs_on_each_rank_with_torchruns_environment(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(RANK)
    proc, _ = _forkrun(tmp_path, str(tmp_path / "job.py"), "ok", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["world"] == 2 and r["sum"] == 3.0
        assert r["threads"] == 1  # torchrun's OMP_NUM_THREADS=1 for several ranks, in effect
        assert r["argv"] == ["ok", str(tmp_path)] and r["name"] == "__main__"
        assert r["session_leader"] and r["forked"] == "1"
        assert r["pipelining_preloaded"]
        assert r["nvml_check"] is None  # the agent's fork-safe CUDA check is not the rank's


def test_the_agent_leaves_cuda_uninitialized_before_it_forks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CUDA build, ``torch.cuda.is_available()``'s default answer (the runtime's device
    count) initializes the driver and poisons every fork; torch's launcher config asks it.  A
    CUDA build is faked whose runtime count raises and whose NVML count is 1: the agent must
    reach its launch without the runtime's count (an H200 failed every forked rank so)."""
    import torch
    from torch.distributed.launcher import api as launcher_api

    from pipeplan.runtime import forkrun

    for name in forkrun.PRELOAD:  # imported on the CPU build, before it is faked
        importlib.import_module(name)

    def poisoned() -> int:
        raise AssertionError("torch.cuda's runtime device count: the fork is poisoned")

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.delenv(forkrun.NVML_SET, raising=False)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", poisoned, raising=False)
    launched: list[object] = []
    monkeypatch.setattr(
        launcher_api, "elastic_launch", lambda config, entrypoint: lambda *a: launched.append(a)
    )
    with pytest.raises(AssertionError, match="poisoned"):  # what torch's default check does
        torch.cuda.is_available()
    forkrun.main(["--standalone", "--nproc-per-node", "1", "-m", "some.module", "x"])
    assert launched == [(True, "some.module", "x")]
    assert os.environ.pop(forkrun.NVML_SET) == "1"  # for the ranks to undo
    assert os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"


def test_a_module_runs_as_main(tmp_path: Path) -> None:
    (tmp_path / "forkrun_job_module.py").write_text(RANK)
    proc, _ = _forkrun(tmp_path, "-m", "forkrun_job_module", "ok", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(r["name"] == "__main__" for r in _ranks(tmp_path))


def test_a_rank_that_raises_is_torchruns_root_cause(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(RANK)
    proc, _ = _forkrun(tmp_path, str(tmp_path / "job.py"), "raise", str(tmp_path))
    assert proc.returncode == 1
    root = proc.stderr.split("Root Cause")[1]
    assert "rank      : 1 (local_rank: 1)" in root and "ValueError: rank 1 raised" in root


def test_a_killed_rank_stops_its_blocked_peer_at_once(tmp_path: Path) -> None:
    """The agent SIGTERMs the ranks blocked in gloo's ``recv``: each must die as a new
    interpreter does, not run the agent's handler, which a fork inherits and which would wait
    for the receive to return (and the agent 30 s before its SIGKILL)."""
    (tmp_path / "job.py").write_text(RANK)
    proc, took = _forkrun(tmp_path, str(tmp_path / "job.py"), "kill", str(tmp_path), ranks=3)
    assert proc.returncode == 1
    root = proc.stderr.split("Root Cause")[1]
    assert "rank      : 2 (local_rank: 2)" in root and "exitcode  : -9" in root, root
    assert took < 20, f"{took:.1f} s"


def test_no_python_is_refused_in_one_line(tmp_path: Path) -> None:
    proc, _ = _forkrun(tmp_path, "--no-python", "true")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: forkrun forks Python ranks: drop --no-python and --run-path, or use torchrun"
    ]


def test_a_preloaded_module_is_in_the_ranks_and_one_that_fails_is_left_to_them(
    tmp_path: Path,
) -> None:
    """The rank's script never imports ``forkrun_preloaded``: it holds it from the agent."""
    job = RANK.replace(
        '"name": __name__', '"name": __name__, "preloaded": "forkrun_preloaded" in sys.modules'
    )
    (tmp_path / "job.py").write_text(job)
    (tmp_path / "forkrun_preloaded.py").write_text("VALUE = 1\n")
    proc, _ = _forkrun(tmp_path, str(tmp_path / "job.py"), "ok", str(tmp_path),
                       preload="forkrun_preloaded,no_such_module_here")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["preloaded"] for r in _ranks(tmp_path)] == [True, True]


def test_without_preload_the_ranks_do_not_hold_it(tmp_path: Path) -> None:
    job = RANK.replace(
        '"name": __name__', '"name": __name__, "preloaded": "forkrun_preloaded" in sys.modules'
    )
    (tmp_path / "job.py").write_text(job)
    (tmp_path / "forkrun_preloaded.py").write_text("VALUE = 1\n")
    proc, _ = _forkrun(tmp_path, str(tmp_path / "job.py"), "ok", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["preloaded"] for r in _ranks(tmp_path)] == [False, False]
