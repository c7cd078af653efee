"""torchtitan 0.3's own code trains one step of a pipeplan export (run by test_torchtitan.py).

``python titan_train.py PORT OUT LINE [LINE ...] [--world N] [--defaults]``: each LINE is
torchtitan's export of a plan: 2 stages x 2 data-parallel ranks (``shard``); 2 stages x 2
tensor-parallel ranks (torchtitan's own TP plan for its Llama: ``parallelize_llama`` calls the
model's ``parallelize``, projections column- then row-wise, the embedding and the head split
over the vocabulary, the loss computed loss-parallel, the norms sequence-parallel when the line
enables it; FSDP2 over a 1-rank data-parallel mesh, as torchtitan always applies it); or a
ZB-V plan of 2 ranks x 2 chunks (``--world 2``).  N gloo ranks (forked, default 4) run
the lines one after the other: each rank parses the line with torchtitan's ``ConfigManager``
on ``llama3_debugmodel_ce_loss`` and builds the run with torchtitan's own functions, as its
``Trainer`` does: ``ParallelDims.build_mesh``, ``pipeline_llm`` (which cuts the model by
``module_fqns_per_model_part``, runs ``parallelize_llama`` on each part, the
activation-checkpoint policy and FSDP2 over the data-parallel ranks included, and builds the
schedule), then ``to_empty`` and ``init_weights``.  The model is torchtitan's ``Llama3Model``,
its debug model shrunk (4 layers, dim 32, vocabulary 64; RoPE tables for the config's 2048
tokens) with its maskless attention (causal ``ScaledDotProductAttention``: FlexAttention needs
a BlockMask per micro-batch and inductor).  Each rank then copies one unsplit float32 model's
parameters into its parts, runs ``schedule.step`` once as torch documents it (inputs where it
holds the first stage, targets and a ``losses`` list where it holds the last: a V holds both
on rank 0; the tensor-parallel ranks of a stage feed the same samples) and reports the degrees,
batch, schedule and activation-checkpoint policy its parser read, the blocks that policy
wrapped, its per-micro-batch losses (torchtitan sums the loss over tokens), where each
parameter is split (mesh dimension and placement), and its parameters' gradients, gathered
whole, next to the unsplit model's on the same batch.  Writes to OUT a JSON list per LINE of
one entry per rank.

Settings of torchtitan's, not patches, that the harness puts before each line unless
``--defaults`` (``HARNESS_SETTINGS``): ``--parallelism.spmd_backend partial_dtensor``, since
its default ``spmd_types`` hands ``fully_shard`` annotated plain tensors that torch 2.13's
refuses ("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD
mesh"; a 1-rank data-parallel mesh runs under the default), ``--training.mixed_precision_param
float32`` (the default, bfloat16, rounds the parameters FSDP2 gathers) and
``--training.seq_len 8``.  With ``--defaults`` the line alone is laid on torchtitan's config.

Environment only, never the code under test: the stand-ins of ``titan_split.py`` for imports
that need a GPU library or a large package; torchtitan's device type set to ``cpu``
(``ParallelDims`` falls back to ``cuda`` when it finds no accelerator); and, since gloo has no
``ReduceOp.PREMUL_SUM``, the FSDP modules told to reduce with a plain SUM
(``set_force_sum_reduction_for_comms``): torchtitan sets FSDP's divide factor to 1, which
torch sends as ``PREMUL_SUM(1.0)``, the same sum.  torchtitan's trainer passes ``step``
micro-batch lists (``arg_mbs``, ``target_mbs``) that torch 2.13 lacks, hence ``step()`` as
torch documents it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import tempfile
from typing import Any

import torch

B, T, V = 8, 8, 64  # the whole step's samples, tokens per sample, vocabulary

#: What this harness adds to torchtitan's config before the export's line, unless --defaults.
HARNESS_SETTINGS = [
    "--training.mixed_precision_param",
    "float32",
    "--training.seq_len",
    str(T),
    "--parallelism.spmd_backend",  # see the module's docstring
    "partial_dtensor",
]


def _tiny_llama() -> Any:
    """torchtitan's llama3 debug model, shrunk, with its maskless (causal SDPA) attention."""
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        ScaledDotProductAttention,
    )
    from torchtitan.models.llama3 import _build_llama3_layers, _debugmodel

    dim, heads = 32, 4
    base = _debugmodel("flex")
    layers = _build_llama3_layers(
        n_layers=4,
        dim=dim,
        n_heads=heads,
        hidden_dim=64,
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=2048, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    for layer in layers:  # flex needs a BlockMask per micro-batch and inductor; SDPA neither
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return dataclasses.replace(
        base,
        dim=dim,
        vocab_size=V,
        tok_embeddings=Embedding.Config(
            num_embeddings=V, embedding_dim=dim, param_init=base.tok_embeddings.param_init
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=base.norm.param_init),
        lm_head=Linear.Config(in_features=dim, out_features=V, param_init=base.lm_head.param_init),
        layers=layers,
    )


def _rank(rank: int, world: int, port: int, out: str, lines: list[str], defaults: bool) -> None:
    from titan_split import _install_stand_ins

    _install_stand_ins()
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks on a few cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        jobs = []
        for line in lines:  # one after the other, each its own torchtitan run
            results: list[Any] = [None] * world
            dist.all_gather_object(results, _train(world, line, defaults))
            jobs.append(results)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(jobs, f)
        dist.barrier()  # no rank leaves while another still talks to it
    finally:
        dist.destroy_process_group()


def _train(world: int, line: str, defaults: bool) -> dict[str, Any]:
    import torchtitan.distributed.parallel_dims as titan_dims
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    titan_dims.device_type = "cpu"  # torchtitan's fallback is cuda
    config = ConfigManager().parse_args(
        [
            "--module",
            "llama3",
            "--config",
            "llama3_debugmodel_ce_loss",
            # this harness's settings first: the export's line may end in a tyro subcommand
            # (activation_checkpoint:none), after which only that subcommand's options parse
            *([] if defaults else HARNESS_SETTINGS),
            *shlex.split(line),
        ]
    )
    par = config.parallelism
    dist_utils.set_spmd_backend(par.spmd_backend)  # as torchtitan's Trainer does
    dims = ParallelDims.from_config(par, world)
    dims.build_mesh()
    model_config = _tiny_llama()
    config.model_spec.model = model_config
    model_config.update_from_config(config=config)
    torch.manual_seed(0)
    whole = model_config.build()
    with torch.no_grad():
        whole.init_weights()
    state = {k: v.detach().clone() for k, v in whole.named_parameters()}
    with torch.device("meta"):
        model = model_config.build()
    loss_fn = config.loss.build(compile_config=config.compile)  # sum-reduced cross-entropy
    schedule, parts, first, last = pipeline_llm(
        model,
        parallel_dims=dims,
        training=config.training,
        parallelism=par,
        compile_config=config.compile,
        ac_config=config.activation_checkpoint,
        dump_folder=tempfile.mkdtemp(),
        device=torch.device("cpu"),
        model_config=model_config,
        parallelize_fn=parallelize_llama,
        loss_fn=loss_fn,
    )
    for part in parts:  # gloo has no PREMUL_SUM: the same sum (factor 1) as a plain SUM
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    for part in parts:  # as torchtitan's Trainer does, then the whole model's parameters
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
            for name, param in part.named_parameters():
                full = state[name.replace("_checkpoint_wrapped_module.", "")]
                if isinstance(param, DTensor):
                    full = distribute_tensor(full, param.device_mesh, param.placements)
                param.copy_(full)
        part.train()
    ids = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    whole.train()
    logits = whole(inputs).flatten(0, 1)
    want = torch.nn.functional.cross_entropy(logits, labels.flatten(), reduction="sum")
    want.backward()  # torchtitan sums the loss and the gradients (FSDP's divide factor 1)
    batch, tp = dims.get_optional_mesh("batch"), dims.get_optional_mesh("tp")
    d = batch.get_local_rank() if batch is not None else 0
    share = B // (batch.size() if batch is not None else 1)
    mine = slice(d * share, (d + 1) * share)  # the tensor-parallel ranks feed the same samples
    losses: list[torch.Tensor] = []
    # a V schedule holds the first and the last stage on rank 0: inputs and targets both
    schedule.step(
        *([inputs[mine]] if first else []),
        target=labels[mine] if last else None,
        losses=losses if last else None,
    )
    grad_diff, grad_max = 0.0, 0.0
    for part in parts:
        for name, param in part.named_parameters():
            g = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            ref = whole.get_parameter(name.replace("_checkpoint_wrapped_module.", "")).grad
            grad_diff = max(grad_diff, float((g - ref).abs().max()))
            grad_max = max(grad_max, float(ref.abs().max()))
    return {
        "pp": dims.get_mesh("pp").get_local_rank(),
        "dp": d,
        "tp": tp.get_local_rank() if tp is not None else 0,
        "tp_degree": par.tensor_parallel_degree,
        "sequence_parallel": par.enable_sequence_parallel,
        "first": first,
        "last": last,
        "parts": [sorted({_owner(n) for n, _ in p.named_parameters()}) for p in parts],
        "sharded": all(
            isinstance(q, DTensor) and q.device_mesh.size() == 2
            for p in parts
            for q in p.parameters()
        ),
        "placements": {  # parameter -> (mesh dimension, placement) where it is split
            n: [
                [dim, str(pl)]
                for dim, pl in zip(q.device_mesh.mesh_dim_names or (), q.placements)
                if pl.is_shard()
            ]
            for p in parts
            for n, q in p.named_parameters()
            if isinstance(q, DTensor)
        },
        "schedule": type(schedule).__name__,
        "microbatches": schedule._n_microbatches,
        "local_batch_size": config.training.local_batch_size,
        "activation_checkpoint": type(config.activation_checkpoint).__qualname__,
        "checkpointed": [  # the blocks torchtitan's activation checkpointing wrapped, per part
            sorted(n for n, m in p.named_modules() if isinstance(m, CheckpointWrapper))
            for p in parts
        ],
        "loss_sum": float(sum(x.detach() for x in losses)) if losses else None,
        "whole_loss_sum": want.item(),
        "tokens": B * T,
        "grad_difference": grad_diff,
        "grad_max": grad_max,
    }


def _owner(name: str) -> str:
    """The model part's name for a parameter: ``layers.N`` or a direct child."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


if __name__ == "__main__":
    import argparse

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("out")
    parser.add_argument("lines", nargs="+")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--defaults", action="store_true")
    a = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # torchtitan imported once, here, and the ranks forked: each spawned rank imported torch
    # and torchtitan again (the parent has run no op and started no thread yet)
    from titan_split import _install_stand_ins

    _install_stand_ins()
    import torchtitan.distributed.pipeline_parallel
    import torchtitan.models.llama3  # noqa: F401
    from torchtitan.config.manager import ConfigManager  # noqa: F401

    mp.start_processes(_rank, args=(a.world, a.port, a.out, a.lines, a.defaults),
                       nprocs=a.world, start_method="fork")  # fmt: skip
