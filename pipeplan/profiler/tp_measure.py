"""Measure each distinct tensor-parallel unit split t ways on t ranks, the collectives included.

``pipeplan profile --tensor-parallel T`` (:func:`measure_tensor_parallel`) fills
``Unit.tp_timings[T][b]`` for every unit that :mod:`pipeplan.profiler.tp_annotate` found
splittable, measured, not modelled:

1. **Ranks.**  T processes (``torch.multiprocessing``, spawned) join one process group (gloo
   on the CPU) and a one-dimensional device mesh (``init_device_mesh("cpu", (T,))``).
2. **The unit's module and its arguments.**  Each rank builds the model on ``meta``
   (:func:`pipeplan.intake.model.load_model`; buffers real) and runs it once per micro-batch
   size on the real batch under :class:`_Mixed`, a dispatch mode that runs an operation on
   ``meta`` when one of its tensors is on ``meta`` and for real otherwise (a factory asked
   for ``meta`` runs on the CPU): what depends only on the inputs and buffers (position ids,
   rotary tables, masks) gets its real values, activations their shapes.  A forward pre-hook
   on each unit's module keeps its arguments.  A unit is measured when it is one module:
   the module whose parameters and buffers are exactly the unit's (``Unit.params``); other
   units keep no ``tp_timings`` (the cost model models them).
3. **Split.**  The module is materialized alone (:func:`pipeplan.intake.meta.materialize`, the
   same seed on every rank, so every rank starts from the same unsplit weights) and split by
   torch's :func:`~torch.distributed.tensor.parallel.parallelize_module`: ``ColwiseParallel`` /
   ``RowwiseParallel`` per ``UnitTensorParallel.styles``.  Where an attention module keeps its
   head counts as attributes (T5's ``n_heads`` and ``inner_dim``, BERT's ``all_head_size``,
   :data:`HEAD_ATTRS`), they are divided by T, so its shapes are the local heads'; T5's
   relative-position bias table is split column-wise over the heads too, and a position bias
   passed in (``position_bias``) is sliced to the rank's heads.  ``transformers`` 5's
   attention reshapes with ``-1`` heads and needs nothing more.
4. **Timing.**  The arguments are made real (seeded normal floats where only the shape is
   known, the same on every rank; activations that need a gradient get one), then
   ``warmup`` and ``repeats`` passes of forward and backward (of the sum of the outputs), each
   started together on all ranks (a barrier), the all-reduces included.  Each rank keeps the
   median of its forward and of its backward times; the Timing records the largest rank's
   median (the ranks wait for each other at every all-reduce, so they hardly differ), the
   interquartile range of that rank, the bytes autograd saves on a rank (local shards;
   parameters excluded) and the output's bytes.  :class:`RankMeasure` also gives each unit's
   parameter bytes on a rank (the local shards and the replicated rest).
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from pipeplan.intake.meta import materialize
from pipeplan.intake.model import load_model
from pipeplan.intake.spec import cast_floating
from pipeplan.intake.tp_layout import Layout, check_degree, parallel_style
from pipeplan.planner.errors import InvalidRequestError, UnitMeasureError
from pipeplan.planner.host import free_port
from pipeplan.planner.types import Profile, Timing, Unit
from pipeplan.profiler.measure import saved_storages, storage_keys
from pipeplan.profiler.tp_annotate import head_tables, model_layout

__all__ = ["HEAD_ATTRS", "RankMeasure", "measure_split", "measure_tensor_parallel", "unit_module"]

#: Attributes of an attention module that count its heads (or their total width); a split
#: module's parent has each one it holds divided by t.
HEAD_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "n_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "all_head_size",
    "inner_dim",
)

_BIAS_KWARGS = ("position_bias", "encoder_decoder_position_bias")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

META = torch.device("meta")


@dataclass(frozen=True)
class RankMeasure:
    """One unit measured split t ways: the Timing per micro-batch size, and the bytes of its
    parameters each rank holds."""

    timings: dict[int, Timing]
    param_bytes: int


class _Mixed(TorchDispatchMode):
    """Runs an operation on ``meta`` when any of its tensors is there, for real otherwise; a
    factory asked for ``meta`` (``arange(..., device=x.device)`` of a ``meta`` x) runs on the
    CPU, so position ids and masks keep their values."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(t, Tensor) and t.is_meta for t in tree_leaves((args, kwargs))):

            def to_meta(v: Any) -> Any:
                if isinstance(v, Tensor):
                    return v.to(META)
                return META if isinstance(v, torch.device) else v

            args, kwargs = tree_map(to_meta, args), tree_map(to_meta, kwargs)
        elif (dev := kwargs.get("device")) is not None and torch.device(dev).type == "meta":
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


