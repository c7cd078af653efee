"""A new user's first hour: three models go from ``pipeplan profile`` to ``pipeplan run`` with the
default options and no code beyond the model callable (the command line, as subprocesses);
only the llama keeps the profiler's default warm-up and repeats, which the others' behaviour
does not depend on.

- a plain ``nn.Sequential`` body behind a wrapper, with one dominant layer (``_user_models``);
- a model whose ``forward`` returns a dict;
- torchvision's ViT as it is (``pipeplan.models.vision``, issue 31);
- an unwrapped ``transformers`` model (``pipeplan.models.zoo:llama``: a ``LlamaForCausalLM`` as it is),
  in float32 and in bfloat16 (gloo carries bfloat16 tensors).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

HERE = Path(__file__).parent

FAST = ["--warmup", "1", "--repeats", "1"]  # behaviour, not timing

CASES = {
    "sequential": ["_user_models:sequential", *FAST],
    "dict_output": ["_user_models:dict_output", *FAST],
    # the one case profiled with the default warm-up and repeats
    "llama": ["pipeplan.models.zoo:llama", "--model-arg", "d_model=16", "--model-arg", "seq_len=8"],
    # issue 31: a bare class_token, which only --init auto (the default) builds
    "vision-vit": ["pipeplan.models.vision:vit", "--model-arg", "image=32", *FAST],
    # bfloat16 through the profiler and across gloo
    "llama-bfloat16": [
        "pipeplan.models.zoo:llama",
        "--model-arg",
        "d_model=16",
        "--model-arg",
        "seq_len=8",
        "--dtype",
        "bfloat16",
        *FAST,
    ],
}


def _pipeplan(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.getcwd()])}
    cmd = [sys.executable, "-c", "from pipeplan.cli import main; main()", *args]
    return subprocess.run(
        cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("name", list(CASES))
def test_profile_plan_run_with_defaults(name: str, tmp_path: Path) -> None:
    model, *extra = CASES[name]
    prof = _pipeplan("profile", model, "-b", "8", *extra, "-o", "p.json", cwd=tmp_path)
    assert prof.returncode == 0, prof.stderr[-2000:]
    plan = _pipeplan("plan", "p.json", "--stages", "2", "--memory", "1GiB", "-o", "plan.json",
                     cwd=tmp_path)  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    run = _pipeplan("run", "plan.json", "--steps", "2", "--warmup", "0", "--report", "r.json",
                    cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "r.json").exists()
    assert (
        "profiled pipeplan.models.zoo:llama (whole):" in prof.stdout or name != "llama"
    )  # no emoji
