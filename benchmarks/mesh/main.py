"""Mesh benchmark: pp x dp for N devices, with FSDP-sharded against replicated data parallelism.

    PYTHONPATH=. .venv/bin/python -m benchmarks.mesh.main [-o benchmarks/mesh/results.json]

For each profile and N in 64 and 512 devices of 80 GiB, at a global batch of 1024 samples,
``pipeplan.plan(devices=N, global_batch_size=1024, data_parallel=MODE)`` plans every depth p
dividing N with d = N / p data-parallel ranks, every schedule family under ``auto``, for
MODE ``replicate`` and ``shard`` separately (the best of each), then ``auto`` (both, as
``pipeplan plan --devices N`` does by default), whose wall time is the planning time.

Profiles:
  llama7b    benchmarks/schedules/out/llama7b-ms8.profile.json: benchmarks/profile_units'
             7B config, ``--method units``, micro-batch 1, seq 128, 34 units;
  llama70b   benchmarks/mesh/llama70b.json (80 layers, hidden 8192, 8 KV heads, vocab 32000),
             ``--method units --max-stages 64``, micro-batch 1 and 2, seq 128 (out/, made by
             the command in README.md).
Both were timed on this CPU host; the plans compare as ratios, the absolute times are CPU's.
Links: 10 GB/s and 10 us between stages and between replicas (no calibration); Adam.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import pipeplan
from benchmarks.common import machine
from pipeplan.planner.io import load_profile
from pipeplan.planner.types import Plan

HERE = Path(__file__).parent
PROFILES = {
    "llama7b": HERE.parent / "schedules/out/llama7b-ms8.profile.json",
    "llama70b": HERE / "out/llama70b.profile.json",
}
DEVICES = (64, 512)
GLOBAL_BATCH = 1024
MEMORY = "80GiB"
LINK = {"bandwidth": "10GB/s", "latency": "10us"}


def _row(name: str, devices: int, mode: str, plan: Plan, seconds: float | None) -> dict[str, Any]:
    return {
        "profile": name,
        "devices": devices,
        "mode": mode,
        "chosen_mode": plan.cluster.data_parallel_mode,
        "pp": plan.pipeline_ranks,
        "dp": plan.cluster.data_parallel,
        "family": plan.schedule,
        "v": plan.stages_per_rank,
        "m": plan.microbatches,
        "step_s": plan.simulated_step_time_s or plan.step_time_s,
        "bubble": plan.bubble_fraction,
        "peak_gib": max([*plan.rank_peak_bytes, *(s.memory.total for s in plan.stages)]) / 2**30,
        "samples_s": plan.throughput * plan.cluster.data_parallel,
        "status": plan.status,
        "planning_s": seconds,
    }


def bench(names: list[str], devices: list[int]) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        prof = load_profile(PROFILES[name])
        for n in devices:
            for mode in ("replicate", "shard", "auto"):
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    plan = pipeplan.plan(
                        prof,
                        devices=n,
                        memory=MEMORY,
                        global_batch_size=GLOBAL_BATCH,
                        data_parallel=mode,
                        calibrated=False,
                        **LINK,
                    )
                except pipeplan.PipeplanError as exc:
                    rows.append({"profile": name, "devices": n, "mode": mode, "error": str(exc)})
                    print(name, n, mode, "no plan:", str(exc)[:200], flush=True)
                    continue
                seconds = time.perf_counter() - t0
                cpu = time.process_time() - c0
                rows.append(_row(name, n, mode, plan, seconds if mode == "auto" else None))
                rows[-1]["planning_cpu_s"] = cpu if mode == "auto" else None
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", nargs="*", default=list(PROFILES), choices=list(PROFILES))
    ap.add_argument("--devices", nargs="*", type=int, default=list(DEVICES))
    ap.add_argument("-o", "--output", default=str(HERE / "results.json"))
    args = ap.parse_args(argv)
    rows = bench(args.profiles, args.devices)
    Path(args.output).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
