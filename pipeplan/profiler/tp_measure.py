"""Measure each distinct tensor-parallel unit split t ways on t ranks, the collectives included.

``pipeplan profile --tensor-parallel T`` (:func:`measure_tensor_parallel`) fills
``Unit.tp_timings[T][b]`` for every unit that :mod:`pipeplan.profiler.tp_annotate` found
splittable, measured, not modelled:

1. **Ranks.**  T processes (``python -m pipeplan.profiler.tp_measure REQUEST RANK``) join one
   process group (gloo on the CPU) and a one-dimensional device mesh
   (``init_device_mesh("cpu", (T,))``).
2. **The traced units and their arguments.**  Each rank builds the model on ``meta``
   (:func:`pipeplan.profiler.units.build_meta`; buffers real), traces it at each micro-batch
   size b on fake tensors, groups it into the profile's units (``Profile.granularity`` and the
   units ``Profile.grouping`` opened; a different count is refused) and runs the graph once on
   the real batch (:func:`pipeplan.profiler.units.observe`), as ``--method units`` does: what
   depends only on the inputs and buffers (position ids, rotary tables, masks) gets its real
   values, activations their shapes.  Each distinct splittable unit is measured, one module or
   several (a head: the final norm and the vocabulary's projection).
3. **Split.**  The unit's parameters are materialized alone
   (:func:`pipeplan.intake.meta.materialize`, the same seed on every rank, so every rank starts
   from the same unsplit weights) and its traced body is split exactly as the runtime splits a
   stage (:func:`pipeplan.intake.tp_stages.split_stage_body`: ``ColwiseParallel`` /
   ``RowwiseParallel`` per ``UnitTensorParallel.styles`` through torch's
   ``parallelize_module``, the head counts baked into the trace made local, per-head tables
   and masks cut to the rank's heads).  So the bytes it saves are the runtime's: the traced
   graph saves what the eager module does not always (Llama's ``repeat_kv`` copies of the keys
   and values under ``torch.export``).
4. **Timing.**  The arguments are made real (seeded normal floats where only the shape is
   known, the same on every rank; floating inputs other than the model's own get a
   gradient), then ``warmup`` and ``repeats`` passes of forward and backward (of the sum of
   the outputs), each started together on all ranks (a barrier), the all-reduces included.
   Each rank keeps the median of its forward and of its backward times; the Timing records
   the largest rank's median (the ranks wait for each other at every all-reduce, so they
   hardly differ), the interquartile range of that rank, the bytes autograd saves on a rank
   (local shards; parameters and buffers excluded, as the profile counts them) and the
   output's bytes.  :class:`RankMeasure` also gives each unit's parameter bytes on a rank
   (the local shards and the replicated rest).
"""

from __future__ import annotations

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
from torch.utils._pytree import tree_leaves, tree_map

from pipeplan.intake.graph import group_units
from pipeplan.intake.meta import materialize
from pipeplan.intake.model import ModelSpec, load_model
from pipeplan.intake.tp_layout import Layout, check_degree
from pipeplan.intake.tp_stages import split_stage_body
from pipeplan.planner.errors import InvalidRequestError, UnitMeasureError
from pipeplan.planner.host import free_port
from pipeplan.planner.types import Profile, Timing
from pipeplan.profiler.measure import saved_storages, storage_keys
from pipeplan.profiler.tp_annotate import model_layout
from pipeplan.profiler.unit_modules import UnitModule, split_units
from pipeplan.profiler.units import build_meta, observe, realize

