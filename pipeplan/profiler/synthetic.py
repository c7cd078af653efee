"""Synthetic profiles with realistic spreads: a Profile without a model, for tests, examples and
solver benchmarks (the profiler's output, made up rather than measured).

Unit times are log-normal around a base (sigma ``spread``), with optional heavy first and last
units (embedding and LM head); backward is 1.5-2.5x forward; activations shrink and parameters
grow along the model, as in CNNs.  A unit's time at micro-batch size b is proportional to ``overhead + b``
(a fixed per-kernel cost worth ``overhead`` samples), which is what makes the micro-batch count a
real trade-off.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeplan.planner.types import Cut, CutTensor, DeviceInfo, Profile, SharedParam, Timing, Unit

__all__ = ["synthetic_profile"]


def synthetic_profile(
    n_units: int,
    *,
    batch_size: int = 64,
    microbatch_sizes: Sequence[int] | None = None,
    seed: int = 0,
    spread: float = 0.5,
    heavy_ends: bool = False,
    base_time_s: float = 1e-3,
    overhead: float = 2.0,
    tied: bool = False,
    shared: Sequence[Sequence[int]] = (),
    loss: bool = False,
    update_s_per_byte: float = 0.0,
    update_curvature: float = 0.0,
    checkpoint_call_s: tuple[float, float] = (0.0, 0.0),
) -> Profile:
    """A random but plausible :class:`Profile` of ``n_units`` units.

        ``update_s_per_byte`` is an Adam step's seconds per parameter byte (SGD's is an eighth of
        it, momentum's a third); 0 leaves the profile without update times.
        ``update_curvature`` q > 0 adds an ``update_curve`` on every prefix of the units whose
        step time grows faster than the bytes: rate * w * (1 + q w / total).  The checkpointed
        forward costs 1.0-1.3x the forward, plus ``checkpoint_call_s`` (the call's own (forward,
        backward) seconds, also added to the checkpointed backward).  ``tied`` shares a weight
    between the first and last units; ``shared`` adds one shared parameter per sequence of user
    units (owned by the first, as large as its parameters; units past the last are dropped).

        >>> p = synthetic_profile(4, batch_size=8, microbatch_sizes=[1, 8])
        >>> (p.n_units, len(p.cuts), sorted(p.units[0].timings))
        (4, 3, [1, 8])
    """
    rng = np.random.default_rng(seed)
    if microbatch_sizes is None:
        microbatch_sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if batch_size % b == 0]
    sizes = sorted({int(b) for b in microbatch_sizes})
    scale = rng.lognormal(0.0, spread, n_units)
    if heavy_ends and n_units >= 3:
        scale[0] *= 6.0
        scale[-1] *= 8.0
    ratio = rng.uniform(1.5, 2.5, n_units)
    recompute_factor = rng.uniform(1.0, 1.3, n_units)  # checkpointing costs more than f + g
    # Drawn from a second stream so the first one (and every older profile) stays as it was.
    hook_factor = np.random.default_rng([seed, 1]).uniform(1.0, 1.3, n_units)
    call_f, call_b = checkpoint_call_s
    depth = np.linspace(0.0, 1.0, n_units)
    act_per_sample = (rng.lognormal(0.0, spread, n_units) * (2.0 - depth) * 2**16).astype(int)
    params = (rng.lognormal(0.0, spread, n_units) * (0.5 + depth) * 2**20).astype(int)
    largest = (params * np.random.default_rng([seed, 2]).uniform(0.2, 1.0, n_units)).astype(int)
    units = []
    for u in range(n_units):
        timings = {}
        for b in sizes:
            eff = (overhead + b) / (overhead + 1)
            fwd = float(base_time_s * scale[u] * eff)
            timings[b] = Timing(
                forward_s=fwd,
                backward_s=float(fwd * ratio[u]),
                recompute_backward_s=float(fwd * (ratio[u] + 1) * recompute_factor[u] + call_b),
                recompute_forward_s=float(fwd * hook_factor[u] + call_f),
                saved_bytes=int(act_per_sample[u] * b * 2),
                output_bytes=int(act_per_sample[u] * b),
            )
        units.append(
            Unit(
                index=u,
                name=f"unit{u}",
                nodes=(f"node{u}",),
                params=(f"p{u}",),
                param_bytes=int(params[u]),
                largest_param_bytes=int(largest[u]),
                timings=timings,
            )
        )
    cuts = []
    for k in range(n_units - 1):
        main = int(act_per_sample[k])
        tensors = [CutTensor(node=f"node{k}", bytes_per_sample=main)]
        if rng.random() < 0.3:
            tensors.append(CutTensor(node=f"skip{k}", bytes_per_sample=main // 2))
        cuts.append(
            Cut(
                after=k,
                tensors=tuple(tensors),
                bytes_per_sample=sum(t.bytes_per_sample for t in tensors),
            )
        )
    sharing: list[SharedParam] = []
    if tied and n_units >= 2:  # the first and last units share a weight, as embedding and head
        sharing.append(SharedParam(name="p0", bytes=units[0].param_bytes, units=(0, n_units - 1)))
    for k, users in enumerate(shared):
        kept = sorted({int(u) for u in users if 0 <= int(u) < n_units})
        if len(kept) >= 2:
            sharing.append(
                SharedParam(name=f"s{k}", bytes=units[kept[0]].param_bytes, units=tuple(kept))
            )
    loss_timings: dict[int, Timing] = {}
    if loss:  # a loss as heavy as the last unit's forward, saving its output
        last = units[-1].timings
        loss_timings = {
            b: Timing(
                forward_s=t.forward_s,
                backward_s=t.forward_s,
                saved_bytes=t.output_bytes,
                output_bytes=4,
            )
            for b, t in last.items()
        }
    total = sum(u.param_bytes for u in units)
    update = (
        {"sgd": update_s_per_byte * total / 8, "momentum": update_s_per_byte * total / 3,
         "adam": update_s_per_byte * total}
        if update_s_per_byte > 0
        else {}
    )  # fmt: skip
    curve: dict[str, tuple[tuple[int, float], ...]] = {}
    if update_curvature > 0 and update:
        prefix = np.cumsum([u.param_bytes for u in units])
        curve = {
            name: tuple(
                (int(w), float(s / total * w * (1 + update_curvature * w / total)))
                for w in prefix
                if w > 0
            )
            for name, s in update.items()
        }
    return Profile(
        loss=loss_timings,
        update_s=update,  # type: ignore[arg-type]
        update_curve=curve,  # type: ignore[arg-type]
        checkpoint_call_s=checkpoint_call_s,
        shared_params=tuple(sharing),
        model=f"synthetic:n{n_units}-seed{seed}",
        tracer="fx",
        graph_fingerprint=f"synthetic-{n_units}-{seed}",
        device=DeviceInfo(kind="cpu", name="synthetic", threads=1),
        torch_version="n/a",
        dtype="float32",
        batch_size=batch_size,
        microbatch_sizes=tuple(sizes),
        input_bytes_per_sample=int(act_per_sample[0]),
        units=tuple(units),
        cuts=tuple(cuts),
    )
