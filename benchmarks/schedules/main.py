"""Schedule benchmark: the best plan of each of torch's schedule families over the best 1F1B plan.

    PYTHONPATH=. .venv/bin/python -m benchmarks.schedules.main [-o benchmarks/schedules/results.json]

For each profile and p in 4, 8, 16 (where the profile has units for p chunks), each family is
planned with ``pipeplan.solvers.multichunk.solve_schedule`` (family fixed; v, cuts, m and
per-chunk recompute chosen under the memory limit), and its replayed step time is divided by
the best 1F1B plan's (the same solver, ``--schedule 1f1b``).  Beside it, torchtitan's own
split under the same schedule, v and m: the p v chunks take equal numbers of units, the
embedding and the head counting as one layer each (torchtitan's
``generate_llm_fqn_per_model_part`` with input and output weight 1), recomputing only where
memory demands it.  The planning time of ``--schedule auto`` is measured on each profile.

Profiles (all in out/, made by the commands in README.md):
  gpt        the bundled GPT, batch 32, I and W measured, 256 MiB per device;
  zoo-llama, zoo-bert, zoo-t5   pipeplan.models.zoo models (8 layers, d_model 64, seq 32),
             batch 16, micro-batch 1, 2, 4, I and W measured; 9, 5 and 24 MiB per device
             (about 1.5 times the unlimited 1F1B peak at p = 4: 6, 3 and 18 MiB);
  llama7b    benchmarks/profile_units/config.json, ``--method units``, batch 16, micro-batch 1
             (m = 16), seq 128, 34 units, I and W measured, 80 GiB per device;
  synth      ``synthetic_profile(48, heavy_ends=True)`` with I = 0.4 B, W = 0.6 B (modelled),
             unlimited memory.
Last, ``auto``'s planning time on the 7B profile's refined units (``--max-stages 64``) at p = 8.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine
from pipeplan.export.snap import target_cuts
from pipeplan.planner.errors import PipeplanError
from pipeplan.planner.families import FAMILIES
from pipeplan.planner.io import load_profile
from pipeplan.planner.types import Cluster, Link, Plan, PlanOptions, Profile, Timing
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.baselines import uniform_partition
from pipeplan.solvers.chunks import ChunkPlan
from pipeplan.solvers.fit import recompute_to_fit
from pipeplan.solvers.multichunk import solve_schedule
from pipeplan.solvers.request import ResolvedRequest

HERE = Path(__file__).parent
LINK = Link(bandwidth_Bps=1e10, latency_s=1e-5)


def with_split(profile: Profile, input_share: float) -> Profile:
    """The profile with I = input_share B and W = (1 - input_share) B where not measured."""
    units = []
    for u in profile.units:
        timings = {}
        for b, t in u.timings.items():
            if t.backward_input_s is None:
                t = Timing(**{**t.model_dump(), "backward_input_s": input_share * t.backward_s,
                              "backward_weight_s": (1 - input_share) * t.backward_s})  # fmt: skip
            timings[b] = t
        units.append(u.model_copy(update={"timings": timings}))
    return profile.model_copy(update={"units": tuple(units)})


def profiles() -> dict[str, tuple[Profile, int, str]]:
    synth = synthetic_profile(48, batch_size=64, microbatch_sizes=[1, 2, 4, 8], heavy_ends=True,
                              seed=7, loss=True)  # fmt: skip
    out = HERE / "out"
    return {
        "gpt": (load_profile(out / "gpt.profile.json"), 256 * 2**20, "measured"),
        "zoo-llama": (load_profile(out / "zoo-llama.profile.json"), 9 * 2**20, "measured"),
        "zoo-bert": (load_profile(out / "zoo-bert.profile.json"), 5 * 2**20, "measured"),
        "zoo-t5": (load_profile(out / "zoo-t5.profile.json"), 24 * 2**20, "measured"),
        "llama7b": (load_profile(out / "llama7b-ms8.profile.json"), 80 * 2**30, "measured"),
        "synth": (with_split(synth, 0.4), 2**40, "modelled I = 0.4 B"),
    }


def refined_timing() -> dict[str, Any]:
    """``--schedule auto`` on the 7B profile's refined units (``--max-stages 64``) at p = 8."""
    prof = load_profile(HERE / "out/llama7b-ms64.profile.json")
    cluster = Cluster.homogeneous(8, 80 * 2**30, LINK)
    t0 = time.perf_counter()
    auto = solve_schedule(prof, cluster, PlanOptions(schedule="auto"))
    auto_s = time.perf_counter() - t0
    one = solve_schedule(prof, cluster, PlanOptions(schedule="1f1b"))
    row = {"profile": "llama7b refined", "units": prof.n_units, "p": 8,
           "auto_family": auto.schedule, "v": auto.stages_per_rank, "m": auto.microbatches,
           "auto_ratio_1f1b": auto.step_time_s / one.step_time_s, "auto_plan_s": auto_s,
           "status": auto.status, "gap": auto.gap}  # fmt: skip
    print(json.dumps(row))
    return row


