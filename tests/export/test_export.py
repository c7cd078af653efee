"""`pipeplan export` against each target's own rules, written down from its source, and, where
the ``targets`` extra is installed, against the targets' own code: megatron-core reads every
model's Megatron export (``megatron_core_layers``) and DeepSpeed 0.19.8 builds every model's
DeepSpeed export on two gloo ranks (``test_deepspeed_builds_every_model``); torchtitan 0.3.0's
own reading is in test_targets.py.

The targets' rules, re-implemented here from their source (mirrors fetched 2026-11-24):

* torchtitan @ b5bcd76c66d0acb1a08b176d9639425bc55e0b2a,
  ``torchtitan/distributed/pipeline_parallel.py``: ``_split_module`` keeps, of the model's direct
  children, a child named in the stage's list, and of a direct ``ModuleList``/``ModuleDict``
  child the items named ``child.i``; every other child is dropped (set to ``None``, or emptied).
  A name matching nothing is silently ignored, so an export must name only what it consumes.
  ``torchtitan/experiments/transformers_modeling_backend/model.py``: the transformers backend's
  ``named_children`` flattens a Llama-like model to ``tok_embeddings`` (``model.embed_tokens``),
  ``layers``, ``norm``, ``lm_head``, ``rotary_emb``.
* Megatron-LM @ d98e8a64ddf34856e74b24714e3bedb2f5a39553,
  ``megatron/core/transformer/pipeline_parallel_layer_layout.py``: ``parse_str_to_list`` drops
  commas, unrolls ``(...)*n`` then ``x*n``, splits stages at ``|``, characters ``E L t m``;
  ``__init__``/``validate_layer_layout``: ``len(layout) % pp == 0`` (the quotient is the VPP
  size), the first layer is ``E`` and the last ``L``, each exactly once, and as many ``t`` as
  ``num_layers``.  ``megatron/core/transformer/transformer_config.py`` (uneven PP) and
  ``transformer_block.py`` (``get_num_layers_to_build``): first/last counts > 0; the remaining
  layers split evenly over the middle stages, which must exist iff layers remain.
* DeepSpeed @ 38327e07f6cd39b63418f60cedd1651b0be3e7c3, ``deepspeed/runtime/pipe/module.py``:
  ``parts`` has ``num_stages + 1`` entries, ``parts[0] == 0`` and ``parts[-1] == len(layers)``
  (``ds_utils.partition_uniform``/``partition_balanced``), and ``stage_owner(i)`` is the s
  with ``parts[s] <= i < parts[s + 1]``.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from pipeplan.export import ModelLayout, export_plan, megatron_layout
from pipeplan.export.snap import legal_cuts
from pipeplan.intake.model import NamedInputs, load_model
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.io import load_plan, write_json
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile
from pipeplan.profiler import profile_model
from pipeplan.profiler.synthetic import synthetic_profile

GiB = 2**30


def titan_config(text: str) -> dict[str, object]:
    """The ``--parallelism.*``/``--training.*`` override line (torchtitan 0.3's ConfigManager
    reads it in test_targets.py), as field -> value."""
    line = next(ln for ln in text.splitlines() if not ln.startswith("#"))
    words: dict[str, list[str]] = {}
    key = ""
    for w in shlex.split(line):
        if w.startswith("--"):
            key = w.split(".", 1)[1]
            words[key] = []
        else:
            words[key].append(w)
    return {
        "module_fqns_per_model_part": [v.split(",") for v in words["module_fqns_per_model_part"]],
        "pipeline_parallel_degree": int(words["pipeline_parallel_degree"][0]),
        "pipeline_parallel_schedule": words["pipeline_parallel_schedule"][0],
        "microbatches": int(words["local_batch_size"][0])
        // int(words["pipeline_parallel_microbatch_size"][0]),
    }


# --------------------------------------------------------------------------------------------
# The targets' rules
# --------------------------------------------------------------------------------------------


def megatron_parse(layout: str) -> list[list[str]]:
    """``PipelineParallelLayerLayout.parse_str_to_list``, on characters."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    stages = []
    for stage in text.split("|"):
        assert all(c in "ELtm" for c in stage), f"invalid layer character in {stage!r}"
        stages.append(list(stage))
    return stages


def megatron_validate(stages: list[list[str]], pp: int, num_layers: int) -> None:
    """``__init__`` and ``validate_layer_layout``, without virtual stages."""
    assert len(stages) % pp == 0 and len(stages) // pp == 1
    flat = [c for stage in stages for c in stage]
    assert flat[0] == "E" and flat[-1] == "L"
    assert flat.count("E") == 1 and flat.count("L") == 1
    assert flat.count("t") == num_layers