def unit_module(module: nn.Module, unit: Unit) -> str | None:
    """The qualified name of the module of ``module`` whose parameters and buffers are
    exactly ``unit``'s (``Unit.params``, by first qualified name), or ``None``."""
    canonical: dict[int, str] = {}
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        canonical.setdefault(id(t), name)
    want = set(unit.params)
    for name, mod in module.named_modules():
        if not (name == unit.name or name.endswith("." + unit.name)):
            continue
        have = {canonical[id(t)] for t in (*mod.parameters(), *mod.buffers())}
        if have == want:
            return name
    return None


def _capture(
    module: nn.Module, targets: Mapping[int, str], inputs: Sequence[Tensor]
) -> dict[int, tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments each target module (unit index -> qualified name) is called with, from
    one run of ``module`` under :class:`_Mixed` (step 2 of the module docstring)."""
    got: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    handles = []
    for k, name in targets.items():

        def hook(mod: nn.Module, args: Any, kwargs: Any, k: int = k) -> None:
            got.setdefault(k, (tuple(args), dict(kwargs)))

        handles.append(module.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.enable_grad(), _Mixed():
            module(*inputs)
    finally:
        for h in handles:
            h.remove()

    def cut(v: Any) -> Any:  # free the run's graph, which holds the parameters
        if isinstance(v, Tensor) and v.requires_grad:
            return v.detach().requires_grad_(v.is_floating_point())
        return v.detach() if isinstance(v, Tensor) else v

    return {k: tree_map(cut, call) for k, call in got.items()}


def _realize(value: Any, gen: torch.Generator) -> Any:
    def fill(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if not t.is_meta:
            return t.detach()
        out = torch.empty(t.shape, dtype=t.dtype)
        if out.is_floating_point():
            out.normal_(generator=gen)
        elif out.dtype == torch.bool:
            out.fill_(True)
        else:
            out.zero_()
        return out.requires_grad_(t.requires_grad and out.is_floating_point())

    return tree_map(fill, value)


def _split(mod: nn.Module, styles: Mapping[str, str], prefix: str, t: int, mesh: Any) -> None:
    """Split ``mod`` (named ``prefix`` in the model) by ``styles`` (step 3 of the module
    docstring)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        parallelize_module,
    )

    rel = {name[len(prefix) + 1 :] if prefix else name: s for name, s in styles.items()}
    plan: dict[str, ParallelStyle] = {k: parallel_style(s) for k, s in rel.items()}
    parents = {k.rsplit(".", 1)[0] if "." in k else "" for k, s in rel.items() if s == "colwise"}
    for parent in parents:
        owner = mod.get_submodule(parent)
        for attr in HEAD_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % t == 0:
                setattr(owner, attr, value // t)
        for name in head_tables(owner):
            key = f"{parent}.{name}" if parent else name
            plan[key] = ColwiseParallel(output_layouts=Shard(-1))
    parallelize_module(mod, mesh, plan)


def _slice_heads(
    mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], t: int, rank: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A position bias passed in, (1, heads, q, k), sliced to this rank's heads."""
    try:
        bound = inspect.signature(mod.forward).bind_partial(*args, **kwargs)
    except TypeError:
        return args, kwargs
    changed = False
    for key in _BIAS_KWARGS:
        value = bound.arguments.get(key)
        if isinstance(value, Tensor) and value.dim() == 4 and value.shape[1] % t == 0:
            h = value.shape[1] // t
            part = value.detach()[:, rank * h : (rank + 1) * h].contiguous()
            bound.arguments[key] = part.requires_grad_(value.requires_grad)
            changed = True
    return (tuple(bound.args), dict(bound.kwargs)) if changed else (args, kwargs)


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _sum_outputs(out: Any) -> Tensor:
    sums = [_local(x).sum() for x in tree_leaves(out) if isinstance(x, Tensor) and x.requires_grad]
    return torch.stack([s.float() for s in sums]).sum()


def _time_unit(
    mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], warmup: int, repeats: int
) -> dict[str, Any]:
    import torch.distributed as dist

    params = [_local(p) for p in mod.parameters()]
    with saved_storages(storage_keys(params)) as seen:
        out = mod(*args, **kwargs)
    saved = sum(seen.values())
    output_bytes = sum(
        _local(x).numel() * _local(x).element_size()
        for x in tree_leaves(out)
        if isinstance(x, Tensor)
    )
    _sum_outputs(out).backward()
    del out
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + repeats):
        mod.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        out = mod(*args, **kwargs)
        loss = _sum_outputs(out)
        mid = time.perf_counter()
        dist.barrier()
        mid2 = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        if i >= warmup:
            fwd.append(mid - start)
            bwd.append(end - mid2)
        del out, loss
    local_bytes = sum(p.numel() * p.element_size() for p in params)
    return {
        "forward": fwd,
        "backward": bwd,
        "saved": saved,
        "output": output_bytes,
        "param_bytes": local_bytes,
    }


