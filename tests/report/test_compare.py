"""`compare_frame`, every output format, and `pipeplan plan --solver ...` / `pipeplan compare`."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from _cli_argv import cli_argv

from pipeplan.cli import main
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.io import format_bytes, load_plan, write_json
from pipeplan.planner.types import Cluster, Plan, PlanOptions
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.report.compare import FORMATS, compare_frame, render, to_markdown
from pipeplan.solvers import SOLVERS

SOLVER_NAMES = ("dp", "cpsat", "uniform", "params", "torchgpipe")


@pytest.fixture(scope="module")
def plans() -> list[Plan]:
    prof = synthetic_profile(16, batch_size=16, heavy_ends=True, seed=2)
    clus = Cluster.homogeneous(4, 2**40)
    return [SOLVERS[name](prof, clus, PlanOptions()) for name in SOLVER_NAMES]


def test_frame_rows_and_ratios(plans: list[Plan]) -> None:
    df = compare_frame(plans)
    assert list(df["name"]) == list(SOLVER_NAMES) and len(df) == len(plans)
    best = min(p.step_time_s for p in plans)
    for row, plan in zip(df.itertuples(index=False), plans):
        assert row.ratio == pytest.approx(plan.step_time_s / best)
        assert row.step_ms == pytest.approx(plan.step_time_s * 1e3)
        assert row.slowest_ms == pytest.approx(max(s.time_s for s in plan.stages) * 1e3)
        assert row.stage_ms.count("/") == plan.n_stages - 1
        assert [int(v) for v in row.stage_mem.split("/")] == [s.memory.total for s in plan.stages]
        assert (row.m, row.stages, row.bubble) == (
            plan.microbatches,
            plan.n_stages,
            plan.bubble_fraction,
        )
    assert df["ratio"][0] == pytest.approx(1.0, abs=1e-12) and (df["ratio"] >= 1 - 1e-12).all()


def test_ratio_ignores_infeasible_plans(plans: list[Plan]) -> None:
    prof = synthetic_profile(16, batch_size=16, heavy_ends=True, seed=2)
    tight = SOLVERS["uniform"](prof, Cluster.homogeneous(4, 2**16), PlanOptions())
    assert not tight.feasible
    df = compare_frame([tight, plans[2]], ["tight", "roomy"])
    assert df["ratio"][1] == 1.0 and df["feasible"].tolist() == [False, True]
    alone = compare_frame([tight])
    assert math.isnan(alone["ratio"][0])
    assert json.loads(render(alone, "json"))[0]["ratio"] is None


def test_names_must_match(plans: list[Plan]) -> None:
    with pytest.raises(InvalidRequestError, match="names"):
        compare_frame(plans, ["one"])


def test_every_format(plans: list[Plan]) -> None:
    df = compare_frame(plans)
    csv = render(df, "csv")
    back = pd.read_csv(io.StringIO(csv))
    assert list(back.columns) == list(df.columns) and back["ratio"].tolist() == pytest.approx(
        df["ratio"].tolist()
    )
    records = json.loads(render(df, "json"))
    assert [r["solver"] for r in records] == list(SOLVER_NAMES)
    assert records[0]["feasible"] is True and isinstance(records[0]["m"], int)
    md = render(df, "markdown")
    lines = md.splitlines()
    assert lines[0].startswith("| name | solver |") and set(lines[1]) <= set("|-:")
    assert len(lines) == 2 + len(plans) and all(
        line.count("|") == len(df.columns) + 1 for line in lines
    )
    table = render(df, "table").splitlines()
    assert len(table) == 1 + len(plans) and "ratio" in table[0]
    # People read memory in binary units; programs get bytes.
    first = "/".join(format_bytes(s.memory.total) for s in plans[0].stages)
    assert f"| {first} |" in md and first in table[1]
    assert str(plans[0].stages[0].memory.total) in csv.splitlines()[1]
    assert records[0]["stage_mem"] == "/".join(str(s.memory.total) for s in plans[0].stages)
    with pytest.raises(InvalidRequestError, match="format"):
        render(df, "xml")
    assert set(FORMATS) == {"table", "csv", "json", "markdown"}


def test_markdown_escapes_pipes() -> None:
    df = pd.DataFrame({"name": ["a|b"], "x": [1.5]})
    assert "a\\|b" in to_markdown(df) and "---:" in to_markdown(df)


# ---- command line -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """`pipeplan plan --solver S` for every solver, run once for the module."""
    root = tmp_path_factory.mktemp("plans")
    profile = root / "profile.json"
    write_json(profile, synthetic_profile(14, batch_size=16, heavy_ends=True, seed=7))
    files = []
    for name in SOLVER_NAMES:
        out = root / f"{name}.json"
        try:
            main(cli_argv("plan", profile, out, f"-p 3 --memory 1GiB --solver {name}"))
        except SystemExit as exc:  # pragma: no cover - a failure shows in the assert below
            assert not exc.code
        files.append(out)
    return files


def test_plan_with_every_solver(plan_files: list[Path]) -> None:
    plans = [load_plan(f) for f in plan_files]
    assert [p.solver for p in plans] == list(SOLVER_NAMES)
    assert plans[0].boundaries == plans[1].boundaries
    assert plans[1].status == "optimal" and plans[2].status == "heuristic"
    assert all(p.step_time_s >= plans[0].step_time_s * (1 - 1e-12) for p in plans)


def test_plan_cpsat_with_pins(plan_files: list[Path], tmp_path: Path, cli) -> None:
    profile = plan_files[0].parent / "profile.json"
    out = tmp_path / "pinned.json"
    options = "-p 3 --memory 1GiB --solver cpsat --pin 5:0 --max-units 6 --time-limit 10"
    code, _, err = cli(cli_argv("plan", profile, out, options))
    assert code == 0, err
    plan = load_plan(out)
    assert plan.stages[0].last_unit >= 5 and max(len(s.unit_names) for s in plan.stages) <= 6


@pytest.mark.parametrize("fmt", FORMATS)
def test_compare_prints_every_format(plan_files: list[Path], fmt: str, cli) -> None:
    code, out, err = cli(["compare", *map(str, plan_files), "--format", fmt])
    assert code == 0, err
    for name in SOLVER_NAMES:
        assert name in out
    if fmt == "json":
        assert [r["name"] for r in json.loads(out)] == list(SOLVER_NAMES)


def test_compare_writes_a_file(plan_files: list[Path], tmp_path: Path, cli) -> None:
    out = tmp_path / "cmp.md"
    code, _, _ = cli(["compare", *map(str, plan_files[:3]), "-f", "markdown", "-o", str(out)])
    assert code == 0
    text = out.read_text()
    assert text.startswith("| name |") and len(text.splitlines()) == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compare", "missing.json"], "missing.json"),
        (["compare", "PLAN", "--format", "xml"], "--format 'xml'"),
        (["compare", "PROFILE"], "expected 'pipeplan.plan/1'"),
        (["compare", "PLAN", "-o", "/nonexistent-dir/x.csv"], "does not exist"),
        (["compare", "PLAN", "--plot", "UNDER_PLAN"], "is a file, not a directory"),
        (["compare", "PLAN", "-o", "UNDER_PLAN"], "is a file, not a directory"),
        (["plan", "PROFILE", "-p", "3", "--memory", "1GiB", "--solver", "nope"], "--solver 'nope'"),
        (
            [
                "plan",
                "PROFILE",
                "-p",
                "3",
                "--memory",
                "1GiB",
                "--solver",
                "uniform",
                "--pin",
                "0:0",
            ],
            "cpsat",
        ),
        (["plan", "PROFILE", "-p", "3", "--memory", "1KiB", "--solver", "cpsat"], "needs"),
    ],
)
def test_bad_input_is_one_line(
    plan_files: list[Path], tmp_path: Path, args: list[str], message: str
) -> None:
    profile = plan_files[0].parent / "profile.json"
    swap = {"PROFILE": str(profile), "PLAN": str(plan_files[0]),
            "UNDER_PLAN": f"{plan_files[0]}/ro/x.png"}  # fmt: skip
    argv = [swap.get(a, a) for a in args]
    if "plan" == argv[0]:
        argv += ["-o", str(tmp_path / "out.json")]
    proc = subprocess.run(
        [sys.executable, "-m", "pipeplan.cli", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "out.json").exists()


def test_replicated_plans_show_their_replicas_and_global_throughput() -> None:
    from pipeplan.solvers.devices import plan_devices
    from pipeplan.solvers.dp import solve_dp

    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[1, 2, 4, 8], seed=3)
    choices = plan_devices(prof, 4, Cluster.homogeneous(1, 2**40), PlanOptions(), solve_dp)
    plans = [c.plan for c in choices if c.plan is not None]
    df = compare_frame(plans)
    assert list(df["replicas"]) == [c.replicas for c in choices if c.plan is not None]
    assert list(df["samples_s"]) == pytest.approx([c.throughput for c in choices if c.plan])
    assert df["samples_s"].iloc[0] == df["samples_s"].max()  # plan_devices puts the best first


# ---- the terminal's tables: 80 columns ----------------------------------------------------


def _rendered(table: object, width: int = 80) -> list[str]:
    from rich.console import Console

    out = Console(width=width, record=True, file=io.StringIO())
    out.print(table)
    return out.export_text().splitlines()


def test_compare_table_fits_80_columns_with_whole_headers(plans: list[Plan]) -> None:
    """Every header reads whole, the ratio shows, plans run fastest first and the best is
    marked; a long name ends in an ellipsis instead of wrapping or pushing columns off the
    right edge (one line per plan)."""
    from pipeplan.report.terminal import compare_table

    names = [f"{s}-{'very-long-plan-file-name' * (s == 'params')}" for s in SOLVER_NAMES]
    df = compare_frame(plans, names)
    lines = _rendered(compare_table(df))
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    header = next(line for line in lines if "solver" in line)
    for col in ("plan", "status", "m", "p×d", "step ms", "ratio", "bubble", "memory", "samples/s"):
        assert col in header.split() or col in header
    rows = [line.split() for line in lines if "×1 " in line]  # p×d: 4 stages, 1 replica
    order = sorted(range(len(plans)), key=lambda i: plans[i].step_time_s)
    best = plans[order[0]].step_time_s
    assert [r[5] for r in rows] == [f"{plans[i].step_time_s * 1e3:.1f}" for i in order]
    assert [r[6] for r in rows] == ["best"] + [
        f"{plans[i].step_time_s / best:.2f}×" for i in order[1:]
    ]
    assert len(rows) == len(plans)  # no row wraps
    assert any(r[0].startswith("params-") and r[0].endswith("…") for r in rows)
    wide = _rendered(compare_table(df, width=120), width=120)
    assert any("params-very-long-plan-file-name" in line for line in wide)
    peak = max(plans[0].stages, key=lambda s: s.memory.total).memory.total
    assert df["peak_mem"][0] == peak and df["mem_limit"][0] == 2**40


def test_compare_table_puts_infeasible_plans_last_without_a_ratio(plans: list[Plan]) -> None:
    from pipeplan.report.terminal import compare_table

    prof = synthetic_profile(16, batch_size=16, heavy_ends=True, seed=2)
    tight = SOLVERS["uniform"](prof, Cluster.homogeneous(4, 2**16), PlanOptions())
    lines = _rendered(compare_table(compare_frame([tight, plans[2]], ["tight", "roomy"])))
    rows = [line.split() for line in lines if line.startswith(("tight", "roomy"))]
    assert [r[0] for r in rows] == ["roomy", "tight"] and rows[1][2] == "infeasible"
    assert rows[0][6] == "best" and rows[1][6] == "-"


def test_stage_table_gives_busy_time_per_step_in_80_columns(plans: list[Plan]) -> None:
    from pipeplan.report.terminal import stage_table

    plan = plans[0]
    lines = _rendered(stage_table(plan, "dp"))
    assert max(map(len, lines)) <= 80 and "m·t ms" in lines[1]
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(plan.n_stages))
    for row, s in zip(rows, plan.stages):
        assert f"{s.time_s * plan.microbatches * 1e3:.1f}" in row


def test_compare_stages_prints_a_table_per_plan(plan_files: list[Path], cli) -> None:
    code, _, err = cli(["compare", *map(str, plan_files[:3]), "--stages", "-f", "csv"])
    assert code == 2 and "--stages prints a table per plan" in err
    code, out, err = cli(["compare", *map(str, plan_files[:3]), "--stages"])
    assert code == 0, err
    assert "3 plans, fastest first" in out and "ratio" in out
    for path in plan_files[:3]:
        plan = load_plan(path)
        assert f"{path.stem}: {plan.n_stages} stages, m = {plan.microbatches}" in out


def test_a_multi_chunk_plan_counts_ranks_and_their_peaks() -> None:
    """p×d of an interleaved plan is its ranks (not its p·v chunks), and its memory the fullest
    rank's replayed peak (the sum of its chunks' terms, not one chunk's)."""
    from pipeplan.solvers.multichunk import solve_schedule

    prof = synthetic_profile(8, batch_size=8, seed=2)
    clus = Cluster.homogeneous(2, 2**30)
    loop = solve_schedule(prof, clus, PlanOptions(schedule="interleaved1f1b"))
    assert loop.stages_per_rank == 2 and loop.n_stages == 4 and loop.rank_peak_bytes
    row = compare_frame([loop]).iloc[0]
    assert row["stages"] == 2
    assert row["peak_mem"] == max(loop.rank_peak_bytes) > max(s.memory.total for s in loop.stages)


