"""A request resolved once per solve: (Profile, Cluster, PlanOptions) and the tables every
solver reads before it searches.

The DP, CP-SAT, its time scale and the baselines (:mod:`pipeplan.solvers`) each began with the
same lines: check the request, list the micro-batch counts m to try, fit the optimizer's update
cost U(w), the training state per parameter byte, read the devices' memories and where a stage
may start.  :func:`resolve_request` does that once and the solver starts from the
:class:`ResolvedRequest` it returns (the DP builds one table per m from it, CP-SAT its time scale
and its models).  The multi-chunk solver, whose families :func:`check_request
<pipeplan.planner.evaluate.check_request>` does not plan, makes one ``ResolvedRequest(profile,
cluster, options)`` per solve and each candidate's chunk costs
(:class:`pipeplan.solvers.chunks.ChunkPlan`) read it.

Each table is built the first time it is read, then kept: a solver that never reads one (a
baseline given m never lists the choices) neither pays for it nor meets its error.

>>> from pipeplan.profiler.synthetic import synthetic_profile
>>> prof = synthetic_profile(4, batch_size=8, microbatch_sizes=[2, 4])
>>> req = resolve_request(prof, Cluster.homogeneous(2, 2**30), PlanOptions())
>>> req.microbatches, req.allowed.tolist(), req.caps.tolist()
([2, 4], [True, True, True, True, True], [1073741824.0, 1073741824.0])
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pipeplan.planner.collectives import StateFactors, state_factors
from pipeplan.planner.evaluate import allowed_starts, check_request
from pipeplan.planner.types import Cluster, PlanOptions, Profile
from pipeplan.planner.unitcosts import microbatch_choices
from pipeplan.planner.updates import UpdateCost, update_cost

__all__ = ["ResolvedRequest", "resolve_request"]


@dataclass(frozen=True)
class ResolvedRequest:
    """One request and its derived tables, each built on first use and then the same object."""

    profile: Profile
    cluster: Cluster
    options: PlanOptions

    @cached_property
    def microbatches(self) -> list[int]:
        """The micro-batch counts m to try (:func:`pipeplan.planner.unitcosts.microbatch_choices`
        on this cluster's stages: 1F1B keeps m >= p)."""
        return microbatch_choices(self.profile, self.options, self.cluster.n_stages)

    @cached_property
    def update(self) -> UpdateCost:
        """U(w) of one step of the request's optimizer on this cluster
        (:func:`pipeplan.planner.updates.update_cost`)."""
        return update_cost(self.profile, self.options.optimizer, self.cluster)

    @cached_property
    def state(self) -> StateFactors:
        """The training state a rank holds per parameter byte of its stage
        (:func:`pipeplan.planner.collectives.state_factors`)."""
        return state_factors(self.options.optimizer, self.cluster)

    @cached_property
    def allowed(self) -> np.ndarray:
        """``allowed[b]``, b = 0..n: a stage may start at unit b
        (:func:`pipeplan.planner.evaluate.allowed_starts`)."""
        allowed = allowed_starts(self.options, self.profile.n_units)
        allowed.flags.writeable = False  # shared by every table of the solve
        return allowed

    @cached_property
    def caps(self) -> np.ndarray:
        """Each stage's device memory in bytes (float64)."""
        caps = np.array([d.memory_bytes for d in self.cluster.devices], dtype=np.float64)
        caps.flags.writeable = False
        return caps


def resolve_request(profile: Profile, cluster: Cluster, options: PlanOptions) -> ResolvedRequest:
    """The request checked (:func:`pipeplan.planner.evaluate.check_request`: the numbers and the
    fix of what no partition can satisfy) and ready for a solver."""
    check_request(profile, cluster, options)
    return ResolvedRequest(profile, cluster, options)
