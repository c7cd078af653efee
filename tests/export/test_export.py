"""`pipeplan export` (:mod:`pipeplan.export`): every format read back by its target's rules
(``_export_rules``), schedules, the plans no target can run, bad input and the console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _export_rules import (
    MODELS,
    T5_NAMES,
    GiB,
    blocks_per_stage,
    deepspeed_owner,
    ds_fields,
    export_cli,
    megatron_args,
    megatron_core_layers,
    megatron_parse,
    megatron_uneven,
    megatron_validate,
    named_profile,
    params_of,
    plan_of,
    stage_params,
    titan_children,
    titan_config,
    titan_split,
    user_model,
)
from torch import nn

from pipeplan.export import export_plan
from pipeplan.planner.io import load_plan, write_json
from pipeplan.planner.types import Cluster, Plan, PlanOptions
from pipeplan.profiler import profile_model
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers import SOLVERS


@pytest.mark.parametrize("name", list(MODELS))
def test_every_format_keeps_each_stage_s_parameters(name: str, real, tmp_path: Path, cli) -> None:
    """Profile -> plan (the DP, 3 stages) -> export, each format read back by the target's
    rules: the modules each stage keeps hold exactly the parameters of the plan's stage (the
    closest expressible plan's, where the target moved a cut)."""
    profile_file, prof = real(name)
    plan_file = tmp_path / "plan.json"
    code, _, err = cli(
        ["plan", str(profile_file), "--stages", "3", "--memory", "1GiB", "--schedule", "gpipe"]
        + ["-o", str(plan_file)]
    )
    assert code == 0, err
    plan = load_plan(plan_file)
    root, prefix = user_model(name)
    args = ("--profile", str(profile_file))

    def target_plan(target: str, err: str) -> Plan:
        """The plan the export describes: the plan, or the closest one the note announces."""
        result = export_plan(plan, target, prof)  # type: ignore[arg-type]
        if result.adjustment is None:
            assert "cannot cut inside" not in err
            return plan
        assert f"{target} cannot cut inside" in err and "predicted step" in err
        return result.adjustment.plan

    # fqns: every name is a module; the stage's modules hold the stage's parameters.
    code, text, err = export_cli(cli, plan_file, "fqns", tmp_path, *args)
    assert code == 0, err
    stages = json.loads(text)
    want = stage_params(prof, target_plan("fqns", err), root, prefix)
    got = [params_of([root.get_submodule(n) for n in ns]) for ns in stages]
    if name == "bert":  # the tied word embedding is named under its owner, as torch names it
        assert "bert.embeddings.word_embeddings" in stages[0]
        assert all("cls.predictions.decoder" not in ns for ns in stages[:-1])
    assert got == want

    # deepspeed: parts over the layer list; stage s holds layers[parts[s]:parts[s + 1]].
    code, text, err = export_cli(cli, plan_file, "deepspeed", tmp_path, *args)
    assert code == 0, err
    body: Any = ds_fields(text)
    parts, layers = body["parts"], body["layers"]
    assert len(parts) == body["num_stages"] + 1 == 3 + 1
    assert parts[0] == 0 and parts[-1] == len(layers) and parts == sorted(parts)
    owned: list[list[nn.Module]] = [[] for _ in range(3)]
    for i, layer in enumerate(layers):
        owned[deepspeed_owner(parts, i)].append(root.get_submodule(layer))
    want = stage_params(prof, target_plan("deepspeed", err), root, prefix)
    got = [params_of(ms) for ms in owned]
    assert got == want

    # megatron: the layout parses, validates, and holds each stage's decoder layers.
    code, text, err = export_cli(cli, plan_file, "megatron", tmp_path, *args)
    assert code == 0, err
    args_layout = megatron_args(text.splitlines()[0])
    pp, n_layers = (
        int(args_layout["--pipeline-model-parallel-size"]),
        int(args_layout["--num-layers"]),
    )
    parsed = megatron_parse(args_layout["--pipeline-model-parallel-layout"])
    megatron_validate(parsed, pp, n_layers)
    blocks = blocks_per_stage(target_plan("megatron", err), MODELS[name][3])
    assert [stage.count("t") for stage in parsed] == blocks
    assert megatron_core_layers(text) == [blocks] * len(text.splitlines())
    if len(text.splitlines()) > 1:  # the first/last pair says the same
        flags = megatron_args(text.splitlines()[1])
        first = int(flags["--decoder-first-pipeline-num-layers"])
        last = int(flags["--decoder-last-pipeline-num-layers"])
        assert megatron_uneven(n_layers, pp, first, last) == blocks
    else:
        assert "cannot express this plan" in err

    # torchtitan: every name is one torchtitan keeps, and the kept modules hold the stage's
    # parameters; a model it cannot split says so.
    code, text, err = export_cli(cli, plan_file, "torchtitan", tmp_path, *args)
    children = titan_children(root)
    containers = [m for m in children.values() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    if name in ("gpt2", "bert"):  # blocks in transformer.h, bert.encoder.layer: not children
        assert code == 2 and text == "" and err.count("\n") == 1
        assert f"torchtitan: the block list {MODELS[name][3]} is not a direct child" in err
        return
    assert code == 0, err
    config = titan_config(text)
    assert config["pipeline_parallel_degree"] == 3
    assert config["microbatches"] == plan.microbatches
    names = config["module_fqns_per_model_part"]
    assert isinstance(names, list)
    kept = [titan_split(children, ns) for ns in names]
    if not containers:  # mlp, resnet: a Sequential block list, which _split_module keeps whole
        assert name in ("mlp", "resnet")
        assert any(set(k) != set(ns) for k, ns in zip(kept, names))
        return
    assert [set(k) for k in kept] == [set(ns) for ns in names]  # nothing silently ignored
    if name in ("llama", "gemma"):  # the embedding first, the head last, RoPE everywhere
        assert "tok_embeddings" in names[0] and all("lm_head" not in ns for ns in names[:-1])
        assert all("rotary_emb" in ns for ns in names) and "lm_head" in names[-1]
    want = stage_params(prof, target_plan("torchtitan", err), root, prefix)
    assert [params_of(list(k.values())) for k in kept] == want


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "titan"], "--to 'titan' is not one of torchtitan, megatron, deepspeed, fqns"),
        (["--to", "fqns", "-o", "{tmp}/missing/x.json"], "output directory"),
        (["--to", "fqns", "-o", "{tmp}"], "is a directory"),
        (["--to", "fqns", "--profile", "{tmp}/nope.json"], "no such file"),
        (
            ["--to", "fqns", "--profile", "{tmp}/other.json"],
            "give the profile the plan was made from",
        ),
        (["--to", "fqns", "--profile", "{tmp}/bad.json"], "not valid JSON"),
    ],
)
def test_bad_export_options(plan_file: Path, tmp_path: Path, cli, args, message) -> None:
    write_json(tmp_path / "other.json", synthetic_profile(10, batch_size=8, seed=9))
    (tmp_path / "bad.json").write_text("{not json")
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = ["export", str(plan_file), *(a.format(tmp=tmp_path) for a in args)]
    code, out, err = cli(argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("error:") and err.count("\n") == 1 and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_plan_of_graph_nodes_names_no_module(tmp_path: Path, cli) -> None:
    prof = named_profile(["embedding", "linear", "relu", "linear_1"])
    plan_file = tmp_path / "plan.json"
    write_json(plan_file, plan_of(prof.model_copy(update={"granularity": "node"}), [0, 2]))
    code, out, err = cli(["export", str(plan_file), "--to", "fqns"])
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "(profiled with --granularity node), not modules" in err
    assert "profile with --granularity auto and plan again" in err


def test_bad_plan_files(tmp_path: Path, cli) -> None:
    prof_file = tmp_path / "profile.json"
    write_json(prof_file, synthetic_profile(4, batch_size=8))
    for path, message in [
        (tmp_path / "none.json", "no such file"),
        (prof_file, "schema is 'pipeplan.profile/1', expected 'pipeplan.plan/1'"),
    ]:
        code, out, err = cli(["export", str(path), "--to", "fqns", "-o", str(tmp_path / "o.json")])
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err
        assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize(
    ("names", "starts", "target", "message"),
    [
        # Two blocks in two pieces each, five stages: three cuts (around and between blocks).
        (
            ["embed", "blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.1.b", "head"],
            [0, 1, 2, 3, 4],
            "megatron",
            (
                "megatron can cut this model in only 3 place(s), so it cannot run 5 stages; "
                "plan again with --stages 4 or fewer"
            ),
        ),
        (["unit0", "unit1", "unit2"], [0, 1], "megatron", "hold no block list"),
        (
            ["embed", "blocks.0", "adapter", "blocks.1", "head"],
            [0, 2],
            "megatron",
            "megatron: adapter lies among the decoder layers (blocks.N)",
        ),
        (
            ["embed", "blocks.0", "blocks.1.attn", "blocks.1.mlp", "head"],
            [0, 3],
            "torchtitan",
            (
                "torchtitan cannot cut inside blocks.1, as the plan does between blocks.1.attn "
                "and blocks.1.mlp (1 such cut): it keeps whole modules"
            ),
        ),
        (
            ["embed", "blocks.0", "blocks.1", "blocks.2", "aux.heads.0", "aux.heads.1"],
            [0, 2],
            "torchtitan",
            (
                "torchtitan: aux.heads.0 is neither a direct child of the model nor an item of a "
                "direct ModuleList"
            ),
        ),
        (
            T5_NAMES,
            [0, 3],
            "megatron",
            (
                "megatron: the model has 2 block lists (encoder.block, decoder.block) and Megatron's "
                "layout lays out one stack"
            ),
        ),
        (
            ["x.embed", "x.enc.blocks.0", "x.enc.blocks.1", "x.head"],
            [0, 2],
            "torchtitan",
            "torchtitan: the block list x.enc.blocks is not a direct child of the model",
        ),
    ],
)
def test_plans_a_target_cannot_run(names, starts, target, message, tmp_path: Path, cli) -> None:
    plan_file = tmp_path / "plan.json"
    write_json(plan_file, plan_of(named_profile(names), starts))
    out_file = tmp_path / "out.txt"
    code, out, err = cli(["export", str(plan_file), "--to", target, "-o", str(out_file)])
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("error:") and err.count("\n") == 1 and message in err
    assert not out_file.exists()


def test_console_script(plan_file: Path, tmp_path: Path) -> None:
    """The entry point in a real process: output on stdout, errors one line, exit 2."""
    exe = [sys.executable, "-m", "pipeplan.cli", "export", str(plan_file)]
    ok = subprocess.run([*exe, "--to", "megatron"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("--pipeline-model-parallel-size 2 --num-layers 8")
    bad = subprocess.run([*exe, "--to", "xla"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: --to 'xla' is not one of")
    usage = subprocess.run(exe, capture_output=True, text=True, check=False)  # no --to
    assert usage.returncode == 2 and "--to" in usage.stderr and "Traceback" not in usage.stderr


def test_schedules_export_their_family_and_chunks() -> None:
    """torchtitan: the family by torch's name and p v model parts; Megatron: the p v chunks in
    the layout (VPP v); DeepSpeed and Megatron's loop refuse what they cannot run."""
    from pipeplan.planner.errors import InvalidRequestError
    from pipeplan.planner.io import load_profile
    from pipeplan.solvers.multichunk import solve_schedule

    profile = load_profile(Path(__file__).parents[2] / "benchmarks/schedules/out/gpt.profile.json")
    cluster = Cluster.homogeneous(2, 1 << 30)
    plan = solve_schedule(profile, cluster, PlanOptions(schedule="interleaved1f1b"))
    config = titan_config(export_plan(plan, "torchtitan").text)
    assert config["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert config["pipeline_parallel_degree"] == 2
    assert len(config["module_fqns_per_model_part"]) == 4
    line = export_plan(plan, "megatron").text.splitlines()[0]
    args = megatron_args(line)
    stages = megatron_parse(args["--pipeline-model-parallel-layout"])
    pp = int(args["--pipeline-model-parallel-size"])
    assert pp == 2 and len(stages) == 4 and len(stages) // pp == 2  # VPP 2
    with pytest.raises(InvalidRequestError, match="deepspeed runs its own schedule"):
        export_plan(plan, "deepspeed")
    zbv = solve_schedule(profile, cluster, PlanOptions(schedule="zbv"))
    assert "ZBVZeroBubble" in export_plan(zbv, "torchtitan").text
    with pytest.raises(InvalidRequestError, match="VPP"):
        export_plan(zbv, "megatron")


def test_a_tied_weight_is_named_under_its_owner(tmp_path: Path) -> None:
    """GPT-2 ties lm_head.weight to transformer.wte.weight, which torch names it: the first
    stage's embedding is transformer.wte, not lm_head."""
    prof = profile_model(
        "pipeplan.models.zoo:gpt2",
        batch_size=4,
        model_kwargs={"n_layers": 2, "d_model": 32, "seq_len": 8},
        microbatch_sizes=[2],
        warmup=0,
        repeats=1,
        progress=False,
    )
    plan = SOLVERS["dp"](prof, Cluster.homogeneous(2, GiB), PlanOptions())
    for target in ("fqns", "deepspeed"):
        result = export_plan(plan, target, prof)  # type: ignore[arg-type]
        assert result.stage_keys[0][0] == "transformer.wte", target
        assert "lm_head" in result.stage_keys[-1] and "lm_head" not in result.stage_keys[0]
