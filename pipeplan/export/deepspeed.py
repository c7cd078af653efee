"""DeepSpeed: a small Python module that builds DeepSpeed's ``PipelineModule`` with the plan's
``parts`` (stage s holds ``LAYERS[PARTS[s]:PARTS[s + 1]]``); and the plain per-stage module lists
(``fqns``).

DeepSpeed 0.19's ``PipelineModule._partition_layers`` knows ``uniform``, ``parameters`` and
``type:`` only, so the module's ``PlannedPipeline`` overrides it to set the plan's parts.  Each
layer is a module of the user's model by name, wrapped in ``ModelLayer`` (one input, one
output).  A parameter that layers on different stages share (a tied embedding and head) becomes
a ``TiedLayerSpec`` keyed by the parameter's name as torch names it (dots as ``_``: DeepSpeed keeps
the tied modules in a ``ModuleDict``), with the attribute it has
in each layer, so that DeepSpeed broadcasts it at start and all-reduces its gradient.  The
ties are found on the model itself when the module runs, not written into the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

__all__ = ["deepspeed_config", "deepspeed_text", "fqns_text", "json_object"]


def json_object(fields: dict[str, object]) -> str:
    """A JSON object with one field per line, each value on one line."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items())
    return "{\n" + body + "\n}\n"


_MODULE = '''"""DeepSpeed PipelineModule for a pipeplan plan ({model}): {p} stages.

Written by `pipeplan export --to deepspeed` for DeepSpeed 0.19.  Stage s builds
LAYERS[PARTS[s]:PARTS[s + 1]], each a module of your model by name.  Parameters shared by layers
on different stages are TiedLayerSpecs (DeepSpeed broadcasts them and all-reduces their
gradients).  Use:

    from this_file import pipeline_module
    net = pipeline_module(model, loss_fn=...)      # after deepspeed.init_distributed()

Each layer is called with the previous one's output (ModelLayer); a module that needs more
inputs (a transformers decoder layer's position embeddings) needs a ModelLayer subclass, given
as layer_type=.
"""

from torch import nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

NUM_STAGES = {p}
PARTS = {parts}
LAYERS = {layers}
# deepspeed.initialize(config=CONFIG, ...): the plan's micro-batches, and ZeRO stage 1 (optimizer
# states sharded over the data-parallel ranks) for a sharded plan; its PipelineEngine refuses
# stages 2 and 3.  Launch NUM_STAGES x {d} ranks.
CONFIG = {config}


class ModelLayer(nn.Module):
    """One module of the user's model as a pipeline layer."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


class PlannedPipeline(PipelineModule):
    """PipelineModule with the plan's parts instead of one of DeepSpeed's partition methods."""

    def _partition_layers(self, method="plan"):
        self.parts = list(PARTS)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def layer_specs(model, layer_type=ModelLayer):
    """LAYERS as LayerSpecs, TiedLayerSpecs where a parameter spans stages."""
    modules = [model.get_submodule(name) for name in LAYERS]
    names = {{}}  # id(parameter) -> its name in the model, as torch names it
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
    stage_of = [s for s in range(NUM_STAGES) for _ in range(PARTS[s], PARTS[s + 1])]
    stages = {{}}  # id(parameter) -> the stages whose layers use it
    for i, module in enumerate(modules):
        for param in module.parameters():
            stages.setdefault(id(param), set()).add(stage_of[i])
    specs = []
    for module in modules:
        tied = {{}}
        for attr, param in module.named_parameters(remove_duplicate=False):
            if len(stages[id(param)]) > 1:
                tied.setdefault(names[id(param)], []).append("layer." + attr)
        if len(tied) > 1:
            raise ValueError(f"{{sorted(tied)}}: DeepSpeed ties one parameter group per layer")
        if tied:
            (name, attrs), = tied.items()
            key = name.replace(".", "_")  # a ModuleDict key: no dots
            specs.append(TiedLayerSpec(key, layer_type, module, tied_weight_attr=attrs))
        else:
            specs.append(LayerSpec(layer_type, module))
    return specs


def pipeline_module(model, layer_type=ModelLayer, **kwargs):
    """The plan's PipelineModule over ``model``'s modules (kwargs: PipelineModule's)."""
    return PlannedPipeline(layers=layer_specs(model, layer_type), num_stages=NUM_STAGES, **kwargs)
'''


def deepspeed_config(microbatch_size: int, microbatches: int, replicas: int, shard: bool) -> dict:
    """DeepSpeed's batch and ZeRO settings for a plan: ``train_micro_batch_size_per_gpu`` b,
    ``gradient_accumulation_steps`` m (its pipeline engine's micro-batch count), the global
    ``train_batch_size`` b m d, and ZeRO stage 1 where the plan shards over its d ranks (the
    highest stage DeepSpeed's ``PipelineEngine`` accepts; it asserts stages 2 and 3 away).

    >>> deepspeed_config(2, 4, 8, True)["zero_optimization"]
    {'stage': 1}
    """
    return {
        "train_micro_batch_size_per_gpu": microbatch_size,
        "gradient_accumulation_steps": microbatches,
        "train_batch_size": microbatch_size * microbatches * replicas,
        "zero_optimization": {"stage": 1 if shard and replicas > 1 else 0},
    }


def deepspeed_text(
    stage_keys: Sequence[Sequence[str]], model: str = "", config: dict | None = None
) -> str:
    """The Python module (see the module docstring), with ``config``
    (:func:`deepspeed_config`) as its ``CONFIG``."""
    flat = [k for ks in stage_keys for k in ks]
    parts = [0]
    for ks in stage_keys:
        parts.append(parts[-1] + len(ks))
    config = config or deepspeed_config(1, 1, 1, False)
    replicas = config["train_batch_size"] // (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
    )
    return _MODULE.format(
        model=model or "your model",
        p=len(stage_keys),
        parts=parts,
        layers=json.dumps(flat),
        d=replicas,
        config=repr(config),
    )


def fqns_text(stage_keys: Sequence[Sequence[str]]) -> str:
    """A JSON list of module names per stage."""
    rows = ",\n".join(f"  {json.dumps(list(ks))}" for ks in stage_keys)
    return f"[\n{rows}\n]\n"
