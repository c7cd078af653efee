"""The launcher (``pipeplan run`` before the ranks start) imports what it checks and no more:
torch's pipelining, DTensor and dynamo (about 2 s) belong to the ranks, which import them
again.  Read from ``sys.modules`` in a process of its own, so a top-level import of the
engine in :mod:`pipeplan.runtime` or in anything the launcher imports fails here."""

from __future__ import annotations

import subprocess
import sys


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