def torchtitan_starts(profile: Profile, k: int) -> list[int] | None:
    """torchtitan's default split into k model parts: equal numbers of layers per part, the
    embedding and the head one layer each (``generate_llm_fqn_per_model_part`` with input and
    output weight 1).  Where a unit is a layer, the embedding or the head (the 7B profile) that
    is equal numbers of units; where the units are finer (zoo-llama), equal numbers of the runs
    of units between the cuts torchtitan can make (:func:`pipeplan.export.snap.target_cuts`,
    a layer each).  A model torchtitan cannot name (bert, t5) takes equal numbers of units.
    ``None`` where there are fewer layers than parts."""
    n = profile.n_units
    try:
        cuts = [0, *target_cuts([u.name for u in profile.units], "torchtitan")]
    except PipeplanError:
        cuts = list(range(n))
    if max(b - a for a, b in zip(cuts, [*cuts[1:], n], strict=True)) <= 2:
        cuts = list(range(n))  # one unit per layer (the first and last glued to the ends)
    if k > len(cuts):
        return None
    return [cuts[i] for i in uniform_partition(len(cuts), k)]


def torchtitan_split(profile: Profile, cluster: Cluster, plan: Plan) -> float | None:
    """The step of torchtitan's split under the plan's family, v and m."""
    k = cluster.n_stages * plan.stages_per_rank
    starts = torchtitan_starts(profile, k)
    if starts is None:
        return None
    request = ResolvedRequest(profile, cluster, PlanOptions(schedule=plan.schedule))
    cp = ChunkPlan(request, plan.schedule, plan.stages_per_rank, plan.microbatches)
    rep = cp.replay(starts, recompute_to_fit(cp, starts))
    return rep.makespan_s if cp.fits(rep) else None


def run(out: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, (prof, memory, split) in profiles().items():
        for p in (4, 8, 16):
            if p > prof.n_units:
                continue
            cluster = Cluster.homogeneous(p, memory, LINK)
            best: dict[str, Plan] = {}
            took: dict[str, float] = {}
            for fam in FAMILIES:
                try:
                    t0 = time.perf_counter()
                    best[fam] = solve_schedule(prof, cluster, PlanOptions(schedule=fam))  # type: ignore[arg-type]
                    took[fam] = time.perf_counter() - t0
                except PipeplanError as exc:
                    print(f"{name} p={p} {fam}: {exc}")
            solve_schedule(prof, cluster, PlanOptions(schedule="auto"))  # torch's orders built
            t0 = time.perf_counter()
            auto = solve_schedule(prof, cluster, PlanOptions(schedule="auto"))
            auto_s = time.perf_counter() - t0
            base = best["1f1b"].step_time_s if "1f1b" in best else None
            for fam, plan in best.items():
                tt = torchtitan_split(prof, cluster, plan)
                row = {
                    "profile": name, "split": split, "p": p, "family": fam,
                    "v": plan.stages_per_rank, "m": plan.microbatches,
                    "step_s": plan.step_time_s, "bubble": plan.bubble_fraction,
                    "status": plan.status, "gap": plan.gap, "plan_s": took[fam],
                    "ratio_1f1b": plan.step_time_s / base if base else None,
                    "torchtitan_ratio_1f1b": tt / base if tt and base else None,
                    "recomputing_chunks": sum(s.recompute for s in plan.stages),
                    "auto_family": auto.schedule, "auto_ratio_1f1b":
                    auto.step_time_s / base if base else None, "auto_plan_s": auto_s,
                }  # fmt: skip
                print(json.dumps(row))
                rows.append(row)
    refined = refined_timing()
    out.write_text(
        json.dumps({"machine": machine(), "rows": rows, "refined": refined}, indent=1) + "\n"
    )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| profile | p | family | v | m | step / best 1F1B | torchtitan split / best 1F1B | bubble | status (gap) | planning s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tt = f"{r['torchtitan_ratio_1f1b']:.3f}" if r["torchtitan_ratio_1f1b"] else "-"
        gap = f" ({100 * r['gap']:.2f} %)" if r["gap"] is not None else ""
        lines.append(
            f"| {r['profile']} | {r['p']} | {r['family']} | {r['v']} | {r['m']} | "
            f"{r['ratio_1f1b']:.3f} | {tt} | {r['bubble']:.3f} | {r['status']}{gap} | "
            f"{r['plan_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--output", default=str(HERE / "results.json"))
    rows = run(Path(ap.parse_args().output))
    print(table(rows))


if __name__ == "__main__":
    main()