def _rank(rank: int, request: dict[str, Any], out_dir: str) -> None:
    """One tensor-parallel rank: steps 1-4 of the module docstring; writes its raw times."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    t = request["t"]
    torch.set_num_threads(request["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=t)
    try:
        mesh = init_device_mesh("cpu", (t,))
        dtype = _DTYPES[request["dtype"]]
        results: dict[str, Any] = {}
        for k, name, styles in request["units"]:
            results[str(k)] = {}
        for b in request["sizes"]:
            spec = load_model(request["model"], request["kwargs"], meta=True)
            module = cast_floating(spec.module, dtype).train()
            inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in spec.batch(b)[0])
            targets = {k: name for k, name, _ in request["units"]}
            calls = _capture(module, targets, inputs)
            for k, name, styles in request["units"]:
                owned = [
                    n
                    for n, _ in [*module.named_parameters(), *module.named_buffers()]
                    if n == name or n.startswith(name + ".")
                ]
                materialize(module, owned, torch.device("cpu"), seed=request["seed"])
                mod = module.get_submodule(name)
                gen = torch.Generator().manual_seed(request["seed"] * 1009 + k * 31 + b)
                args, kwargs = _realize(calls[k], gen)
                if t > 1:
                    _split(mod, styles, name, t, mesh)
                    args, kwargs = _slice_heads(mod, args, kwargs, t, rank)
                results[str(k)][str(b)] = _time_unit(
                    mod, args, kwargs, request["warmup"], request["repeats"]
                )
            del module, spec
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(results, fh)
        dist.barrier()  # no rank tears its process group down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def _launch(request: str, t: int, timeout_s: float) -> None:
    """Run the ``t`` ranks (``python -m pipeplan.profiler.tp_measure REQUEST RANK``) and wait;
    a rank that fails or outlives ``timeout_s`` stops them all with its last error line.  Each
    rank's error output goes to a file beside the request (a pipe could fill and stall it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [os.path.join(os.path.dirname(request), f"rank{r}.err") for r in range(t)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pipeplan.profiler.tp_measure", request, str(r)],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=env,
                )
            )

    def last_line(r: int) -> str:
        with open(logs[r]) as fh:
            lines = fh.read().strip().splitlines()
        return lines[-1] if lines else f"rank {r} exited with {procs[r].returncode}"

    deadline = time.monotonic() + timeout_s
    failed: str | None = None
    try:
        while failed is None and any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failed = f"the ranks ran past {timeout_s:.0f} s"
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            failed = last_line(bad[0]) if bad else failed
            time.sleep(0.05)
        bad = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        failed = failed or (last_line(bad[0]) if bad else None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if failed is not None:
        raise UnitMeasureError(
            f"measuring the units split {t} ways failed: {failed}; profile without "
            f"--tensor-parallel (the planner then models it)"
        )


def _iqr(xs: Sequence[float]) -> float:
    q1, q3 = np.percentile(xs, [25, 75])
    return float(q3 - q1)


def _merge(per_rank: Sequence[Mapping[str, Any]]) -> RankMeasure | None:
    timings: dict[int, Timing] = {}
    for b in per_rank[0]:
        runs = [r[b] for r in per_rank]
        slowest = max(
            runs, key=lambda r: statistics.median(r["forward"]) + statistics.median(r["backward"])
        )
        timings[int(b)] = Timing(
            forward_s=max(statistics.median(r["forward"]) for r in runs),
            backward_s=max(statistics.median(r["backward"]) for r in runs),
            forward_spread_s=_iqr(slowest["forward"]),
            backward_spread_s=_iqr(slowest["backward"]),
            saved_bytes=max(r["saved"] for r in runs),
            output_bytes=max(r["output"] for r in runs),
        )
    first = next(iter(per_rank[0].values()), None)
    return RankMeasure(timings, first["param_bytes"]) if first else None


def measure_split(
    profile: Profile,
    t: int,
    *,
    warmup: int = 2,
    repeats: int = 5,
    threads: int | None = None,
    seed: int = 0,
    timeout_s: float = 1800.0,
) -> dict[int, RankMeasure]:
    """Each distinct splittable unit of ``profile`` that is one module, measured split ``t``
    ways on ``t`` ranks (module docstring), by unit index.  ``t`` = 1 runs the unsplit module
    in the same harness (a baseline).  ``threads`` per rank defaults to the cores divided
    among the ranks."""
    spec = load_model(profile.model, profile.model_kwargs, meta=True)
    layout = model_layout(spec.module)
    if not isinstance(layout, Layout):
        raise InvalidRequestError(f"--tensor-parallel {t}: {layout}")
    check_degree(layout, t)
    units = []
    for u in profile.units:
        if u.tensor_parallel is None or u.measured_as is not None:
            continue
        name = unit_module(spec.module, u)
        if name is not None:
            units.append((u.index, name, u.tensor_parallel.styles))
    if not units:
        return {}
    request = {
        "t": t,
        "threads": threads or max(1, (os.cpu_count() or 1) // t),
        "port": free_port(),
        "dtype": profile.dtype,
        "model": profile.model,
        "kwargs": dict(profile.model_kwargs),
        "sizes": sorted(profile.microbatch_sizes, reverse=True),
        "units": units,
        "warmup": warmup,
        "repeats": repeats,
        "seed": seed,
    }
    with tempfile.TemporaryDirectory(prefix="pipeplan-tp-") as tmp:
        path = os.path.join(tmp, "request.json")
        with open(path, "w") as fh:
            json.dump(request, fh)
        _launch(path, t, timeout_s)
        ranks = []
        for r in range(t):
            with open(os.path.join(tmp, f"rank{r}.json")) as fh:
                ranks.append(json.load(fh))
    measured: dict[int, RankMeasure] = {}
    for k, _, _ in units:
        m = _merge([r[str(k)] for r in ranks])
        if m is not None:
            measured[k] = m
    return measured


def measure_tensor_parallel(profile: Profile, t: int, **options: Any) -> Profile:
    """``profile`` with ``Unit.tp_timings[t]`` measured (:func:`measure_split`, whose
    ``options`` these are) for every splittable unit that is one module; copies
    (``Unit.measured_as``) take their original's."""
    if t < 2:
        raise InvalidRequestError(f"--tensor-parallel {t} measures nothing; give 2 or more")
    measured = measure_split(profile, t, **options)
    out = []
    for u in profile.units:
        rep = u.index if u.measured_as is None else u.measured_as
        if rep in measured:
            u = u.model_copy(update={"tp_timings": {**u.tp_timings, t: measured[rep].timings}})
        out.append(u)
    return profile.model_copy(update={"units": tuple(out)})


if __name__ == "__main__":
    with open(sys.argv[1]) as _fh:
        _rank(int(sys.argv[2]), json.load(_fh), os.path.dirname(sys.argv[1]))
