"""DeepSpeed's ``parts`` and layer list (:mod:`pipeplan.export.deepspeed`), and DeepSpeed 0.19.8's
own PipelineModule building every model's export on two gloo ranks, and the exported CONFIG as
DeepSpeed's ZeRO config parses it; a plan with tensor parallelism refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _export_rules import (
    MODELS,
    GiB,
    ds_fields,
    export_cli,
    meshed,
    named_profile,
    plan_of,
    user_model,
)

from pipeplan.export import export_plan
from pipeplan.planner.io import write_json
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers import SOLVERS


@pytest.mark.multirank
def test_deepspeed_builds_every_model(real, tmp_path: Path) -> None:
    """Each model's 2-stage plan ``--for deepspeed``, exported and built by DeepSpeed 0.19.8's
    own PipelineModule on two gloo ranks (``ds_pipeline.py``): each rank holds exactly the
    parameters of its stage's layers, a tied weight (GPT's, GPT-2's, Gemma's, BERT's embedding
    and head) is one TiedLayerSpec key, DeepSpeed's broadcast gives rank 1 (whose tied weights
    were shifted) rank 0's weight, and its all-reduce sums the tied gradients (1 + 2)."""
    pytest.importorskip("deepspeed")
    from pipeplan.api import target_allowed_cuts
    from pipeplan.solvers import SOLVERS

    jobs, stage_keys = [], {}
    for name, (model, kwargs, _, _) in MODELS.items():
        _, prof = real(name)
        options = PlanOptions(allowed_cuts=target_allowed_cuts(prof, "deepspeed"))
        plan = SOLVERS["dp"](prof, Cluster.homogeneous(2, GiB), options)
        result = export_plan(plan, "deepspeed", prof)
        export = tmp_path / f"ds_{name}.py"
        export.write_text(result.text)
        jobs.append({"model": model, "kwargs": kwargs, "export": str(export)})
        stage_keys[name] = result.stage_keys
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    script = Path(__file__).parent / "ds_pipeline.py"
    runs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", "29571", str(tmp_path / "jobs.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for i, name in enumerate(MODELS):
        root, _ = user_model(name)
        torch_name = {id(p): n for n, p in root.named_parameters()}  # a tied one: its owner's
        tied = {
            n for n, p in root.named_parameters(remove_duplicate=False) if torch_name[id(p)] != n
        }
        for rank in range(2):
            got = outs[rank][i]
            assert got["stage"] == rank and got["layers"] == list(stage_keys[name][rank])
            want = {
                torch_name[id(p)]
                for layer in got["layers"]
                for p in root.get_submodule(layer).parameters()
            }
            assert set(got["held"]) == want, name
            assert got["tied_equal"] == [True] * len(got["tied_equal"]), name
            assert got["tied_grads"] == [3.0] * len(got["tied_grads"]), name
            if tied and len(got["tie_keys"]) == 0:
                assert name not in ("gpt", "gpt2", "gemma", "bert"), (name, tied)
        if name in ("gpt", "gpt2", "gemma", "bert"):
            assert outs[0][i]["tie_keys"] and outs[0][i]["tie_keys"] == outs[1][i]["tie_keys"]


def test_stdout_and_file_agree_and_tied_modules_stay_in_both_stages(tmp_path, cli) -> None:
    # gpt2-like: the tied embedding is named with the head in the first unit.
    names = [
        "lm_head+transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f+lm_head",
    ]
    prof = named_profile(names)
    plan_file = tmp_path / "plan.json"
    write_json(plan_file, plan_of(prof, [0, 2]))
    code, out, _ = cli(["export", str(plan_file), "--to", "deepspeed"])
    assert code == 0
    code, text, err = export_cli(cli, plan_file, "deepspeed", tmp_path)
    assert code == 0 and text == out
    assert err == (
        "note: deepspeed: lm_head is named in stages [0, 1]: they share a tied parameter, and a "
        "stage that only reads it (a tied embedding) is named after the module that owns it\n"
    )
    body: Any = ds_fields(text)
    assert body["parts"] == [0, 3, 6]  # lm_head on both ends, as DeepSpeed's TiedLayerSpec
    assert body["layers"] == [
        "lm_head",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]


@pytest.mark.parametrize(("mode", "stage"), [("shard", 1), ("replicate", 0)])
def test_deepspeed_config_carries_the_batch_and_zero_stage(mode: str, stage: int) -> None:
    """The exported module's CONFIG: the plan's micro-batch size and count, the global batch,
    and ZeRO stage 1 for a sharded plan, as DeepSpeed's own ZeRO config parses it (its
    PipelineEngine refuses stages 2 and 3)."""
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    prof = synthetic_profile(6, batch_size=16, microbatch_sizes=[2, 4], seed=1)
    cluster = Cluster.homogeneous(2, GiB).model_copy(
        update={"data_parallel": 4, "data_parallel_mode": mode}
    )
    plan = SOLVERS["dp"](prof, cluster, PlanOptions(microbatches=4))
    text = export_plan(plan, "deepspeed", prof).text
    config_line = next(ln for ln in text.splitlines() if ln.startswith("CONFIG = "))
    config = eval(config_line.removeprefix("CONFIG = "))  # a Python literal
    assert config["train_micro_batch_size_per_gpu"] == plan.microbatch_size
    assert config["gradient_accumulation_steps"] == plan.microbatches == 4
    assert config["train_batch_size"] == plan.batch_size * 4
    assert zero_config.DeepSpeedZeroConfig(**config["zero_optimization"]).stage == stage


def test_deepspeed_refuses_tensor_parallelism_in_one_line(tmp_path: Path, cli) -> None:
    """DeepSpeed 0.19's PipelineEngine has no tensor parallelism of its own: AutoTP's mesh is
    (data_parallel, tensor_parallel), the world over t, with no pipeline axis (the signature
    pins it: if a later DeepSpeed adds one, this test says so).  A plan with t = 2 is one line
    naming the fix, exit 2, and no file; the same plan with t = 1 exports."""
    groups = pytest.importorskip("deepspeed.utils.groups")
    import inspect

    assert list(inspect.signature(groups._init_tp_mesh_device).parameters) == [
        "tensor_model_parallel_size",
        "data_parallel_size",
    ]
    plan = plan_of(named_profile(["embed", "blocks.0", "blocks.1", "head"]), [0, 2])
    for t in (2, 1):
        plan_file = tmp_path / f"plan{t}.json"
        write_json(plan_file, meshed(plan, t))
        code, text, err = export_cli(cli, plan_file, "deepspeed", tmp_path)
        if t == 2:
            assert (code, text, err.count("\n")) == (2, "", 1)
            assert err.startswith("error: deepspeed: its PipelineEngine has no tensor parallelism")
            assert err.endswith(
                "cannot run the plan's tensor-parallel degree 2; export --to megatron or "
                "torchtitan, or plan with tensor parallelism 1\n"
            )
        else:
            assert code == 0 and "PARTS = [0, 2, 4]" in text
