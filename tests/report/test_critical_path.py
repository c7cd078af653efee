"""``pipeplan show PLAN --critical-path`` and ``--timeline``: the chain that sets the step, for
every family torch ships, checked against the replay it is read from."""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path

import pytest

from pipeplan.planner.families import FAMILIES
from pipeplan.planner.io import write_json
from pipeplan.planner.replay import replay_plan
from pipeplan.planner.types import Cluster, Link, Plan, PlanOptions, Profile
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.report.critical_path import critical_path, rank_lines
from pipeplan.solvers.multichunk import solve_schedule


@cache
def _profile(tied: bool = False) -> Profile:
    """A synthetic profile whose backward is split into I and W (0.4 / 0.6), with Adam's
    update, so every family runs and every rank updates."""
    prof = synthetic_profile(8, batch_size=8, seed=4, tied=tied, update_s_per_byte=1e-11)
    units = tuple(
        u.model_copy(update={"timings": {
            b: t.model_copy(update={"backward_input_s": 0.4 * t.backward_s,
                                    "backward_weight_s": 0.6 * t.backward_s})
            for b, t in u.timings.items()}})
        for u in prof.units
    )  # fmt: skip
    return prof.model_copy(update={"units": units})


def _plan(family: str, tied: bool = False, microbatches: int | None = None) -> Plan:
    cluster = Cluster.homogeneous(2, 2**30, link=Link(bandwidth_Bps=1e9, latency_s=1e-4))
    options = PlanOptions(schedule=family, microbatches=microbatches)
    return solve_schedule(_profile(tied), cluster, options)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_chain_is_contiguous_and_spans_the_step(family: str) -> None:
    plan = _plan(family, microbatches=4)
    path = critical_path(plan)
    steps = path.steps
    assert steps and path.step_s == pytest.approx(replay_plan(plan).makespan_s)
    assert steps[0].start_s == pytest.approx(plan.cluster.step_overhead_s, abs=1e-12)
    assert steps[-1].end_s == pytest.approx(path.step_s, rel=1e-12)
    for before, after in itertools.pairwise(steps):
        assert after.start_s == pytest.approx(before.end_s, rel=1e-9, abs=1e-15)
    assert sum(s.seconds for s in steps) == pytest.approx(path.step_s, rel=1e-9)
    assert steps[-1].action == "update"  # every rank updates: the last update ends the step
    kinds = {s.action for s in steps if s.stage is not None}
    assert kinds <= ({"F", "B", "I", "W"} if FAMILIES[family].split_backward else {"F", "B"})


def test_gpipe_is_paced_by_its_slowest_stage() -> None:
    """GPipe's step is sum_s t_s + (m - 1) max_s t_s: the slowest stage is on the chain m
    times, and sets the pace."""
    plan = _plan("gpipe", microbatches=4)
    slowest = max(plan.stages, key=lambda s: s.forward_s + s.backward_s).index
    path = critical_path(plan)
    assert path.pace_stage == slowest
    assert sum(s.stage == slowest and s.action == "F" for s in path.steps) == 4


def test_a_tied_all_reduce_on_the_chain_is_named() -> None:
    """1F1B over 2 ranks with the first and last units tied: rank 0 and rank 1 sum the tied
    gradient after their last backward; the chain goes through the sum of the rank that
    arrived last."""
    plan = _plan("1f1b", tied=True, microbatches=4)
    assert plan.tied_syncs and plan.tied_syncs[0].seconds > 0
    path = critical_path(plan)
    (tied,) = [s for s in path.steps if s.action == "tied"]
    assert tied.seconds == pytest.approx(plan.tied_syncs[0].seconds)
    i = path.steps.index(tied)
    assert path.steps[i - 1].rank == tied.rank and path.steps[i - 1].stage is not None


def test_rank_lines_are_torchs_order() -> None:
    assert rank_lines(_plan("gpipe", microbatches=2)) == [
        "rank 0: F0 F1 B0 B1",
        "rank 1: F0 F1 B0 B1",
    ]
    zbv = rank_lines(_plan("zbv", microbatches=2))
    assert zbv[0].startswith("rank 0: F0.0 F1.0 F0.3 I0.3 W0.3")  # chunks 0 and 3 on rank 0
    assert all(w[0] in "FIW" for line in zbv for w in line.split(": ")[1].split())


def test_show_prints_the_chain_and_the_timeline(tmp_path: Path, cli) -> None:
    plan_file, profile_file = tmp_path / "plan.json", tmp_path / "profile.json"
    write_json(plan_file, _plan("zbv", microbatches=4))
    write_json(profile_file, _profile())
    code, out, _ = cli(["show", str(plan_file), "--critical-path", "--timeline"])
    assert code == 0
    assert "critical path:" in out and "sets the pace" in out and "update" in out
    assert "rank 0: F0.0" in out and "rank 1: F0.1" in out
    code, out, err = cli(["show", str(profile_file), "--critical-path"])
    assert code == 2 and "--critical-path goes with a plan" in err
    assert len(err.strip().splitlines()) == 1
