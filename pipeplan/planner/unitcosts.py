"""Per-unit cost tables for one micro-batch count: what every formula of the cost model reads.

For m micro-batches of size b = B / m (a profiled size), :func:`unit_costs` reads the profile's
measurements at b into arrays over the units u = 0..n-1 (seconds on a device of speed 1):

    f_u, g_u         forward and backward seconds
    fc_u - c_F       forward under checkpointing, less one checkpoint call's own forward
    r_u - c_B        backward under checkpointing (recompute included), less the call's own
                     backward; (c_F, c_B) = ``Profile.checkpoint_call_s``; clipped below at
                     f_u and g_u (recomputing never costs less than keeping)
    a_u              bytes saved for backward by one micro-batch
    big_u            bytes of the unit's largest parameter (a range-max table over units)
    w_u              parameter bytes (a shared parameter counted on its first user, the owner)
    x_k, msgs_k      bytes and tensors live before unit k (x_0 the model's inputs, x_n = 0)

(fc_u defaults to f_u and r_u to f_u + g_u in profiles that lack them), and keeps their prefix
sums with a leading zero, P_v[k] = sum_{u<k} v_u, so that the sum of v over a stage of units
l..r is P_v[r + 1] - P_v[l], one subtraction for any stage:

    Pf, Pg, Pa, Pw    of f, g, a, w
    Pfc, Pr           of fc - c_F and r - c_B (a recomputing stage adds c_F and c_B once)

A parameter used by several units is kept as (bytes, ascending user units): a stage that holds
a user but not the owner holds a copy (:meth:`UnitCosts.shared_bytes`, :func:`holds_user`).
The loss's forward, backward and saved bytes at b, and the model's output bytes y (the last
unit's), are charged to the last stage.  The formulas
that read these tables are in :mod:`pipeplan.planner.costmodel`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields
from typing import Any, TypeVar, cast

import numpy as np

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import PlanOptions, Profile

__all__ = [
    "ProfileTables",
    "UnitCosts",
    "holds_user",
    "microbatch_choices",
    "tables",
    "unit_costs",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class UnitCosts:
    """Per-unit arrays for one micro-batch count m (size b = B / m), plus prefix sums.

    ``x[k]`` is the bytes live before unit k for one micro-batch (``x[0]`` = model inputs,
    ``x[n] = 0``); ``msgs[k]`` the number of tensors crossing there.  ``P*`` arrays are prefix
    sums with a leading zero: sum over units l..r of f is ``Pf[r + 1] - Pf[l]``.
    """

    m: int
    b: int
    f: np.ndarray
    g: np.ndarray
    a: np.ndarray
    w: np.ndarray
    x: np.ndarray
    msgs: np.ndarray
    Pf: np.ndarray
    Pg: np.ndarray
    Pa: np.ndarray
    Pw: np.ndarray
    Pr: np.ndarray
    """Prefix sums of r_u - c_B: the backward under checkpointing (recompute included), less
    the checkpoint call's own cost."""
    Pfc: np.ndarray
    """Prefix sums of fc_u - c_F: the forward under checkpointing, less the call's own cost."""
    call_f: float = 0.0
    call_b: float = 0.0
    """c_F, c_B: one checkpoint call's own forward and backward seconds (once per recomputing
    stage)."""
    shared: tuple[tuple[int, np.ndarray], ...] = ()
    """(bytes, ascending user units) of every parameter used by several units."""
    loss_f: float = 0.0
    loss_g: float = 0.0
    """Forward and backward seconds of the loss on one micro-batch (last stage only)."""
    loss_a: float = 0.0
    """Bytes the loss saves for backward per micro-batch (kept for every one in flight)."""
    out: float = 0.0
    """y: bytes of the model's output (the last unit's) per micro-batch."""
    big: np.ndarray | None = None
    """Sparse table of the units' largest parameters: ``big[i][u]`` is the largest over units
    u .. u + 2^i - 1 (:meth:`largest_param`)."""
    gloo: bool = False
    """The profile was measured on a CPU, whose ranks communicate over gloo (a sharded
    stage's reduce-scatter holds one more full-size buffer there:
    :func:`pipeplan.planner.costmodel.memory_parts`)."""

    def largest_param(self, l: np.ndarray | int, r: np.ndarray | int) -> np.ndarray:
        """Bytes of the largest parameter units l..r use (arrays broadcast; 0 where l > r)."""
        l_arr, r_arr = np.asarray(l), np.asarray(r)
        if self.big is None:
            return np.zeros(np.broadcast(l_arr, r_arr).shape)
        span = np.maximum(r_arr - l_arr + 1, 1)
        level = np.floor(np.log2(span)).astype(np.int64)
        lo = np.clip(l_arr, 0, self.n - 1)
        hi = np.clip(r_arr - (1 << level) + 1, 0, self.n - 1)
        out = np.maximum(self.big[level, lo], self.big[level, hi])
        return np.where(r_arr >= l_arr, out, 0.0)

    @property
    def n(self) -> int:
        return len(self.f)

    def compute_prefix(self, recompute: bool) -> np.ndarray:
        """Prefix sums of a unit's forward + backward on a stage that does or does not
        recompute (the checkpoint call's own cost left out)."""
        return self.Pfc + self.Pr if recompute else self.Pf + self.Pg

    def shared_bytes(self, l: np.ndarray | int, r: np.ndarray | int) -> np.ndarray:
        """Bytes of shared parameters a stage l..r holds but does not own (broadcasts).

        A stage holds a copy of a shared parameter when it contains one of its users; the
        bytes are already in ``w`` of the owner (the first user).
        """
        l_arr, r_arr = np.asarray(l), np.asarray(r)
        out = np.zeros(np.broadcast(l_arr, r_arr).shape)
        for nbytes, users in self.shared:
            owns = (l_arr <= users[0]) & (users[0] <= r_arr)
            out = out + nbytes * (holds_user(users, l_arr, r_arr) & ~owns)
        return out