def test_compare_fits_80_columns_with_a_schedule_plan_and_a_30_character_name(
    plans: list[Plan],
) -> None:
    """Issue 46's measure: the README's plans plus one of the schedule solver's and a
    30-character name print no line wider than 80 characters."""
    from pipeplan.report.terminal import compare_table, stage_table
    from pipeplan.solvers.multichunk import solve_schedule

    prof = synthetic_profile(8, batch_size=8, seed=2)
    interleaved = solve_schedule(
        prof, Cluster.homogeneous(2, 2**40), PlanOptions(schedule="interleaved1f1b")
    )
    names = [*SOLVER_NAMES, "gpt.uniform", "x" * 30][: len(plans)]
    df = compare_frame([*plans, interleaved], [*names, "a-30-character-plan-name-here!"])
    lines = _rendered(compare_table(df))
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    chunks = _rendered(stage_table(interleaved, "il"))
    assert max(map(len, chunks)) <= 80
    assert "il: 2 ranks x 2 chunks (interleaved1f1b)" in chunks[0]
    assert chunks[1].split()[:2] == ["rank", "chunk"]
    rows = [line.split() for line in chunks if line.split() and line.split()[0].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(0, 0), (1, 1), (0, 2), (1, 3)]


def test_compare_warns_when_the_plans_are_of_different_models(
    plan_files: list[Path], tmp_path: Path, cli
) -> None:
    other = tmp_path / "other.json"
    plan = load_plan(plan_files[0])
    write_json(other, plan.model_copy(update={"model": "some.other:model"}))
    code, _, err = cli(["compare", str(plan_files[0]), str(other)])
    assert code == 0 and "warning: these plans are of different models" in err
    code, _, err = cli(["compare", *map(str, plan_files[:2])])
    assert code == 0 and "warning" not in err
