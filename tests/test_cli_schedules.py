"""`pipeplan plan --schedule` over torch's families: written, shown, and refused with one line."""

from __future__ import annotations

from pathlib import Path

from _cli_argv import cli_argv

from pipeplan.planner.io import load_plan, write_json
from pipeplan.profiler.synthetic import synthetic_profile


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
