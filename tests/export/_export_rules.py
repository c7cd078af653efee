"""The export tests' yardsticks: each target's rules, written down from its source, the models
profiled, and helpers that read an export back.  Where the ``targets`` extra is installed the
targets' own code reads the exports too: megatron-core every model's Megatron export
(``megatron_core_layers``), DeepSpeed 0.19.8 every model's DeepSpeed export on two gloo ranks
(test_deepspeed.py); torchtitan 0.3.0's own reading is in test_torchtitan.py.

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
import re
import shlex
from pathlib import Path

import pytest
from torch import nn

from pipeplan.intake.model import NamedInputs, load_model
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile
from pipeplan.profiler.synthetic import synthetic_profile

GiB = 2**30


def titan_config(text: str) -> dict[str, object]:
    """The ``--parallelism.*``/``--training.*`` override line (torchtitan 0.3's ConfigManager
    reads it in test_torchtitan.py), as field -> value."""
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
    flags: dict[str, str] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):  # a switch (--sequence-parallel) has no value: ""
            value = words[i + 1] if i + 1 < len(words) else ""
            flags[word] = "" if value.startswith("--") else value
    return flags


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
    """NUM_STAGES, PARTS and LAYERS of the exported DeepSpeed module (test_deepspeed.py builds it
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


def named_profile(names: list[str]) -> Profile:
    prof = synthetic_profile(len(names), batch_size=8, seed=1)
    units = tuple(u.model_copy(update={"name": n}) for u, n in zip(prof.units, names))
    return prof.model_copy(update={"units": units})


def plan_of(prof: Profile, starts: list[int]) -> Plan:
    cluster = Cluster.homogeneous(len(starts), GiB)
    return evaluate(prof, cluster, PlanOptions(microbatches=2), starts[1:], 2, solver="dp")


GPT_NAMES = ["embed", *(f"blocks.{i}" for i in range(8)), "norm+head"]


T5_NAMES = [
    "shared",
    "encoder.block.0",
    "encoder.block.1",
    "encoder.final_layer_norm",
    "decoder.block.0",
    "decoder.block.1",
    "decoder.final_layer_norm+lm_head",
]


def meshed(plan: Plan, t: int, sp: bool = False, d: int = 1, replicas_outer: bool = True) -> Plan:
    """``plan`` on t tensor-parallel ranks (and d replicas) by hand, as the planner will make
    it: the layout puts replica r's pipeline rank j on ranks (r p + j) t (``Plan.layout``), or,
    with ``replicas_outer`` False, on (j d + r) t."""
    p = plan.pipeline_ranks
    update = {"tensor_parallel": t, "sequence_parallel": sp, "data_parallel": d}
    layout = tuple(
        tuple(((r * p + j) if replicas_outer else (j * d + r)) * t for j in range(p))
        for r in range(d)
    )
    return plan.model_copy(
        update={"cluster": plan.cluster.model_copy(update=update), "layout": layout}
    )