def megatron_uneven(num_layers: int, pp: int, first: int, last: int) -> list[int]:
    """Decoder layers per stage from --decoder-first/last-pipeline-num-layers."""
    assert first > 0 and last > 0
    middle_layers, middle_stages = num_layers - first - last, pp - 2
    assert bool(middle_layers) == bool(middle_stages)
    per = 0
    if middle_stages:
        assert middle_layers % middle_stages == 0
        per = middle_layers // middle_stages
    return [first] + [per] * middle_stages + [last]


def megatron_args(line: str) -> dict[str, str]:
    """A command line's flags; the commented alternative's after its ``:``."""
    if line.startswith("#"):
        assert line.startswith("# or, replacing the line above"), line
        line = line.split(":", 1)[1]
    words = shlex.split(line)
    return dict(zip(words[::2], words[1::2]))


def megatron_core_layers(text: str) -> list[list[int]]:
    """Per line of a Megatron export, the decoder layers per stage megatron-core builds from it
    (its own TransformerConfig, layout parser and get_num_layers_to_build); skipped without
    megatron-core (the ``targets`` extra)."""
    torch = pytest.importorskip("torch")
    config_mod = pytest.importorskip("megatron.core.transformer.transformer_config")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    out = []
    for line in text.splitlines():
        flags = megatron_args(line)
        pp = int(flags["--pipeline-model-parallel-size"])
        common = {
            "num_layers": int(flags["--num-layers"]),
            "hidden_size": 32,
            "num_attention_heads": 4,
            "pipeline_model_parallel_size": pp,
            "pipeline_dtype": torch.float32,
        }
        if "--pipeline-model-parallel-layout" in flags:
            config = config_mod.TransformerConfig(
                **common, pipeline_model_parallel_layout=flags["--pipeline-model-parallel-layout"]
            )
            layout = config.pipeline_model_parallel_layout
            out.append([layout.get_num_layers_to_build(pp_rank=j) for j in range(pp)])
        else:
            config = config_mod.TransformerConfig(
                **common,
                num_layers_in_first_pipeline_stage=int(
                    flags["--decoder-first-pipeline-num-layers"]
                ),
                num_layers_in_last_pipeline_stage=int(flags["--decoder-last-pipeline-num-layers"]),
            )
            out.append([get_num_layers_to_build(config, pp_rank=j) for j in range(pp)])
    return out


def titan_split(children: dict[str, nn.Module], names: list[str]) -> dict[str, nn.Module]:
    """The modules ``_split_module`` keeps for one stage, by the name it knows them by."""
    keep = set(names)
    kept: dict[str, nn.Module] = {}
    for child, module in children.items():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            wanted = {n.split(".", 1)[1] for n in keep if n.startswith(f"{child}.")}
            items = module.items() if isinstance(module, nn.ModuleDict) else enumerate(module)
            for key, item in items:
                if str(key) in wanted:
                    kept[f"{child}.{key}"] = item
        elif child in keep:
            kept[child] = module
    return kept


def titan_children(root: nn.Module) -> dict[str, nn.Module]:
    """The children torchtitan splits: the transformers backend's flattened view of a
    Llama-like model, else the model's own."""
    base = getattr(root, "model", None)
    if base is not None and hasattr(base, "embed_tokens") and hasattr(root, "lm_head"):
        return {
            "tok_embeddings": base.embed_tokens,
            "layers": base.layers,
            "norm": base.norm,
            "lm_head": root.lm_head,
            "rotary_emb": base.rotary_emb,
        }
    return dict(root.named_children())


def ds_fields(text: str) -> dict[str, object]:
    """NUM_STAGES, PARTS and LAYERS of the exported DeepSpeed module (test_targets.py builds it
    with DeepSpeed's own PipelineModule)."""
    out: dict[str, object] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("NUM_STAGES", "PARTS", "LAYERS"):
                out[name.lower()] = ast.literal_eval(node.value)
    return out


def deepspeed_owner(parts: list[int], layer: int) -> int:
    """``PipelineModule.stage_owner``."""
    for stage in range(len(parts) - 1):
        if parts[stage] <= layer < parts[stage + 1]:
            return stage
    raise AssertionError(f"layer {layer} not owned, parts={parts}")


# --------------------------------------------------------------------------------------------
# Real models: profile -> plan -> export
# --------------------------------------------------------------------------------------------

