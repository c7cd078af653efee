"""``pipeplan show`` of a run report and of a cluster file: tables, not raw JSON."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from pipeplan.planner.io import write_json
from pipeplan.planner.types import (
    Cluster,
    Link,
    Plan,
    RankMeasurement,
    RunReport,
    StageMeasurement,
)
from pipeplan.report.summaries import cluster_tables, report_tables


def _text(parts: list) -> str:
    out = Console(width=100, record=True, file=io.StringIO())
    for part in parts:
        out.print(part)
    return out.export_text()


def _report(plan: Plan) -> RunReport:
    m = plan.microbatches
    stages = tuple(
        StageMeasurement(stage=s.index, rank=s.index, forward_s=(s.forward_s * 2,) * m,
                         backward_s=(s.backward_s,) * m, peak_memory_bytes=3 * 2**20)
        for s in plan.stages
    )  # fmt: skip
    events = tuple(
        {"name": f"F{i}", "kind": "forward", "stage": 0, "microbatch": i,
         "start_s": 0.01 * i, "end_s": 0.01 * i + 0.005}
        for i in range(m)
    )  # fmt: skip
    return RunReport(
        plan_fingerprint=plan.fingerprint,
        model=plan.model,
        backend="gloo",
        world_size=plan.n_stages,
        steps=3,
        warmup_steps=1,
        step_times_s=(0.2, 0.25, 0.3),
        step_time_s=0.25,
        predicted_step_time_s=0.2,
        stages=stages,
        ranks=tuple(RankMeasurement(rank=s.index, stages=(s.index,)) for s in plan.stages),
        losses=(2.5, 2.25, 2.0),
        events=events,
    )


def test_a_report_shows_its_stages_step_and_events(plans: list[Plan]) -> None:
    plan = plans[0]
    report = _report(plan)
    text = _text(report_tables(report, 0.4))
    s0 = plan.stages[0]
    row = next(line for line in text.splitlines() if line.split()[:2] == ["0", "0"])
    assert f"{s0.forward_s * 2e3:.3f}" in row and "3.00 MiB" in row
    assert "step time 250.000 ms measured (median of 3, 200.000-300.000), 200.000 ms " in text
    assert "(+25.0%)" in text and "bubble fraction 40.0%" in text
    assert "loss 2.5 at the first step, 2 at the last" in text
    assert f"events of the last step: {plan.microbatches} forward" in text
    assert "memory per rank" not in text  # one chunk per rank: the stage table says it


def test_a_cluster_shows_devices_links_engine_and_degrees() -> None:
    cluster = Cluster.homogeneous(4, 2**30, Link(bandwidth_Bps=1e10, latency_s=5e-6)).model_copy(
        update={
            "op_overhead_s": 2e-4,
            "contention": 0.25,
            "data_parallel": 2,
            "data_parallel_mode": "shard",
            "tensor_parallel": 2,
            "intra_node_link": Link(bandwidth_Bps=8e10),
            "collectives": {"all_reduce": (1e-10, 3e-5)},
        }
    )
    text = _text(cluster_tables(cluster))
    assert "4 devices" in text and "dev0..dev3" in text and "1.00 GiB" in text
    stages = next(line for line in text.splitlines() if "between stages" in line)
    assert "10 GB/s" in stages and "5 us" in stages
    assert "80 GB/s" in next(line for line in text.splitlines() if "inside a node" in line)
    assert "engine: 200.0 us per operation" in text and "contention 0.250" in text
    assert "all_reduce: 0.1 ns per byte + 30 us, measured on 2 ranks" in text
    assert "data parallel 2 (shard), tensor parallel 2" in text


def test_show_renders_a_report_and_a_cluster_and_checks_plan(
    plans: list[Plan], tmp_path: Path, cli
) -> None:
    plan = plans[0]
    files = {name: tmp_path / f"{name}.json" for name in ("report", "cluster", "plan", "other")}
    write_json(files["report"], _report(plan))
    write_json(files["cluster"], plan.cluster)
    write_json(files["plan"], plan)
    write_json(files["other"], plans[1])
    code, out, err = cli(["show", str(files["report"])])
    assert code == 0, err
    assert "measured (gloo" in out and "{" not in out  # tables, not raw JSON
    code, out, err = cli(["show", str(files["report"]), "--plan", str(files["plan"])])
    assert code == 0, err
    assert "measured vs predicted" in out
    code, _, err = cli(["show", str(files["report"]), "--plan", str(files["other"])])
    assert code == 2 and "is not the plan this report ran" in err
    code, _, err = cli(["show", str(files["plan"]), "--plan", str(files["plan"])])
    assert code == 2 and "--plan goes with a run report" in err
    code, out, err = cli(["show", str(files["cluster"])])
    assert code == 0 and "links" in out and "between stages" in out and "{" not in out