__all__ = ["RankMeasure", "measure_split", "measure_tensor_parallel"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

CPU = torch.device("cpu")


@dataclass(frozen=True)
class RankMeasure:
    """One unit measured split t ways: the Timing per micro-batch size, and the bytes of its
    parameters each rank holds."""

    timings: dict[int, Timing]
    param_bytes: int


def _traced_units(
    request: Mapping[str, Any], b: int
) -> tuple[ModelSpec, nn.Module, list[UnitModule], dict[str, Any], set[str]]:
    """The model built on ``meta`` and traced at micro-batch ``b``, its units as the profile
    grouped them, the values of every measured unit's inputs from one run on the real batch
    (step 2 of the module docstring), and the names of the model's own inputs."""
    dtype = _DTYPES[request["dtype"]]
    spec, module, example, traced = build_meta(
        request["model"], request["kwargs"], CPU, dtype, b, request["tracer"]
    )
    specs = group_units(traced, request["granularity"], request["expanded"])
    if len(specs) != request["n_units"]:
        raise UnitMeasureError(
            f"the model traced at micro-batch {b} has {len(specs)} units, the profile "
            f"{request['n_units']}: profile it again with this torch"
        )
    pieces = split_units(traced, specs)
    placeholders = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
    keep = {n for k, _ in request["units"] for n in pieces[k].inputs}
    values, _ = observe(traced, example, keep)
    values.update(zip(placeholders, example))
    return spec, module, pieces, values, set(placeholders)


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _sum_outputs(out: Any) -> Tensor:
    sums = [_local(x).sum() for x in tree_leaves(out) if isinstance(x, Tensor) and x.requires_grad]
    return torch.stack([s.float() for s in sums]).sum()


def _time_unit(mod: nn.Module, args: Sequence[Any], warmup: int, repeats: int) -> dict[str, Any]:
    import torch.distributed as dist

    params = [_local(p) for p in mod.parameters()]
    with saved_storages(storage_keys([*params, *mod.buffers()])) as seen:
        out = mod(*args)
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
        out = mod(*args)
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


def _with_grad(value: Any, grad: bool) -> Any:
    """``value``'s floating tensors needing a gradient where ``grad`` (step 4)."""

    def one(x: Any) -> Any:
        return x.requires_grad_(grad and x.is_floating_point()) if isinstance(x, Tensor) else x

    return tree_map(one, value)


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
        results: dict[str, Any] = {str(k): {} for k, _ in request["units"]}
        for b in request["sizes"]:
            spec, module, pieces, values, frozen = _traced_units(request, b)
            for k, styles in request["units"]:
                piece = pieces[k]
                materialize(
                    module, piece.params, CPU, seed=request["seed"], init_weights=spec.init_weights
                )
                gen = torch.Generator().manual_seed(request["seed"] * 1009 + k * 31 + b)
                args = [
                    _with_grad(realize(values[n], CPU, gen), n not in frozen) for n in piece.inputs
                ]
                body = piece.module
                if t > 1:
                    split_stage_body(body, styles, mesh, args)
                results[str(k)][str(b)] = _time_unit(
                    body, args, request["warmup"], request["repeats"]
                )
            del module, spec, pieces, values
        path = os.path.join(out_dir, f"rank{rank}.json")
        with open(path + ".part", "w") as fh:
            json.dump(results, fh)
        os.replace(path + ".part", path)  # whole or absent: _launch reads its presence
        dist.barrier()  # no rank tears its process group down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def _launch(request: str, t: int, timeout_s: float) -> None:
    """Run the ``t`` ranks (``python -m pipeplan.profiler.tp_measure REQUEST RANK``) and wait;
    a rank that fails or outlives ``timeout_s`` stops them all with its last error line.  Each
    rank's error output goes to a file beside the request (a pipe could fill and stall it).
    A rank that fails after every rank wrote its results (gloo's teardown after the last
    barrier can abort a rank with "terminate called without an active exception", seen
    rarely here) loses nothing: the results stand."""
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
    done = all(
        os.path.exists(os.path.join(os.path.dirname(request), f"rank{r}.json")) for r in range(t)
    )
    if failed is not None and not done:
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
    """Each distinct splittable unit of ``profile``, its traced body measured split ``t`` ways
    on ``t`` ranks (module docstring), by unit index.  ``t`` = 1 runs the unsplit body in the
    same harness (a baseline).  ``threads`` per rank defaults to the cores divided
    among the ranks."""
    spec = load_model(profile.model, profile.model_kwargs, meta=True)
    layout = model_layout(spec.module)
    if not isinstance(layout, Layout):
        raise InvalidRequestError(f"--tensor-parallel {t}: {layout}")
    check_degree(layout, t)
    units = [
        (u.index, u.tensor_parallel.styles)
        for u in profile.units
        if u.tensor_parallel is not None and u.measured_as is None
    ]
    if not units:
        return {}
    request = {
        "t": t,
        "threads": threads or max(1, (os.cpu_count() or 1) // t),
        "port": free_port(),
        "dtype": profile.dtype,
        "tracer": profile.tracer,
        "granularity": profile.granularity,
        "expanded": list(profile.grouping.expanded) if profile.grouping else [],
        "n_units": len(profile.units),
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
    for k, _ in units:
        m = _merge([r[str(k)] for r in ranks])
        if m is not None:
            measured[k] = m
    return measured


def measure_tensor_parallel(profile: Profile, t: int, **options: Any) -> Profile:
    """``profile`` with ``Unit.tp_timings[t]`` measured (:func:`measure_split`, whose
    ``options`` these are) for every splittable unit; copies (``Unit.measured_as``) take their
    original's."""
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