#: name -> (model, kwargs, --max-stages, its block list): small enough to profile in seconds.
MODELS = {
    "gpt": (
        "pipeplan.models.gpt:gpt",
        {"vocab": 64, "d_model": 16, "n_layers": 4, "seq_len": 8},
        4,
        "blocks",
    ),
    "mlp": ("pipeplan.models.mlp:mlp", {"width": 16, "depth": 4, "in_features": 8}, 4, "layers"),
    "resnet": (
        "pipeplan.models.resnet:resnet",
        {"width": 4, "blocks": "1,1,1", "image": 8},
        4,
        "stages",
    ),
    "llama": (
        "pipeplan.models.zoo:llama",
        {"n_layers": 3, "d_model": 32, "seq_len": 8},
        4,
        "model.layers",
    ),
    "gemma": (
        "pipeplan.models.zoo:gemma",
        {"n_layers": 3, "d_model": 32, "seq_len": 8},
        4,
        "model.layers",
    ),
    "gpt2": (
        "pipeplan.models.zoo:gpt2",
        {"n_layers": 3, "d_model": 32, "seq_len": 8},
        4,
        "transformer.h",
    ),
    "bert": (
        "pipeplan.models.zoo:bert",
        {"n_layers": 3, "d_model": 32, "seq_len": 8},
        4,
        "bert.encoder.layer",
    ),
}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Profile]]:
    """Profiles of the bundled and zoo models, each made on first use."""
    cache: dict[str, tuple[Path, Profile]] = {}
    root = tmp_path_factory.mktemp("profiles")

    def get(name: str) -> tuple[Path, Profile]:
        if name not in cache:
            model, kwargs, max_stages, _ = MODELS[name]
            prof = profile_model(
                model,
                batch_size=4,
                model_kwargs=kwargs,
                microbatch_sizes=[2],
                warmup=0,
                repeats=1,
                progress=False,
                max_stages=max_stages,
            )
            path = root / f"{name}.profile.json"
            write_json(path, prof)
            cache[name] = (path, prof)
        return cache[name]

    return get


def blocks_per_stage(plan: Plan, container: str) -> list[int]:
    """Distinct items of ``container`` the units of each stage name (pieces included)."""
    item = re.compile(rf"^{re.escape(container)}\.(\d+)(\.|$)")
    out = []
    for s in plan.stages:
        found = set()
        for name in s.unit_names:
            for part in re.sub(r"#\d+$", "", name).split("+"):
                m = item.match(part.split("[", 1)[0])
                if m:
                    found.add(m.group(1))
        out.append(len(found))
    return out


def user_model(name: str) -> tuple[nn.Module, str]:
    """The user's model and the prefix its parameters have in a profile."""
    model, kwargs, _, _ = MODELS[name]
    module = load_model(model, kwargs).module
    if isinstance(module, NamedInputs):
        return module.model, "model."
    return module, ""


def stage_params(prof: Profile, plan: Plan, root: nn.Module, prefix: str) -> list[set[int]]:
    """Per stage, the parameters (by identity) its units use, as the profile records them."""
    out = []
    for s in plan.stages:
        ids = set()
        for u in prof.units[s.first_unit : s.last_unit + 1]:
            for name in u.params:
                local = name.removeprefix(prefix)
                try:
                    ids.add(id(root.get_parameter(local)))
                except AttributeError:  # a buffer
                    continue
        out.append(ids)
    return out


def params_of(modules: list[nn.Module]) -> set[int]:
    return {id(p) for m in modules for p in m.parameters()}


def export_cli(cli, plan_file: Path, target: str, tmp: Path, *extra: str) -> tuple[int, str, str]:
    out = tmp / f"{plan_file.stem}.{target}"
    code, _, err = cli(["export", str(plan_file), "--to", target, "-o", str(out), *extra])
    return code, out.read_text() if out.exists() else "", err


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


# --------------------------------------------------------------------------------------------
# A cut inside a block: the closest plan the target can run, priced by the cost model
# --------------------------------------------------------------------------------------------