def holds_user(users: np.ndarray, l: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Whether stages l..r contain one of ``users`` (ascending unit indices), elementwise."""
    first = np.searchsorted(users, l, side="left")  # first user >= l
    return (first < len(users)) & (users[np.minimum(first, len(users) - 1)] <= r)


class ProfileTables:
    """Every table derived from one profile, each built once and then read by everyone: the
    unit-cost tables per micro-batch count (:func:`unit_costs`) and whatever else a caller
    memoizes under a key (the optimizer's update fit, :func:`pipeplan.planner.updates.update_cost`).

    A profile is immutable, so its tables are too (their arrays are read-only).  The request
    check, the bounds, the CP-SAT scaling, the DP, CP-SAT, the baselines and :func:`evaluate
    <pipeplan.planner.evaluate.evaluate>` of one solve, and every solve of the same profile
    (the depths of ``plan --devices``, a sweep over m), read the same tables.
    """

    def __init__(self) -> None:
        self._costs: dict[int, UnitCosts] = {}
        self._memo: dict[Hashable, Any] = {}
        self.builds = 0
        """How many unit-cost tables were built (the tests count them)."""

    def costs(self, profile: Profile, m: int) -> UnitCosts:
        table = self._costs.get(m)
        if table is None:
            table = self._costs[m] = _build_unit_costs(profile, m)
            self.builds += 1
        return table

    def memo(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()`` the first time ``key`` is asked for, the same value afterwards."""
        if key not in self._memo:
            self._memo[key] = build()
        return cast(T, self._memo[key])


_TABLES: dict[int, tuple[weakref.ref[Profile], ProfileTables]] = {}


def tables(profile: Profile) -> ProfileTables:
    """The tables of ``profile`` (this very object; they go when it does)."""
    key = id(profile)
    entry = _TABLES.get(key)
    if entry is None or entry[0]() is not profile:
        entry = (weakref.ref(profile, lambda _: _TABLES.pop(key, None)), ProfileTables())
        _TABLES[key] = entry
    return entry[1]


def unit_costs(profile: Profile, m: int) -> UnitCosts:
    """Arrays of f, g, a, w, x for ``m`` micro-batches (b = B / m must be a profiled size),
    built once per profile and m (:class:`ProfileTables`)."""
    return tables(profile).costs(profile, m)


def _build_unit_costs(profile: Profile, m: int) -> UnitCosts:
    if m <= 0 or profile.batch_size % m:
        raise InvalidRequestError(
            f"micro-batch count {m} does not divide batch size {profile.batch_size}; "
            f"choose one of {sorted(microbatch_choices(profile, PlanOptions()))}"
        )
    b = profile.batch_size // m
    if b not in profile.microbatch_sizes:
        raise InvalidRequestError(
            f"micro-batch count {m} needs micro-batch size {b}, which was not profiled "
            f"(profiled: {list(profile.microbatch_sizes)}); re-profile with --microbatch-sizes"
        )
    f = np.array([u.timings[b].forward_s for u in profile.units], dtype=np.float64)
    g = np.array([u.timings[b].backward_s for u in profile.units], dtype=np.float64)
    timings = [u.timings[b] for u in profile.units]
    call_f, call_b = profile.checkpoint_call_s
    rb = [t.forward_s + t.backward_s if t.recompute_backward_s is None else t.recompute_backward_s
          for t in timings]  # fmt: skip
    rf = [t.forward_s if t.recompute_forward_s is None else t.recompute_forward_s for t in timings]
    # A unit that recomputes runs its forward again and keeps nothing: it is never charged less
    # than keeping its activations, though the measured checkpointed times can come out lower
    # by noise.  So keeping dominates recomputing in time, and a stage keeps whenever that fits
    # (the ``auto`` policy, pipeplan.planner.costmodel.stage_recomputes).
    r = np.maximum(np.array(rb, dtype=np.float64) - call_b, g)
    fc = np.maximum(np.array(rf, dtype=np.float64) - call_f, f)
    a = np.array([u.timings[b].saved_bytes for u in profile.units], dtype=np.float64)
    w = np.array([u.param_bytes for u in profile.units], dtype=np.float64)
    x = np.zeros(len(f) + 1)
    msgs = np.zeros(len(f) + 1)
    x[0] = profile.input_bytes_per_sample * b
    msgs[0] = 1
    for cut in profile.cuts:
        x[cut.after + 1] = cut.bytes_per_sample * b
        msgs[cut.after + 1] = len(cut.tensors)

    def prefix(v: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(v)])

    shared = tuple((sp.bytes, np.array(sp.units, dtype=np.int64)) for sp in profile.shared_params)
    loss = profile.loss.get(b)
    out = UnitCosts(
        m,
        b,
        f,
        g,
        a,
        w,
        x,
        msgs,
        prefix(f),
        prefix(g),
        prefix(a),
        prefix(w),
        prefix(r),
        prefix(fc),
        call_f,
        call_b,
        shared,
        loss_f=loss.forward_s if loss else 0.0,
        loss_g=loss.backward_s if loss else 0.0,
        loss_a=float(loss.saved_bytes) if loss else 0.0,
        out=float(timings[-1].output_bytes),
        big=_sparse_max(np.array([u.largest_param_bytes for u in profile.units], dtype=np.float64)),
        gloo=profile.device.kind == "cpu",
    )
    for value in (*(getattr(out, f.name) for f in fields(out)), *(u for _, u in shared)):
        if isinstance(value, np.ndarray):
            value.flags.writeable = False  # shared by every reader: nobody writes in place
    return out


def _sparse_max(v: np.ndarray) -> np.ndarray:
    """Rows i = 0..floor(log2 n): row i holds the max of v over u .. u + 2^i - 1 (clipped)."""
    rows = [v]
    width = 1
    while 2 * width <= len(v):
        prev = rows[-1]
        shifted = np.concatenate([prev[width:], np.full(width, -np.inf)])
        rows.append(np.maximum(prev, shifted))
        width *= 2
    return np.vstack(rows)


def microbatch_choices(
    profile: Profile, options: PlanOptions, stages: int | None = None
) -> list[int]:
    """Micro-batch counts m to consider: the user's, or every m whose size B/m was profiled;
    for 1F1B on ``stages`` ranks only m >= stages, as torch's ``Schedule1F1B`` requires
    (:class:`~pipeplan.planner.errors.InvalidRequestError` when none is left)."""
    if options.microbatches is not None:
        ms = [options.microbatches]
    else:
        ms = sorted({profile.batch_size // b for b in profile.microbatch_sizes})
    if options.schedule != "1f1b" or stages is None:
        return ms
    kept = [m for m in ms if m >= stages]
    if not kept:
        raise InvalidRequestError(
            f"1F1B needs at least as many micro-batches as stages (m = {max(ms)} < {stages}); "
            f"plan --microbatches {stages} (a profiled size B/{stages}), or --schedule gpipe"
        )
    return kept
