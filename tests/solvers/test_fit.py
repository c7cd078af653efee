"""The fits of recompute flags (pipeplan.solvers.fit) against every mask."""

from __future__ import annotations

from itertools import combinations, product

import pytest
from _solver_strategies import with_split

from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.chunks import ChunkPlan, score
from pipeplan.solvers.fit import fits, recompute_to_fit
from pipeplan.solvers.request import ResolvedRequest


@pytest.mark.parametrize("family", ["loopedbfs", "interleaved1f1b", "zbv"])
def test_recompute_to_fit_takes_each_ranks_least_costly_fitting_set(family: str) -> None:
    """Against every mask of every partition: a rank that fits keeps everything; one over its
    memory recomputes, of the sets of its chunks that fit it, one that adds the least busy time
    to it (a rank's peak and work move with its own chunks' flags only), or all of them where
    none fits."""
    profile = with_split(
        synthetic_profile(10, batch_size=8, microbatch_sizes=[2], seed=5, spread=0.9)
    )
    p, v, m, k = 2, 2, 4, 4
    options = PlanOptions(schedule=family)  # type: ignore[arg-type]
    free = Cluster.homogeneous(p, 10**12)
    owner = ChunkPlan(ResolvedRequest(profile, free, options), family, v, m).owner
    fitted = 0
    for cuts in combinations(range(1, 10), k - 1):
        starts = [0, *cuts]
        reps = {rc: score(profile, free, options, family, v, m, starts, rc)
                for rc in product((False, True), repeat=k)}  # fmt: skip
        limit = int(max(reps[(False,) * k].peak_bytes) * 0.85)
        cp = ChunkPlan(
            ResolvedRequest(profile, Cluster.homogeneous(p, limit), options), family, v, m
        )
        got = tuple(recompute_to_fit(cp, starts))
        both, largest = fits(cp, starts), fits(cp, starts, least=False)
        assert both[0][0] == list(got) and both[-1][0] == largest[0][0] and len(largest) == 1
        for q in range(p):
            mine = [s for s in range(k) if owner[s] == q]
            ours = [rc for rc in reps if all(rc[s] == got[s] for s in range(k) if s not in mine)]
            fitting = [rc for rc in ours if reps[rc].peak_bytes[q] <= limit]
            if reps[(False,) * k].peak_bytes[q] <= limit:
                assert not any(got[s] for s in mine)
                continue
            if not fitting:
                assert all(got[s] for s in mine)
                continue
            fitted += 1
            assert got in fitting
            assert reps[got].busy[q] <= min(reps[rc].busy[q] for rc in fitting) * (1 + 1e-12)
    assert fitted >= 10
