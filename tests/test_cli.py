"""`pipeplan plan` and `pipeplan show` end to end, and every bad input: one line, exit 2.

`pipeplan plan --schedule` over torch's families: written, shown, and refused with one line.

And the command line answers at once: ``pipeplan --help``, a command's ``--help`` and a bad
option import neither torch nor pandas, matplotlib or OR-Tools (issue 41).

Each case runs ``python -X importtime -m pipeplan ...`` in a process of its own and reads the
modules it imported from the import-time lines on stderr, so a top-level import of torch in
``pipeplan/cli.py`` (or in anything it imports at the top) fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cli_argv import cli_argv

import pipeplan
from pipeplan.planner.errors import PipeplanError
from pipeplan.planner.io import load_plan, write_json
from pipeplan.planner.types import Cluster, Link
from pipeplan.profiler.synthetic import synthetic_profile


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    write_json(path, synthetic_profile(12, batch_size=16, heavy_ends=True, seed=4))
    return path


def test_plan_and_show(tmp_path: Path, profile_file: Path, cli) -> None:
    out_file = tmp_path / "plan.json"
    options = "--stages 3 --memory 1GiB --bandwidth 10GB/s --latency 5us --schedule gpipe"
    code, out, _ = cli(cli_argv("plan", profile_file, out_file, options))
    assert code == 0
    plan = load_plan(out_file)
    assert plan.n_stages == 3 and plan.solver == "dp" and plan.status == "optimal"
    assert plan.cluster.link.bandwidth_Bps == 1e10 and plan.cluster.link.latency_s == 5e-6
    assert plan.solve_time_s is None
    assert "step time" in out
    # Links were given; the engine's costs and contention were not measured: said so.
    assert "uncalibrated: this plan charges nothing for the pipeline engine's cost" in out
    assert "transfers between stages" not in out
    code, out, _ = cli(["show", str(out_file)])
    assert code == 0 and "bubble" in out and "stage" in out
    code, out, _ = cli(["show", str(profile_file)])
    assert code == 0 and "unit11" in out


def test_auto_prints_what_it_weighed_in_plan_and_show(tmp_path: Path, cli) -> None:
    """A new user can tell why auto chose its plan: each family's best, with v, m, its step
    and its ratio to the chosen plan, under the summary, in plan.json and again in show."""
    profile_file = tmp_path / "profile.json"
    prof = synthetic_profile(8, batch_size=8, seed=4)
    split = prof.model_copy(update={"units": tuple(
        u.model_copy(update={"timings": {b: t.model_copy(update={
            "backward_input_s": 0.4 * t.backward_s, "backward_weight_s": 0.6 * t.backward_s})
            for b, t in u.timings.items()}}) for u in prof.units)})  # fmt: skip
    write_json(profile_file, split)
    out_file = tmp_path / "plan.json"
    code, out, _ = cli(cli_argv("plan", profile_file, out_file, "--stages 2 --memory 1GiB"))
    assert code == 0, out
    plan = load_plan(out_file)
    assert len(plan.weighed) == 7
    chosen = next(w for w in plan.weighed if w.family == plan.schedule)
    for text in (out, cli(["show", str(out_file)])[1]):
        assert "schedule auto weighed" in text
        row = next(line for line in text.splitlines() if "(chosen)" in line)
        assert plan.schedule in row and f" {chosen.microbatches} " in row and "1.00" in row
        assert all(w.family in text for w in plan.weighed)


def test_plan_for_devices_prints_the_frontier_and_writes_the_best(
    tmp_path: Path, profile_file: Path, cli
) -> None:
    out_file = tmp_path / "plan.json"
    options = "--devices 4 --memory 1GiB --bandwidth 1GB/s --latency 5us"
    code, out, _ = cli(cli_argv("plan", profile_file, out_file, options))
    assert code == 0, out
    plan = load_plan(out_file)
    d = plan.cluster.data_parallel
    assert plan.n_stages * d == 4 and plan.batch_size * d == 16
    assert plan.layout == tuple(tuple(r * plan.n_stages + j for j in range(plan.n_stages))
                                for r in range(d))  # fmt: skip
    assert "4 devices, global batch 16" in out and "best" in out
    for p in (1, 2, 4):  # one row per depth
        assert any(line.split("│")[1].strip() == str(p) for line in out.splitlines()
                   if line.count("│") > 3)  # fmt: skip
    assert d > 1  # replicas win on this profile and link
    assert f"{d} data-parallel ranks per stage (replicate)" in out


@pytest.mark.parametrize("mode", ["shard", "replicate"])
def test_plan_for_devices_at_a_global_batch_in_one_mode(
    tmp_path: Path, profile_file: Path, cli, mode: str
) -> None:
    """--global-batch-size sets the step's samples over every rank; --data-parallel the mode
    the frontier weighs; --dp fixes d.  The plan file records them."""
    out_file = tmp_path / "plan.json"
    options = (
        f"--devices 4 --memory 1GiB --bandwidth 1GB/s --latency 5us --global-batch-size 32 "
        f"--data-parallel {mode} --dp 2"
    )
    code, out, err = cli(cli_argv("plan", profile_file, out_file, options))
    assert code == 0, err
    plan = load_plan(out_file)
    assert (plan.pipeline_ranks, plan.cluster.data_parallel) == (2, 2)
    assert plan.cluster.data_parallel_mode == mode and plan.batch_size * 2 == 32
    assert "4 devices, global batch 32" in out
    rows = [line for line in out.splitlines() if line.count("│") == 10]  # the frontier's
    assert len(rows) == 1 and mode in rows[0]  # one pair: p = 2, d = 2, the mode asked
    assert f"2 data-parallel ranks per stage ({mode})" in out


def test_plan_is_byte_identical(tmp_path: Path, profile_file: Path, cli) -> None:
    cli(cli_argv("plan", profile_file, tmp_path / "a.json", "--stages 4 --memory 256MiB"))
    cli(cli_argv("plan", profile_file, tmp_path / "b.json", "--stages 4 --memory 256MiB"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_plan_options_recorded(tmp_path: Path, profile_file: Path, cli) -> None:
    out_file = tmp_path / "p.json"
    options = (
        "--stages 2 --memory 4GiB --microbatches 4 --checkpoint never --schedule 1f1b"
        " --optimizer sgd --record-solve-time"
    )
    code, _, _ = cli(cli_argv("plan", profile_file, out_file, options))
    assert code == 0
    plan = load_plan(out_file)
    assert (plan.microbatches, plan.checkpoint, plan.schedule, plan.optimizer) == (
        4,
        "never",
        "1f1b",
        "sgd",
    )
    assert plan.solve_time_s is not None and plan.solve_time_s >= 0


def test_cluster_file(tmp_path: Path, profile_file: Path, cli) -> None:
    cluster = {
        "schema": "pipeplan.cluster/1",
        "devices": [{"name": "a", "memory_bytes": 2**30}, {"name": "b", "memory_bytes": 2**29}],
        "link": {"bandwidth_Bps": 1e9, "latency_s": 1e-5, "overhead_s": 0.0},
    }
    (tmp_path / "c.json").write_text(json.dumps(cluster))
    code, _, err = cli(
        cli_argv(
            "plan", profile_file, tmp_path / "p.json", args=["--cluster", str(tmp_path / "c.json")]
        )
    )
    assert code == 0, err
    plan = load_plan(tmp_path / "p.json")
    assert [s.memory_limit for s in plan.stages] == [2**30, 2**29]


BAD = [
    (["--stages", "3", "--memory", "-5GB"], "memory '-5GB'"),
    (["--stages", "3", "--memory", "0"], "must be positive"),
    (
        ["--stages", "30", "--memory", "1GiB"],
        "only 12 units; use --stages 12 or fewer, or profile again with --max-stages 30",
    ),
    (["--stages", "0", "--memory", "1GiB"], "--stages 0"),
    (["--stages", "3", "--memory", "1KiB"], "the best partition needs"),
    (["--stages", "3", "--memory", "1GiB", "--microbatches", "3"], "does not divide"),
    (["--stages", "3", "--memory", "1GiB", "--microbatches", "lots"], "--microbatches 'lots'"),
    (["--stages", "3", "--memory", "1GiB", "--solver", "magic"], "--solver 'magic'"),
    (
        ["--stages", "3", "--memory", "1GiB", "--solver", "cpsat", "--schedule", "zbv"],
        "--schedule zbv is planned by the schedule solver (--solver dp), not with --solver cpsat",
    ),
    (
        ["--devices", "4", "--memory", "1GiB", "--data-parallel", "fsdp"],
        "--data-parallel 'fsdp' is not one of auto, replicate, shard",
    ),
    (
        ["--devices", "4", "--memory", "1GiB", "--global-batch-size", "6", "--dp", "4"],
        "global batch 6 does not split over 4 data-parallel ranks",
    ),
    (["--devices", "4", "--memory", "1GiB", "--global-batch-size", "0"], "must be positive"),
    (["--devices", "8", "--memory", "1GiB", "--dp", "3"], "--dp 3 does not divide --devices 8"),
    (["--stages", "2", "--memory", "1GiB", "--dp", "0"], "--dp 0 must be at least 1"),
    (["--stages", "3", "--memory", "1GiB", "--checkpoint", "sometimes"], "--checkpoint"),
    (["--stages", "3", "--memory", "1GiB", "--bandwidth", "fast"], "bandwidth 'fast'"),
    (["--stages", "3", "--memory", "1GiB", "--pin", "x"], "--pin 'x'"),
    (["--stages", "3"], "give --stages and --memory"),
    (["--devices", "4", "--stages", "2", "--memory", "1GiB"], "--devices chooses the stage"),
    (["--devices", "0", "--memory", "1GiB"], "--devices 0 must be at least 1"),
    (["--devices", "4", "--memory", "1KiB"], "no depth fits 4 devices: p=1 replicate:"),
    (["--stages", "2", "--memory", "1GiB", "--prove", "-1"], "plan option prove: "),
]


@pytest.mark.parametrize("extra, message", BAD)
def test_bad_plan_input(tmp_path: Path, profile_file: Path, cli, extra, message) -> None:
    out_file = tmp_path / "plan.json"
    code, _, err = cli(cli_argv("plan", profile_file, out_file, args=extra))
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out_file.exists()
    assert list(tmp_path.iterdir()) == [profile_file]  # no temporary left behind


GIB = {"memory": "1GiB"}
SAME = [
    (["--stages", "3"], {"stages": 3}),
    (["--stages", "3", "--memory", "1GiB", "--solver", "magic"],
     {"stages": 3, **GIB, "solver": "magic"}),
    (["--stages", "3", "--memory", "1GiB", "--checkpoint", "sometimes"],
     {"stages": 3, **GIB, "checkpoint": "sometimes"}),
    (["--stages", "3", "--memory", "1GiB", "--bandwidth", "fast"],
     {"stages": 3, **GIB, "bandwidth": "fast"}),
    (["--devices", "4", "--stages", "3", "--memory", "1GiB"], {"devices": 4, "stages": 3, **GIB}),
    (["--devices", "4", "--memory", "1GiB", "--schedule", "zbv"],
     {"devices": 4, **GIB, "schedule": "zbv"}),
    (["--stages", "3", "--memory", "1GiB", "--solver", "cpsat", "--schedule", "zbv"],
     {"stages": 3, **GIB, "solver": "cpsat", "schedule": "zbv"}),
    (["--devices", "4", "--memory", "1KiB"], {"devices": 4, "memory": "1KiB"}),
]  # fmt: skip


@pytest.mark.parametrize("args, kwargs", SAME)
def test_the_command_line_refuses_what_the_api_refuses_with_its_message(
    tmp_path: Path, profile_file: Path, cli, args: list[str], kwargs: dict[str, object]
) -> None:
    """One check, one message: the command line prints the API's error as it is."""
    code, _, err = cli(cli_argv("plan", profile_file, tmp_path / "plan.json", args=args))
    with pytest.raises(PipeplanError) as refused:
        pipeplan.plan(profile_file, **kwargs)
    assert code == 2 and " ".join(err.split()) == f"error: {' '.join(str(refused.value).split())}"


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"schema": "pipeplan.profile/1", ', "not valid JSON"),
        ('{"schema": "pipeplan.profile/7"}', "schema is 'pipeplan.profile/7'"),
        ('{"schema": "pipeplan.profile/1", "model": "x"}', "field "),
        ("[]", "expected a JSON object"),
    ],
)
def test_bad_profile_file(tmp_path: Path, cli, content: str, message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    code, _, err = cli(cli_argv("plan", bad, tmp_path / "plan.json", "--stages 2 --memory 1GiB"))
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


def test_missing_file_and_output_dir(tmp_path: Path, profile_file: Path, cli) -> None:
    code, _, err = cli(["show", str(tmp_path / "nope.json")])
    assert code == 2 and "no such file" in err
    missing = tmp_path / "missing" / "plan.json"
    code, _, err = cli(cli_argv("plan", profile_file, missing, "--stages 2 --memory 1GiB"))
    assert code == 2 and "does not exist" in err


def test_console_script_subprocess(tmp_path: Path, profile_file: Path) -> None:
    """The installed entry point: real exit codes and stderr, no traceback."""
    exe = [sys.executable, "-m", "pipeplan.cli"]
    ok = subprocess.run(
        [*exe, *cli_argv("plan", profile_file, tmp_path / "p.json", "--stages 2 --memory 1GiB")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        [*exe, *cli_argv("plan", profile_file, tmp_path / "q.json", "--stages 99 --memory 1GiB")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error:") and "Traceback" not in bad.stderr
    usage = subprocess.run(
        [*exe, "plan", "--no-such-flag"], capture_output=True, text=True, check=False
    )
    assert usage.returncode == 2 and "Traceback" not in usage.stderr


def test_models_in_the_working_directory_import(tmp_path: Path, monkeypatch, cli) -> None:
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(
        "import torch\n"
        "from pipeplan.intake.model import ModelSpec\n"
        "def build(width: int = 8) -> ModelSpec:\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))\n"
        "    return ModelSpec(net, lambda b: (torch.randn(b, width), torch.randn(b, width)),\n"
        "                     torch.nn.functional.mse_loss)\n"
    )
    monkeypatch.chdir(tmp_path)
    options = "-b 4 --repeats 1 --warmup 0 --quiet"
    code, _, err = cli(cli_argv("profile", "userpkg.nets:build", tmp_path / "p.json", options))
    assert code == 0, err
    code, _, err = cli(cli_argv("profile", "userpkg.nets:missing", tmp_path / "q.json", "-b 4"))
    assert code == 2 and "has no attribute 'missing'" in err


def test_plan_reports_the_tied_gradient_all_reduce(tmp_path: Path, cli) -> None:
    # A calibrated cluster's all-reduce: the plan charges and shows it, and records it.
    prof = tmp_path / "tied.json"
    write_json(prof, synthetic_profile(8, batch_size=8, tied=True, update_s_per_byte=3e-9))
    clus = tmp_path / "cluster.json"
    write_json(clus, Cluster.homogeneous(2, 2**40, Link(bandwidth_Bps=1e9)).model_copy(
        update={"allreduce": Link(bandwidth_Bps=1e8, latency_s=1e-3), "step_overhead_s": 4e-4}
    ))  # fmt: skip
    out_file = tmp_path / "plan.json"
    args = ["--cluster", str(clus), "--schedule", "gpipe"]
    code, out, err = cli(cli_argv("plan", prof, out_file, args=args))
    assert code == 0, err
    assert "tied gradients: stages 0, 1" in out
    plan = load_plan(out_file)
    (sync,) = plan.tied_syncs
    assert sync.stages == (0, 1) and sync.seconds == pytest.approx(1e-3 + sync.bytes / 1e8)
    code, out, _ = cli(["show", str(out_file)])
    assert code == 0 and "tied gradients: stages 0, 1" in out


@pytest.mark.multirank
def test_profile_measures_units_split_and_plan_uses_them(tmp_path: Path, cli) -> None:
    """``pipeplan profile --tensor-parallel 2`` measures a Llama's layer and its head split
    over 2 ranks (the traced units, as the runtime splits them), and a tp 2 plan of that
    profile charges the measured bytes, not the model's."""
    prof = tmp_path / "llama.json"
    options = (
        "-b 2 --microbatch-sizes 2 --method units --max-stages 1 --tensor-parallel 2"
        " --model-arg n_layers=2 --model-arg d_model=32 --model-arg heads=4"
        " --model-arg kv_heads=2 --threads 1 --repeats 1 --warmup 0 --quiet"
    )
    code, out, err = cli(cli_argv("profile", "pipeplan.models.zoo:llama", prof, options))
    assert code == 0, err
    assert "3 split 2 ways" in out, out  # two layers (one a copy) and the head
    profile = pipeplan.Profile.model_validate_json(prof.read_text())
    split = [u for u in profile.units if 2 in u.tp_timings]
    assert len(split) == 3, [u.name for u in split]
    plan_file = tmp_path / "plan.json"
    code, _, err = cli(
        cli_argv("plan", prof, plan_file, "--stages 1 --tensor-parallel 2 --memory 1GiB")
    )
    assert code == 0, err
    from pipeplan.solvers.tensor_parallel import tp_profile

    per_rank = tp_profile(profile, load_plan(plan_file).cluster)
    for u in split:
        assert per_rank.units[u.index].timings[2] == u.tp_timings[2][2]


def test_profile_plan_show_bundled_model(tmp_path: Path, cli) -> None:
    prof = tmp_path / "mlp.json"
    options = (
        "-b 8 --model-arg width=32 --model-arg in_features=32 --model-arg depth=3 --threads 1"
        " --repeats 1 --warmup 0 --quiet"
    )
    code, out, err = cli(cli_argv("profile", "pipeplan.models.mlp:mlp", prof, options))
    assert code == 0, err
    assert "5 units" in out or "units" in out
    plan_file = tmp_path / "plan.json"
    code, _, err = cli(cli_argv("plan", prof, plan_file, "--stages 2 --memory 1GiB"))
    assert code == 0, err
    plan = load_plan(plan_file)
    assert plan.model == "pipeplan.models.mlp:mlp" and plan.model_kwargs["width"] == 32
    code, out, _ = cli(["show", str(prof)])
    assert code == 0 and "fingerprint" in out


def test_profiling_on_a_busy_host_warns_in_one_line(
    tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other jobs loading the cores the profile needs: one warning naming --rounds (issue 45)."""
    import pipeplan.cli as cli_module
    from pipeplan.planner import host

    options = (
        "-b 8 --model-arg width=32 --model-arg in_features=32 --model-arg depth=3 --threads 1"
        " --repeats 1 --warmup 0 --quiet"
    )
    monkeypatch.setattr(host, "cores", lambda: 2)
    monkeypatch.setattr(cli_module.os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    code, _, err = cli(cli_argv("profile", "pipeplan.models.mlp:mlp", tmp_path / "a.json", options))
    assert code == 0 and "warning" not in err
    monkeypatch.setattr(cli_module.os, "getloadavg", lambda: (7.5, 7.0, 6.0))
    code, _, err = cli(cli_argv("profile", "pipeplan.models.mlp:mlp", tmp_path / "b.json", options))
    assert code == 0
    line = " ".join(err.split())
    assert line.startswith("warning: the host was busy while profiling: load average 7.5 on 2 ")
    assert "or with --rounds 3 to take medians over bursts)" in line and err.count("warning") == 1


BAD_PROFILE = [
    (["pipeplan.models.nothing:here", "-b", "8"], "cannot import 'pipeplan.models.nothing'"),
    (["pipeplan.models.mlp:nope", "-b", "8"], "has no attribute 'nope'"),
    (["not-a-model-name", "-b", "8"], "package.module:callable"),
    (
        ["pipeplan.models.mlp:mlp", "-b", "6", "--microbatch-sizes", "4"],
        "does not divide batch size 6",
    ),
    (["pipeplan.models.mlp:mlp", "-b", "0"], "--batch-size 0"),
    (["pipeplan.models.mlp:mlp", "-b", "8", "--microbatch-sizes", "a,b"], "--microbatch-sizes"),
    (["pipeplan.models.mlp:mlp", "-b", "8", "--granularity", "fine"], "granularity"),
    pytest.param(
        ["pipeplan.models.mlp:mlp", "-b", "8", "--device", "cuda"],
        "cuda",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here"),
    ),
    (["pipeplan.models.mlp:mlp", "-b", "8", "--model-arg", "width"], "KEY=VALUE"),
    (["pipeplan.models.mlp:mlp", "-b", "8", "--model-arg", "colour=3"], "check --model-arg"),
    (["pipeplan.models.mlp:mlp", "-b", "8", "--dtype", "int3"], "int3"),
    (
        ["pipeplan.models.zoo:llama", "-b", "2", "--tensor-parallel", "2"],
        "--tensor-parallel 2 does not divide the model's kv_heads (1)",
    ),
    (
        ["pipeplan.models.mlp:mlp", "-b", "8", "--tensor-parallel", "2"],
        "tensor parallelism stays 1",
    ),
]


@pytest.mark.parametrize("args, message", BAD_PROFILE)
def test_bad_profile_input(tmp_path: Path, cli, args: list[str], message: str) -> None:
    out_file = tmp_path / "profile.json"
    code, _, err = cli(["profile", *args, "--quiet", "-o", str(out_file)])
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out_file.exists() and list(tmp_path.iterdir()) == []


def test_uncalibrated_note_names_only_what_is_not_charged() -> None:
    from pipeplan.report.terminal import uncalibrated_note

    bare = Cluster.homogeneous(2, 2**30)
    note = uncalibrated_note(bare)
    assert note is not None and "transfers between stages" in note and "contention" in note
    measured = Cluster.homogeneous(
        2, 2**30, Link(bandwidth_Bps=1e9), op_overhead_s=1e-4, contention=0.2
    )
    assert uncalibrated_note(measured) is None
    assert "contention" not in (uncalibrated_note(Cluster.homogeneous(1, 2**30)) or "")
    # data-parallel ranks without measured collectives: said, with pipeplan calibrate
    dp = measured.model_copy(update={"data_parallel": 2, "data_parallel_mode": "shard"})
    note = uncalibrated_note(dp)
    assert note is not None and "data-parallel collectives" in note and "pipeplan calibrate" in note
    timed = dp.model_copy(update={"collectives": {"all_gather": (1e-9, 1e-5)}})
    assert uncalibrated_note(timed) is None


# --------------------------------------------------------------------------------------------
# pipeplan plan --schedule: torch's families
# --------------------------------------------------------------------------------------------


@pytest.mark.multirank
def test_interleaved_plan_is_written_shown_and_run_like_any_plan(tmp_path: Path, cli) -> None:
    profile_file = tmp_path / "profile.json"
    prof = synthetic_profile(12, batch_size=16, heavy_ends=True, seed=4, tied=True)
    write_json(profile_file, prof)
    out_file = tmp_path / "plan.json"
    options = "--stages 2 --memory 1GiB --schedule interleaved1f1b --no-calibration"
    code, out, _ = cli(cli_argv("plan", profile_file, out_file, options))
    assert code == 0, out
    plan = load_plan(out_file)
    assert plan.schedule == "interleaved1f1b" and plan.stages_per_rank == 2
    assert len(plan.stages) == 4 and plan.solver == "schedules"
    assert len(plan.rank_peak_bytes) == 2 and plan.simulated_step_time_s == plan.step_time_s
    code, out, _ = cli(["show", str(out_file)])
    assert code == 0 and "rank 0 runs chunks 0, 2" in out and "rank 1 runs chunks 1, 3" in out
    assert "2 ranks x 2 chunks (interleaved1f1b)" in out
    assert "tied gradients: stages 0, 3 (ranks 0, 1) sum" in out  # the tied ends, by rank
    # a V holds both ends on rank 0: one gradient, nothing to sum (I and W as if measured)
    split = prof.model_copy(update={"units": tuple(
        u.model_copy(update={"timings": {b: t.model_copy(update={
            "backward_input_s": 0.4 * t.backward_s, "backward_weight_s": 0.6 * t.backward_s})
            for b, t in u.timings.items()}})
        for u in prof.units)})  # fmt: skip
    write_json(tmp_path / "split.json", split)
    code, out, _ = cli(
        cli_argv(
            "plan", tmp_path / "split.json", out_file, options.replace("interleaved1f1b", "zbv")
        )
    )
    assert code == 0, out
    assert (
        "tied parameters: chunks 0, 3 share them on rank 0" in out and "tied gradients" not in out
    )
    code, out, err = cli(["run", str(out_file), "--steps", "1", "--report", "r.json"])
    assert code == 2 and "Traceback" not in out + err, out + err  # the GPipe path's checks
    assert "for now" not in out + err and plan.model in out + err  # the synthetic model
    code, out, err = cli(
        cli_argv("plan", profile_file, out_file, "--stages 2 --memory 1GiB --schedule zbv")
    )
    assert code == 2 and "re-profile" in out + err and "Traceback" not in out + err
    code, out, err = cli(
        cli_argv("plan", profile_file, out_file, "--stages 2 --memory 1GiB --schedule zb")
    )
    assert code == 2 and "--schedule 'zb' is not one of" in out + err


# --------------------------------------------------------------------------------------------
# Startup: no heavy import before it is needed
# --------------------------------------------------------------------------------------------


HEAVY = ("torch", "pandas", "matplotlib", "ortools")


def _imports(args: list[str]) -> tuple[int, str, set[str]]:
    """Exit code, stdout and stderr (without the import-time lines), every module imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    lines = proc.stderr.splitlines()
    names = {line.rpartition("|")[2].strip() for line in lines if line.startswith("import time:")}
    rest = "\n".join(line for line in lines if not line.startswith("import time:"))
    return proc.returncode, proc.stdout + rest, names


def _heavy(names: set[str]) -> list[str]:
    return sorted(n for n in names if n.split(".")[0] in HEAVY)


def test_the_check_sees_a_heavy_import() -> None:
    """Not vacuous: the import-time lines name torch when something imports it."""
    code, _, names = _imports(["-c", "import pipeplan.cli; import torch.nn"])
    assert code == 0 and "pipeplan.cli" in names
    assert "torch" in _heavy(names) and "torch.nn" in _heavy(names)


OUT = ["-o", "{tmp}/plan.json"]


@pytest.mark.parametrize(
    ("argv", "exit_code", "says"),
    [
        (["--help"], 0, "Usage"),
        (["plan", "--help"], 0, "--memory"),
        (["profile", "--help"], 0, "--batch-size"),
        (["run", "--help"], 0, "--steps"),
        (["plan", "{tmp}/missing.json", "--memory", "nonsense", *OUT], 2, "no such file"),
        (["plan", "{profile}", "-p", "2", "--memory", "nonsense", *OUT], 2, "memory 'nonsense'"),
        (["plan", "{profile}", "-p", "2", "--memory", "1GiB", "--solver", "x", *OUT], 2, "'x'"),
        (["plan", "{profile}", "--microbatches", "many", *OUT], 2, "--microbatches 'many'"),
        (["plan", "--no-such-option"], 2, "error: No such option: --no-such-option"),
        (["plan"], 2, "error: Missing argument 'PROFILE'; see pipeplan plan --help"),
        (["run", "{tmp}/plan.json", "--steps", "0"], 2, "'--steps': Input should be greater"),
        (["show", "{tmp}/missing.json"], 2, "no such file"),
    ],
)
def test_help_and_bad_options_import_no_heavy_package(
    tmp_path: Path, argv: list[str], exit_code: int, says: str
) -> None:
    profile = tmp_path / "profile.json"
    write_json(profile, synthetic_profile(6, batch_size=8, seed=1))
    args = [a.format(tmp=tmp_path, profile=profile) for a in argv]
    code, err, names = _imports(["-m", "pipeplan", *args])
    assert code == exit_code, err
    assert "Traceback" not in err and not (tmp_path / "plan.json").exists()
    assert "pipeplan.cli" in names
    assert not _heavy(names), f"pipeplan {' '.join(argv)} imported {_heavy(names)[:5]}"
    if exit_code:
        assert says in err
        assert len(err.strip().splitlines()) == 1, err  # one line, not click's boxed usage
    else:
        assert (
            says
            in subprocess.run(
                [sys.executable, "-m", "pipeplan", *args],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )


def test_prove_runs_the_exact_model_on_the_schedule_solvers_plan(tmp_path: Path, cli) -> None:
    """``--prove`` hands each candidate of a multi-chunk request to the exact CP-SAT model: on
    a 30-unit profile at p = 2 (interleaved 1F1B, v = 2, m = 4: too many cuts to enumerate)
    the local search's plan is proven optimal, where without it the status is feasible with
    its family bound's gap."""
    prof = tmp_path / "p.json"
    write_json(prof, synthetic_profile(30, batch_size=4, microbatch_sizes=[1], seed=2))
    got, said = {}, {}
    for extra in ("", " --prove 20"):
        out_file = tmp_path / f"plan{len(extra)}.json"
        options = "--stages 2 --memory 1GiB --schedule interleaved1f1b --microbatches 4" + extra
        code, said[extra], err = cli(cli_argv("plan", prof, out_file, options))
        assert code == 0, err
        got[extra] = load_plan(out_file)
    # the search's gap says how to narrow it; a proven plan does not
    assert "--prove T" in said[""] and "--prove T" not in said[" --prove 20"]
    plain, proved = got[""], got[" --prove 20"]
    assert plain.status == "feasible" and plain.gap is not None and plain.gap > 0.01
    assert proved.status == "optimal" and proved.gap is None
    assert proved.simulated_step_time_s <= plain.simulated_step_time_s * (1 + 1e-9)  # type: ignore[operator]


@pytest.fixture
def split_profile_file(tmp_path: Path) -> Path:
    """A profile whose 10 middle units split over t ranks (heads 8, KV heads 4)."""
    from pipeplan.planner.types import UnitTensorParallel

    prof = synthetic_profile(12, batch_size=16, heavy_ends=True, seed=4)
    units = tuple(
        u if u.index in (0, 11) else u.model_copy(update={"tensor_parallel": UnitTensorParallel(
            styles={"q": "colwise", "o": "rowwise"}, divisors={"heads": 8, "kv_heads": 4},
            sharded_param_bytes=int(0.9 * u.param_bytes), sharded_flop_fraction=0.9,
            sharded_saved_fraction=0.6, allreduces=2, allreduce_bytes_per_sample=2048)})
        for u in prof.units
    )  # fmt: skip
    path = tmp_path / "split.json"
    write_json(path, prof.model_copy(update={"units": units}))
    return path


def test_plan_for_devices_searches_the_tensor_parallel_degree(
    tmp_path: Path, split_profile_file: Path, cli
) -> None:
    """--devices-per-node weighs every t dividing it: the frontier shows the best plan per
    (pp, tp), the plan file carries t and the mesh's layout, and the output says how the
    per-rank times were made."""
    out_file = tmp_path / "plan.json"
    options = ("--devices 8 --devices-per-node 4 --memory 16MiB --bandwidth 1GB/s "
               "--latency 20us --intra-bandwidth 8GB/s --intra-latency 2us")  # fmt: skip
    code, out, err = cli(cli_argv("plan", split_profile_file, out_file, options))
    assert code == 0, err
    plan = load_plan(out_file)
    t, d, p = plan.cluster.tensor_parallel, plan.cluster.data_parallel, plan.pipeline_ranks
    assert p * d * t == 8 and plan.cluster.devices_per_node == 4
    assert plan.cluster.intra_node_link is not None
    assert plan.cluster.intra_node_link.bandwidth_Bps == 8e9
    assert plan.layout == tuple(tuple((r * p + j) * t for j in range(p)) for r in range(d))
    header = next(line for line in out.splitlines() if "pp" in line and "tp" in line)
    assert [c.strip() for c in header.split("┃")[1:4]] == ["pp", "tp", "dp"]
    frontier = out.split("└")[0].splitlines()  # the first table
    rows = [line.split("│") for line in frontier if line.count("│") == 11]
    pairs = [(r[1].strip(), r[2].strip()) for r in rows if r[1].strip()]
    assert len(pairs) == len(set(pairs))  # one row per (pp, tp)
    assert {tp for _, tp in pairs} == {"1", "2", "4"}
    assert t > 1  # at 16 MiB, splitting the blocks beats the deeper pipeline
    assert f"tensor parallel {t}: 10 units split (0 measured at t = {t}, 10 modelled" in out
    assert f"{t} tensor-parallel ranks per pipeline rank" in out


def test_plan_with_a_fixed_tensor_parallel_degree(
    tmp_path: Path, split_profile_file: Path, cli
) -> None:
    out_file = tmp_path / "plan.json"
    options = "--stages 2 --tensor-parallel 2 --sequence-parallel --memory 1GiB"
    code, out, err = cli(cli_argv("plan", split_profile_file, out_file, options))
    assert code == 0, err
    plan = load_plan(out_file)
    assert (plan.pipeline_ranks, plan.cluster.tensor_parallel, plan.cluster.data_parallel) == (
        2,
        2,
        1,
    )
    assert plan.cluster.sequence_parallel and plan.layout == ((0, 2),)
    assert "2 tensor-parallel ranks per pipeline rank (sequence parallel)" in out


def test_plan_with_loss_parallel(tmp_path: Path, split_profile_file: Path, cli) -> None:
    """--loss-parallel on a profile whose last unit is a head split over the vocabulary: the
    plan records it and says so, and its last stage is charged the split loss (less memory
    than the same plan with the logits gathered)."""
    from pipeplan.planner.io import load_profile
    from pipeplan.planner.types import Timing, UnitTensorParallel

    prof = load_profile(split_profile_file)
    head = UnitTensorParallel(
        styles={"lm_head": "colwise_gather"}, divisors={"lm_head features": 64},
        sharded_param_bytes=0, sharded_flop_fraction=1.0, allgather_bytes_per_sample=1 << 20,
        gather_input_bytes_per_sample=2048)  # fmt: skip
    last = prof.units[-1].model_copy(update={"tensor_parallel": head})
    loss = {b: Timing(forward_s=1e-3, backward_s=1e-3, saved_bytes=b << 20, output_bytes=4)
            for b in prof.units[0].timings}  # fmt: skip
    path = tmp_path / "head.json"
    write_json(path, prof.model_copy(update={"units": (*prof.units[:-1], last), "loss": loss}))
    plans = []
    for extra in ("", " --loss-parallel"):
        out_file = tmp_path / f"plan{len(plans)}.json"
        options = f"--stages 2 --tensor-parallel 2 --memory 1GiB --microbatches 4{extra}"
        code, out, err = cli(cli_argv("plan", path, out_file, options))
        assert code == 0, err
        plans.append(load_plan(out_file))
    assert plans[1].cluster.loss_parallel and not plans[0].cluster.loss_parallel
    assert "2 tensor-parallel ranks per pipeline rank (loss parallel)" in out
    assert plans[1].stages[-1].memory.total < plans[0].stages[-1].memory.total


def test_a_profile_without_split_plans_tensor_parallel_1_and_says_why(
    tmp_path: Path, profile_file: Path, cli
) -> None:
    out_file = tmp_path / "plan.json"
    options = "--devices 4 --devices-per-node 4 --memory 1GiB"
    code, out, err = cli(cli_argv("plan", profile_file, out_file, options))
    assert code == 0, err
    assert load_plan(out_file).cluster.tensor_parallel == 1
    note = [line for line in err.splitlines() if "tensor parallel 1 only" in line]
    assert len(note) == 1 and "synthetic:n12-seed4 could not be annotated here" in note[0]
    assert "│ tp │" not in out


TP_BAD = [
    (["--devices", "16", "--devices-per-node", "4", "--tensor-parallel", "8"],
     ("--tensor-parallel 8 is larger than --devices-per-node 4: tensor-parallel groups stay "
      "inside a node; give a divisor of 4")),
    (["--devices", "16", "--devices-per-node", "8", "--tensor-parallel", "8"],
     "--tensor-parallel 8 does not divide the model's kv_heads (4, unit unit1); give a divisor of 4"),
    (["--devices", "6", "--tensor-parallel", "4"],
     "--devices 6 is not a multiple of --tensor-parallel 4; give a multiple of 4"),
    (["--devices", "12", "--devices-per-node", "8", "--tensor-parallel", "3"],
     "--tensor-parallel 3 does not divide --devices-per-node 8"),
    (["--stages", "2", "--tensor-parallel", "0"], "--tensor-parallel 0 must be at least 1"),
    (["--stages", "2", "--sequence-parallel"], "--sequence-parallel needs --tensor-parallel above 1"),
    (["--stages", "2", "--loss-parallel"], "--loss-parallel needs --tensor-parallel above 1"),
    (["--stages", "2", "--tensor-parallel", "2", "--loss-parallel"],
     "--loss-parallel needs a head split over the vocabulary"),
    (["--devices", "4", "--devices-per-node", "0"], "--devices-per-node 0 must be at least 1"),
    (["--devices", "4", "--intra-bandwidth", "fast"], "bandwidth 'fast'"),
]  # fmt: skip


@pytest.mark.parametrize("extra, message", TP_BAD)
def test_bad_tensor_parallel_input(
    tmp_path: Path, split_profile_file: Path, cli, extra, message
) -> None:
    out_file = tmp_path / "plan.json"
    code, _, err = cli(
        cli_argv("plan", split_profile_file, out_file, args=[*extra, "--memory", "1GiB"])
    )
    assert code == 2, err
    assert message in " ".join(err.split()), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out_file.exists()
