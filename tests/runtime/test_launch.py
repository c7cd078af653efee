"""The launcher (``pipeplan run`` before the ranks start) imports what it checks and no more:
torch's pipelining, DTensor and dynamo (about 2 s) belong to the ranks, which import them
again.  Read from ``sys.modules`` in a process of its own, so a top-level import of the
engine in :mod:`pipeplan.runtime` or in anything the launcher imports fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _imported(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    proc = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(proc.stdout.split())


def test_the_launcher_leaves_the_engine_and_torchs_pipelining_to_the_ranks() -> None:
    mods = _imported(
        "from pipeplan.runtime import preflight\n"
        "from pipeplan.runtime.launch import launch\n"
        "from pipeplan.runtime.stages import check_plan, check_schedule\n"
        "from pipeplan.intake.spec import cast_batch\n"
        "from pipeplan.planner.host import threads_mismatch, threads_per_rank"
    )
    assert "torch" in mods and "pipeplan.runtime.launch" in mods
    assert "pipeplan.runtime.engine" not in mods
    assert "torch.distributed.pipelining" not in mods


def test_the_runtime_package_still_exports_the_engine() -> None:
    from pipeplan import runtime
    from pipeplan.runtime.engine import PipelineRunner

    assert runtime.PipelineRunner is PipelineRunner
    assert sorted(runtime.__all__) == sorted(runtime._HOME)


GPT = (
    "pipeplan.models.gpt:gpt",
    {"vocab": 32, "d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8},
)


@pytest.mark.parametrize("limit", [0, 2 << 30])
def test_preflight_builds_a_large_model_on_meta_and_a_small_one_for_real(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """Above ``REAL_BUILD_BYTES`` of planned parameters the launcher holds no weights: the
    model is built and traced on meta, to the same graph, so the plan still checks."""
    import pipeplan
    from pipeplan.intake import model as model_module
    from pipeplan.planner.io import write_json
    from pipeplan.runtime import launch

    prof = pipeplan.profile(GPT[0], batch_size=8, model_kwargs=GPT[1], microbatch_sizes=[2],
                            warmup=0, repeats=1, progress=False)  # fmt: skip
    plan = pipeplan.plan(prof, stages=2, memory="1GiB", microbatches=4, calibrated=False)
    path = tmp_path / "plan.json"
    write_json(path, plan)
    assert 0 < launch._param_bytes(plan) < 2 << 30
    builds: list[bool] = []
    real_load = model_module.load_model

    def spy(*args: Any, meta: bool = False, **kwargs: Any) -> Any:
        builds.append(meta)
        return real_load(*args, meta=meta, **kwargs)

    monkeypatch.setattr(model_module, "load_model", spy)
    monkeypatch.setattr(launch, "REAL_BUILD_BYTES", limit)
    assert launch.preflight(path).fingerprint == plan.fingerprint
    assert builds[0] is (limit == 0)  # (a meta build calls load_model again, inside)


def test_the_agent_preloads_transformers_and_pipeplans_models_but_not_a_users_module() -> None:
    from pipeplan.runtime.launch import preloads

    assert preloads("hf:configs/llama.json") == ["transformers"]
    assert preloads("pipeplan.models.gpt:gpt") == ["pipeplan.models.gpt"]
    assert preloads("my_model:build") == []  # its import may start threads or a GPU


FORKRUN_SUMMARY = """Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_01:03:46
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 17813)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 17813
"""


def test_a_killed_rank_is_named_when_the_agent_lists_only_it(tmp_path: Path) -> None:
    """forkrun's agent lists the first rank it saw end; the peer it stopped before that peer
    wrote an error file is not listed, and is not taken for a second death."""
    from pipeplan.runtime.launch import failure

    err = failure(tmp_path, 2, 1, FORKRUN_SUMMARY)
    assert str(err).startswith("stage 1 died with exit code -9 (SIGKILL) without a Python error")
    both = FORKRUN_SUMMARY.replace(
        "[0]:", "[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 1)  (SIGTERM)\n[1]:"
    )
    assert str(failure(tmp_path, 2, 1, both)).startswith("stage 1 died with exit code -9")