def test_a_cut_inside_a_block_moves_to_the_cheaper_neighbour(real, tmp_path: Path, cli) -> None:
    profile_file, prof = real("llama")
    names = [u.name for u in prof.units]
    layout = ModelLayout.of(names)
    inside = [b for b, ok in enumerate(legal_cuts(layout.keys("torchtitan"))) if not ok]
    assert inside, f"llama was not refined into pieces of blocks: {names}"
    cut = inside[len(inside) // 2]
    cluster = Cluster.homogeneous(2, GiB)
    options = PlanOptions(microbatches=2)
    plan = evaluate(prof, cluster, options, [cut], 2, solver="dp")
    plan_file = tmp_path / "inside.plan.json"
    write_json(plan_file, plan)
    legal = [b for b, ok in enumerate(legal_cuts(layout.keys("torchtitan"))) if ok and b > 0]
    down = max(b for b in legal if b < cut)
    up = min(b for b in legal if b > cut)
    priced = {b: evaluate(prof, cluster, options, [b], 2, solver="x") for b in (down, up)}
    best = min(priced, key=lambda b: priced[b].step_time_s)

    # Without the profile: one line naming the cut and the fix, exit 2, no file.
    code, text, err = export_cli(cli, plan_file, "torchtitan", tmp_path)
    block = layout.block_key(layout.modules[cut][0])
    assert code == 2 and text == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"torchtitan cannot cut inside {block}" in err and "give --profile" in err

    code, text, err = export_cli(
        cli, plan_file, "torchtitan", tmp_path, "--profile", str(profile_file)
    )
    assert code == 0, err
    assert err.count("\n") == 1 and f"starts its stages at units [0, {best}]" in err
    assert f"predicted step {priced[best].step_time_s * 1e3:.4g} ms" in err
    assert f"vs {plan.step_time_s * 1e3:.4g} ms planned" in err
    parts = titan_config(text)["module_fqns_per_model_part"]
    assert isinstance(parts, list)
    first = [layout.block_key(m).removeprefix("model.") for ps in layout.modules[:best] for m in ps]
    assert {n for n in parts[0] if n != "rotary_emb"} == {
        {"embed_tokens": "tok_embeddings"}.get(n, n) for n in first
    }
    # fqns can name pieces of a block: the same plan needs no move.
    code, text, err = export_cli(cli, plan_file, "fqns", tmp_path)
    assert code == 0 and err == "" and len(json.loads(text)) == 2


# --------------------------------------------------------------------------------------------
# Megatron's two forms, on a plan of named units
# --------------------------------------------------------------------------------------------


def named_profile(names: list[str]) -> Profile:
    prof = synthetic_profile(len(names), batch_size=8, seed=1)
    units = tuple(u.model_copy(update={"name": n}) for u, n in zip(prof.units, names))
    return prof.model_copy(update={"units": units})


def plan_of(prof: Profile, starts: list[int]) -> Plan:
    cluster = Cluster.homogeneous(len(starts), GiB)
    return evaluate(prof, cluster, PlanOptions(microbatches=2), starts[1:], 2, solver="dp")


GPT_NAMES = ["embed", *(f"blocks.{i}" for i in range(8)), "norm+head"]


@pytest.mark.parametrize(
    ("starts", "layout", "counts"),
    [
        ([0, 3, 6], "Et*2|t*3|t*3L", [2, 3, 3]),
        ([0, 4, 6, 8], "Et*3|t*2|t*2|tL", [3, 2, 2, 1]),
        ([0, 1, 9], "E|t*8|L", None),  # stages without a decoder layer: no first/last pair
        ([0, 2, 5, 9], "Et|t*3|t*4|L", None),
        ([0, 2, 5, 7], "Et|t*3|t*2|t*2L", None),  # uneven middle: the layout only
        ([0], "Et*8L", None),
        ([0, 5], "Et*4|t*4L", [4, 4]),  # two stages: the pair alone
    ],
)
def test_megatron_layout_and_first_last_counts(starts, layout, counts, tmp_path, cli) -> None:
    prof = named_profile(GPT_NAMES)
    plan_file = tmp_path / "plan.json"
    write_json(plan_file, plan_of(prof, starts))
    code, out, err = cli(["export", str(plan_file), "--to", "megatron"])
    assert code == 0, err
    lines = out.splitlines()
    first = megatron_args(lines[0])
    assert first["--pipeline-model-parallel-layout"] == layout
    parsed = megatron_parse(layout)
    megatron_validate(parsed, len(starts), 8)
    bounds = [*starts, len(GPT_NAMES)]
    expected = [sum(n.startswith("blocks.") for n in GPT_NAMES[a:b]) for a, b in pairwise(bounds)]
    assert [st.count("t") for st in parsed] == expected
    if len(starts) > 1:  # megatron-core wants pipeline_dtype only with pipeline parallelism
        assert megatron_core_layers(out) == [expected] * len(lines)
    if counts is None:
        assert len(lines) == 1
        assert len(starts) == 1 or "cannot express this plan" in err
    else:
        flags = megatron_args(lines[1])
        got = megatron_uneven(
            8,
            int(flags["--pipeline-model-parallel-size"]),
            int(flags["--decoder-first-pipeline-num-layers"]),
            int(flags["--decoder-last-pipeline-num-layers"]),
        )
        assert got == counts and err == ""


def test_megatron_layout_string_is_compact() -> None:
    # The reference parser first reproduces the examples in parse_str_to_list's own docstring
    # and comments.
    assert megatron_parse("Ettt|(tt|)*29,m|L") == [["E", "t", "t", "t"]] + [["t", "t"]] * 29 + [
        ["m"],
        ["L"],
    ]
    assert megatron_parse("(|tt)*2,E") == [[], ["t", "t"], ["t", "t", "E"]]
    assert megatron_layout([(True, 1, False), (False, 12, True)]) == "Et|t*12L"
    assert megatron_parse("Et|t*12L") == [["E", "t"], ["t"] * 12 + ["L"]]


def titan_generate(num_stages: int, num_layers: int) -> list[list[str]]:
    """torchtitan's transformers backend's ``generate_llm_fqn_per_model_part`` with its
    default weights (input_weight = output_weight = 1), several stages."""
    effective = num_layers + 2
    per, extra = divmod(effective, num_stages)
    out, layer = [], 0
    for stage in range(num_stages):
        count = per + (stage < extra)
        names = ["tok_embeddings"] if stage == 0 else []
        take = count - (stage in (0, num_stages - 1))
        for _ in range(take):
            if layer < num_layers:
                names.append(f"layers.{layer}")
                layer += 1
        if stage == num_stages - 1:
            names += ["norm", "lm_head"]
        out.append([*names, "rotary_emb"])
    return out


def test_torchtitan_speaks_its_own_generator_s_names(real, tmp_path: Path, cli) -> None:
    """A Llama plan cut where torchtitan's own generator cuts exports to the generator's list."""
    _, prof = real("llama")
    names = [u.name for u in prof.units]
    want = titan_generate(3, 3)
    assert want == [
        ["tok_embeddings", "layers.0", "rotary_emb"],
        ["layers.1", "layers.2", "rotary_emb"],
        ["norm", "lm_head", "rotary_emb"],
    ]
    starts = [
        0,
        *(
            next(i for i, n in enumerate(names) if n.startswith(p))
            for p in ("model.layers.1", "model.norm")
        ),
    ]
    plan_file = tmp_path / "plan.json"
    write_json(
        plan_file,
        evaluate(
            prof,
            Cluster.homogeneous(3, GiB),
            PlanOptions(microbatches=2),
            starts[1:],
            2,
            solver="dp",
        ),
    )
    code, text, err = export_cli(cli, plan_file, "torchtitan", tmp_path)
    assert code == 0 and err.count("\n") == 1
    assert "stage(s) [2] hold no decoder layer" in err  # 0.3.0's transformers backend fails
    assert titan_config(text)["module_fqns_per_model_part"] == want


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


# --------------------------------------------------------------------------------------------
# Bad input: one line naming the value and the fix, exit 2, no file
# --------------------------------------------------------------------------------------------


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    write_json(path, plan_of(named_profile(GPT_NAMES), [0, 5]))
    return path


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


T5_NAMES = [
    "shared",
    "encoder.block.0",
    "encoder.block.1",
    "encoder.final_layer_norm",
    "decoder.block.0",
    "decoder.block.1",
    "decoder.final_layer_norm+lm_head",
]


def test_an_encoder_and_a_decoder_are_two_block_lists() -> None:
    """DeepSpeed cuts between the blocks of either stack, not only between the stacks."""
    prof = named_profile(T5_NAMES)
    result = export_plan(plan_of(prof, [0, 2, 5]), "deepspeed")
    assert result.adjustment is None
    assert ds_fields(result.text)["parts"] == [0, 2, 5, 8]
    assert result.stage_keys[1] == (
        "encoder.block.1",
        "encoder.final_layer_norm",
        "decoder.block.0",
    )


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


# --------------------------------------------------------------------------------------------
# How cuts move
# --------------------------------------------------------------------------------------------


def test_cuts_that_round_onto_each_other_spread_over_the_edges(tmp_path: Path, cli) -> None:
    """Three cuts inside one block all round to its two edges: they take the legal positions
    in order instead (the embedding's edge, the block's, the loss's)."""
    names = ["embed", "blocks.0.a", "blocks.0.b", "blocks.0.c", "blocks.0.d", "blocks.1", "head"]
    prof = named_profile(names)
    write_json(tmp_path / "profile.json", prof)
    plan_file = tmp_path / "plan.json"
    write_json(plan_file, plan_of(prof, [0, 2, 3, 4]))
    code, out, err = cli(
        ["export", str(plan_file), "--to", "megatron", "--profile", str(tmp_path / "profile.json")]
    )
    assert code == 0, err
    assert megatron_args(out.splitlines()[0])["--pipeline-model-parallel-layout"] == "E|t|t|L"
    assert "megatron cannot cut inside blocks.0" in err and "(3 such cuts)" in err
    expected = plan_of(prof, [0, 1, 5, 6]).step_time_s
    assert f"at units [0, 1, 5, 6]: predicted step {expected * 1e3:.4g} ms" in err


def test_many_cuts_move_to_their_nearest_edge() -> None:
    """Past ten cuts to move, each takes its nearest edge (the one before, on a tie) and the
    2**k roundings are not all priced."""
    names = ["embed", *(f"blocks.{i}.{x}" for i in range(12) for x in "ab"), "head"]
    prof = named_profile(names)
    starts = [0, *(names.index(f"blocks.{i}.b") for i in range(12))]
    plan = plan_of(prof, starts)
    result = export_plan(plan, "deepspeed", prof)
    assert result.adjustment is not None and "(12 such cuts)" in result.adjustment.reason
    moved = [s.first_unit for s in result.adjustment.plan.stages]
    assert moved == [0, *(b - 1 for b in starts[1:])]
    assert result.adjustment.plan.step_time_s == plan_of(prof, moved).step_time_s
    parts = ds_fields(result.text)["parts"]
    assert parts == [0, 1, *range(2, 13), 14]  # embed; one block per stage; the last two + head


def test_fqns_moves_a_cut_inside_a_leaf_module(tmp_path: Path, cli) -> None:
    names = ["embed", "blocks.0.norm", "blocks.0.norm[pow_1]", "blocks.0.mlp", "head"]
    prof = named_profile(names)
    write_json(tmp_path / "profile.json", prof)
    plan_file = tmp_path / "plan.json"
    write_json(plan_file, plan_of(prof, [0, 2]))
    code, out, err = cli(
        ["export", str(plan_file), "--to", "fqns", "--profile", str(tmp_path / "profile.json")]
    )
    assert code == 0 and "fqns cannot cut inside blocks.0.norm" in err
    price = {b: plan_of(prof, [0, b]).step_time_s for b in (1, 3)}
    best = min(price, key=price.__getitem__)
    modules = [[n for n in part if "[" not in n] for part in (names[:best], names[best:])]
    assert json.loads(out) == modules  # module names: a sub-unit's "[...]" is its module's


def test_megatron_prices_the_closest_first_last_pair(tmp_path: Path, cli) -> None:
    """Layers 1, 3, 2, 2: the pair cannot give an uneven middle. 1, 3, 3, 1 and 2, 2, 2, 2
    each move one cut by one layer; the cheaper under the cost model is named, with its
    price, and the layout still says the plan itself."""
    prof = named_profile(GPT_NAMES)
    write_json(tmp_path / "profile.json", prof)
    plan_file = tmp_path / "plan.json"
    plan = plan_of(prof, [0, 2, 5, 7])
    write_json(plan_file, plan)
    code, out, err = cli(["export", str(plan_file), "--to", "megatron"])
    assert code == 0 and out.count("\n") == 1
    assert "cannot express this plan: the middle stages hold different counts ([3, 2])" in err
    assert "--decoder-last-pipeline-num-layers 1 ([1, 3, 3, 1] layers per stage)" in err
    assert "(give --profile to price it)" in err

    code, out2, err = cli(
        ["export", str(plan_file), "--to", "megatron", "--profile", str(tmp_path / "profile.json")]
    )
    assert code == 0 and out2 == out and err.count("\n") == 1
    priced = {
        (1, 3, 3, 1): plan_of(prof, [0, 2, 5, 8]).step_time_s,  # blocks start at unit 1
        (2, 2, 2, 2): plan_of(prof, [0, 3, 5, 7]).step_time_s,
    }
    best = min(priced, key=priced.__getitem__)
    assert f"({list(best)} layers per stage): predicted step {priced[best] * 1e3:.4g} ms" in err
    assert f"vs {plan.step_time_s * 1e3:.4g} ms planned" in err


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
