"""The schedule solver's final gap: its candidates' bounds raised, after the search, by the
tighter bounds that cost too much to order or prune candidates by.

After :func:`pipeplan.solvers.multichunk.solve_schedule` has searched (and, with ``--prove``,
run the exact model), its plan's gap is (T - L) / T with L the least bound over its
candidates.  Only the least bound matters, so the candidates are raised lazily: the one with
the least bound that has not been raised yet is raised, until the least bound belongs to one
that has been (L is then final) or reaches T (every candidate is bounded at the plan's step:
``optimal``).  Raising a candidate (family, v, m) takes the largest of

* GPipe's and 1F1B's critical path through thresholds (:func:`~pipeplan.solvers.path_bound.
  one_chunk_bound` with ``levels``);
* the Lagrangian chain bound of every family (:func:`~pipeplan.solvers.chain_bound.
  chain_bound`), which sees memory chunk by chunk;
* the same chains as an integer programme (:func:`~pipeplan.solvers.chain_model.
  chain_model_bound`), which sees that whole units do not divide evenly among ranks, under a
  deterministic-time budget shared by the request's candidates (a count of CP-SAT's work,
  not a clock: the same request gets the same gap on any machine).

None of them orders or prunes a candidate of the search (pruning by the threshold programme
moved ``auto``'s budget and made a plan 0.17 % slower), so every plan is the one the search
finds; only its status and gap change.
"""

from __future__ import annotations

import numpy as np

from pipeplan.planner.types import Cluster, PlanOptions, Profile
from pipeplan.solvers.chain_bound import chain_bound
from pipeplan.solvers.chain_model import chain_model_bound
from pipeplan.solvers.exact_plan import Candidate
from pipeplan.solvers.path_bound import LEVELS, ONE_CHUNK_FAMILIES, one_chunk_bound

__all__ = ["CHAIN_WORK", "MODEL_TIME", "raise_bounds"]

#: The chain bounds' dynamic programmes of one request, in span-term products (a count; about
#: 1.5 s on the benchmarks' 2-core host), times ``effort``.
CHAIN_WORK = 2e8

#: CP-SAT's deterministic time for the chain models of one request (``--prove T`` adds T a
#: candidate).
MODEL_TIME = 1.0


def raise_bounds(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    bound_of: dict[Candidate, float],
    plans: dict[Candidate, tuple[list[int], list[bool]] | None],
    step: float,
    *,
    effort: float = 1.0,
    model_time: float = MODEL_TIME,
) -> dict[Candidate, float]:
    """``bound_of`` with the candidates of ``plans`` (each with its search's best chunk starts
    and recompute flags, whose longest path seeds the chains, or ``None``) raised lazily (module docstring)
    against the plan's ``step``, within :data:`CHAIN_WORK` times ``effort`` and
    ``model_time`` of CP-SAT's deterministic time; the others as they are."""
    bounds = dict(bound_of)
    raised: set[Candidate] = set()
    work, budget = CHAIN_WORK * effort, model_time
    rows: dict[Candidate, np.ndarray] = {}
    while plans:
        c = min(plans, key=bounds.__getitem__)
        if c in raised or bounds[c] >= step or work <= 0:
            break
        raised.add(c)
        family, v, m = c
        if v == 1 and family in ONE_CHUNK_FAMILIES:
            tight = one_chunk_bound(profile, cluster, options, family, m, levels=LEVELS)
            bounds[c] = max(bounds[c], tight)
        if bounds[c] >= step:
            continue
        seed = plans[c]
        chains = chain_bound(
            profile, cluster, options, *c, target=step, work=work, plans=[seed] if seed else []
        )
        work -= chains.work
        rows[c] = chains.rows
        bounds[c] = max(bounds[c], chains.bound)
    # the integer programme, in turn, for the candidate the chains leave least
    while budget > 0 and plans:
        c = min(plans, key=bounds.__getitem__)
        if c not in rows or bounds[c] >= step:
            break
        model = chain_model_bound(
            profile, cluster, options, *c, target=step, rows=list(rows.pop(c)),
            deterministic_time=budget,
        )  # fmt: skip
        budget -= model.time
        bounds[c] = max(bounds[c], model.bound)
    return bounds
