"""torchtitan 0.3's own code reads a pipeplan export (run as a script by test_torchtitan.py).

``python titan_split.py PORT JOB...``, each JOB ``ARCH:N_LAYERS LINE`` (ARCH ``llama`` or
``gemma``; LINE an export's override line): each LINE an export's override line (one
argument each; torchtitan is imported once for them all).  Its ``ConfigManager`` parses each on
the transformers backend's ``full`` config (its debug config overrides the layer count to 2 and
the width to 256); the backend builds a model of N_LAYERS layers from a local transformers
config (no hub), whose layer count it reports; its ``pipeline_module_split`` cuts it on a
one-rank gloo mesh.  Prints one JSON line, a list with per LINE: the parsed settings, each stage's parameter names, whether the chained stages equal the whole model, and
the error a stage raised, if one did.

Stand-ins (installed here only, before torchtitan is imported): three modules that need a GPU
library or a large package at import and that the code under test never calls:
``torchtitan.distributed.minimal_async_ep.kernels`` (triton kernels), ``torch.utils.tensorboard``
(tensorboard) and ``datasets``.  Each raises if used.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile
import types
from typing import Any

import pipeplan  # noqa: F401  (defines torchvision's op schemas before transformers imports it)


def _unavailable(what: str) -> Any:
    def call(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{what} is a stand-in in this test")

    return call


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(f"{self.__name__}.{name}")


def _install_stand_ins() -> None:
    for name in (
        "torchtitan.distributed.minimal_async_ep.kernels",
        "torch.utils.tensorboard",
        "datasets",
        "datasets.distributed",
    ):
        sys.modules[name] = _StandIn(name)
    sys.modules["datasets"].Dataset = type("Dataset", (), {})  # type: ignore[attr-defined]


def main(port: int, jobs: list[str]) -> list[dict[str, Any]]:
    _install_stand_ins()
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return [_split(job.split(" ", 1)[0], shlex.split(job.split(" ", 1)[1])) for job in jobs]
    finally:
        dist.destroy_process_group()


def _split(arch: str, args: list[str]) -> dict[str, Any]:
    import torch
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config.manager import ConfigManager
    from torchtitan.experiments.transformers_modeling_backend.pipeline import (
        pipeline_module_split,
    )

    config = ConfigManager().parse_args(
        [
            "--module",
            "transformers_modeling_backend",
            "--config",
            "transformers_modeling_backend_full",  # debugmodel sets 2 layers of width 256
            *args,
        ]
    )
    hf = tempfile.mkdtemp()
    kind, n_layers = arch.split(":")
    hf_config = {"llama": transformers.LlamaConfig, "gemma": transformers.GemmaConfig}[kind]
    hf_config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=int(n_layers),
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        architectures=[f"{kind.capitalize()}ForCausalLM"],
    ).save_pretrained(hf)
    config.hf_model = hf
    config.training.seq_len = 8
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    torch.manual_seed(0)
    model = model_config.build()
    model.eval()
    par = config.parallelism
    from torch.distributed.pipelining.schedules import get_schedule_class

    get_schedule_class(par.pipeline_parallel_schedule)  # a name torch's schedules know
    out: dict[str, Any] = {
        "degree": par.pipeline_parallel_degree,
        "schedule": par.pipeline_parallel_schedule,
        "microbatch_size": par.pipeline_parallel_microbatch_size,
        "local_batch_size": config.training.local_batch_size,
        "parts": par.module_fqns_per_model_part,
        "whole": [n for n, _ in model.named_parameters()],
        "dp_shard": par.data_parallel_shard_degree,
        "dp_replicate": par.data_parallel_replicate_degree,
        "tp": par.tensor_parallel_degree,
        "sequence_parallel": par.enable_sequence_parallel,
        "n_layers": len({m.group(1) for n, _ in model.named_parameters()
                         if (m := re.search(r"layers\.(\d+)\.", n))}),
        "activation_checkpoint": type(config.activation_checkpoint).__qualname__,
    }  # fmt: skip
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
    _, chunks = pipeline_module_split(
        model,
        mesh,
        par.pipeline_parallel_schedule,
        torch.device("cpu"),
        par.module_fqns_per_model_part,
    )
    out["stages"] = [[n for n, _ in c.named_parameters()] for c in chunks]
    ids = torch.randint(0, 64, (2, 8))
    out["error"] = None
    with torch.no_grad():
        want = model(ids)
        x = ids
        try:
            for chunk in chunks:
                chunk.eval()
                x = chunk(x)
            out["chained_equal"] = bool(torch.allclose(x, want))
            out["max_difference"] = float((x - want).abs().max())
        except (TypeError, RuntimeError, ValueError) as exc:  # what a user would meet
            out["error"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2:])))
