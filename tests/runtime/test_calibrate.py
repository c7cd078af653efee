"""`pipeplan calibrate`: a real two-rank measurement written as a cluster, and the medians over
launches (the fits themselves: test_linkbench, test_engine_fit, test_update_contention)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import numpy as np
import pytest

import pipeplan.runtime.calibrate as calibrate_module
from pipeplan.cli import main
from pipeplan.planner.collectives import collective_cost, ring_cost
from pipeplan.planner.errors import StageFailedError
from pipeplan.planner.io import calibration_file, load_cluster, write_json
from pipeplan.runtime.engine_fit import MICRO
from pipeplan.runtime.linkbench import fit_link


@pytest.mark.multirank
def test_calibrate_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    try:
        # One launch of each kind: the medians over launches are checked on synthetic
        # launches below (test_calibrate_takes_the_median_of_launches).
        main(["calibrate", "--nproc", "2", "--repeats", "3", "--launches", "1",
              "--solo-launches", "1", "--max-size", "256KiB", "--memory", "8GiB",
              "--width", "256", "-o", str(out)])  # fmt: skip
    except SystemExit as exc:
        assert not exc.code
    cluster = load_cluster(out)
    assert cluster.n_stages == 2 and cluster.devices[0].memory_bytes == 8 * 2**30
    link = cluster.link
    assert link.bandwidth_Bps and link.bandwidth_Bps > 1e6
    assert 0 < link.latency_s < 0.05
    assert [s for s, _ in link.samples] == [4 * 4**k for k in range(9)]
    # The engine's fixed cost per operation, measured through the real PipelineRunner.  One
    # width: the contention is taken as 0.  (Two widths of sub-millisecond stages fit a line
    # through two noisy points; with the other test worker's ranks on the same 2 cores CI got
    # o = k = 0 once and k = 5.7 another time.  The two-width fit is checked exactly on
    # synthetic launches below.)
    assert 0 <= cluster.op_overhead_s < 0.05
    assert cluster.contention == 0
    # The engine alone, on one rank, for 1-stage plans.
    assert cluster.solo_op_overhead_s is not None and 0 <= cluster.solo_op_overhead_s < 0.05
    # The runtime's all-reduce of tied gradients, timed at the same sizes.
    assert cluster.allreduce is not None
    assert [s for s, _ in cluster.allreduce.samples] == [4 * 4**k for k in range(9)]
    assert 0 < cluster.allreduce_s(2**18) < 0.5
    # FSDP2's reduce-scatter and all-gather and the replicas' all-reduce, fitted per byte
    assert set(cluster.collectives) == {"all_reduce", "reduce_scatter", "all_gather"}
    assert cluster.collective_ranks == 2
    for per_byte, fixed in cluster.collectives.values():
        assert per_byte >= 0 and 0 <= fixed < 0.05
    # Adam steps on both ranks at once against each alone (read back from the file).
    assert 0 <= cluster.update_contention < 5
    # Kept where `pipeplan plan` finds it (the test's own PIPEPLAN_HOME).
    assert load_cluster(calibration_file("cpu")) == cluster


@pytest.mark.multirank
def test_each_launch_reports_its_phases() -> None:
    """The progress bar advances once per phase that rank 0 finishes: the link, the
    all-reduce, the update contention and tensor parallelism on 2 ranks, then each width; one
    rank, the widths."""
    for nproc, names in (
        (2, ["link", "all-reduce", "update contention", "tensor parallel", "engine width 64"]),
        (1, ["engine width 64"]),
    ):
        seen: list[str] = []
        result = calibrate_module.measure(
            nproc, "cpu", 1024, 3, None, 120.0, (64,), on_phase=seen.append, engine_repeats=2,
            ms=(2, 3),
        )  # fmt: skip
        assert seen == names and len(seen) == calibrate_module.phases(nproc, (64,))
        # The MLP whole and split over the 2 ranks (none on one rank).
        tp = result["tensor_parallel"]
        assert (
            (
                tp["whole_s"] > 0
                and tp["split_s"] > 0
                and tp["bytes"] == 256 * 256 * 4
                and tp["block_s"] > 0
                and tp["sequence_s"] > 0
            )
            if (nproc == 2)
            else tp == {}
        )
        # Every timing comes back: per round, `engine_repeats` steps per m and `repeats` passes
        # of the stage alone, whose medians are the figures the fit reads.
        (engine,) = result["engine"]
        raw = engine["raw"]
        assert [len(r) for r in raw["compute"]] == [3, 3, 3]
        assert engine["compute"] == statistics.median(statistics.median(r) for r in raw["compute"])
        for m in ("2", "3"):
            assert [len(r) for r in raw["steps"][m]] == [2, 2, 2]
            assert engine["steps"][m] == [statistics.median(r) for r in raw["steps"][m]]


def test_calibrate_bad_input(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--nproc", "0", "-o", str(tmp_path / "c.json")])
    assert info.value.code == 2
    assert "--nproc 0" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    "flag",
    [["--launches", "0"], ["--repeats", "0"], ["--width", "0"], ["--engine-repeats", "0"],
     ["--solo-launches", "-1"]],
)  # fmt: skip
def test_calibrate_bad_counts(tmp_path: Path, capsys, flag: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["calibrate", *flag, "-o", str(tmp_path / "c.json")])
    assert info.value.code != 0
    assert flag[0] in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


def test_one_rank_calibrates_the_engine_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """--nproc 1 (one GPU): only 1-rank launches, at least one, at the widths asked for; a
    one-device cluster charged the engine's cost alone, with no link measured."""
    seen: list[tuple[int, tuple[int, ...]]] = []

    def measure(n: int, device: str, *args: object, **kwargs: object) -> dict:
        widths = tuple(args[4])  # type: ignore[arg-type]
        seen.append((n, widths))
        slope = 1e-3 * (1 + len(seen))  # the launches' slopes: 2, 3 and 4 ms per micro-batch
        steps = {str(m): [m * slope + 5e-3] * 3 for m in (2, 16)}
        return {"memory": 2**30, "engine": [{"width": w, "compute": 0.0, "steps": steps}
                                            for w in widths]}  # fmt: skip

    monkeypatch.setattr(calibrate_module, "measure", measure)
    cluster, samples = calibrate_module.calibrate(1, solo_launches=3, widths=(64,), device="cuda")
    assert seen == [(1, (64,))] * 3 and samples == []
    assert (cluster.n_stages, cluster.devices[0].name) == (1, "gpu0")
    assert cluster.solo_op_overhead_s == cluster.op_overhead_s == pytest.approx(1.5e-3)
    assert cluster.step_overhead_s == pytest.approx(5e-3)
    assert cluster.link.bandwidth_Bps is None and cluster.allreduce is None
    seen.clear()
    calibrate_module.calibrate(1, solo_launches=0)  # one launch at least, at the 1-rank widths
    assert seen == [(1, calibrate_module.SOLO_WIDTHS)]


def test_calibrate_takes_the_median_of_launches(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Three launches: one in a fast phase, two in a slow one.  Per message size the cluster
    # keeps the median one-way time, and the median engine cost, not the mean or the first.
    # Per width, the slope is the median of the launches' slopes.
    def result(scale: float, slope: float, kappa_u: float = 0.0) -> dict:
        sizes = [4, 64, 1024, 65536, 1048576]
        return {
            "update_contention": kappa_u,
            # the MLP split over the pair: T_2 - T_1 / 2 = 4, 12 and 8 ms over the launches
            "tensor_parallel": {
                "whole_s": 0.02,
                "split_s": 0.01 + 0.004 * slope / 1e-3,
                "block_s": 0.02,  # and sequence parallelism adds 6, 18 and 12 ms
                "sequence_s": 0.02 + 0.006 * slope / 1e-3,
                "bytes": 262144.0,
            },
            "samples": [(n, scale * (5e-5 + n / 4e9), scale * (6e-5 + n / 4e9)) for n in sizes],
            "allreduce": [(n, scale * (1e-4 + n / 1e9)) for n in sizes],
            "memory": 2**30,
            "engine": [
                {"width": 256, "compute": 0.0, "steps": {str(m): [m * slope] * 3 for m in (2, 16)}}
            ],
        }

    launches = iter([result(1.0, 1e-3, 0.1), result(2.0, 3e-3, 0.5), result(3.0, 2e-3, 0.2)])
    alone = iter([result(1.0, 4e-4), result(1.0, 6e-4), result(1.0, 5e-4)])
    monkeypatch.setattr(
        calibrate_module, "measure", lambda n, *a, **k: next(launches if n == 2 else alone)
    )
    cluster, samples = calibrate_module.calibrate(2, launches=3, widths=(256,))
    # A 1-stage plan's engine cost: the median 1-rank slope (5e-4 s, no transfers) over two.
    assert cluster.solo_op_overhead_s == pytest.approx(2.5e-4)
    assert cluster.model_copy(update={"devices": cluster.devices[:1]}).engine_overhead_s == (
        cluster.solo_op_overhead_s
    )
    assert cluster.engine_overhead_s == cluster.op_overhead_s
    assert samples[0] == (4, pytest.approx(2.0 * (5e-5 + 1e-9)), pytest.approx(2.0 * 6e-5 + 2e-9))
    # The tied-gradient all-reduce: the median launch's times, interpolated.
    assert cluster.allreduce is not None
    assert cluster.allreduce_s(65536) == pytest.approx(2.0 * (1e-4 + 65536 / 1e9))
    # The replicas' ring all-reduce over the 2 ranks reproduces that measurement.
    two = cluster.model_copy(update={"data_parallel": 2})
    alpha, beta = collective_cost(two, "all_reduce")
    assert alpha * 2**20 + beta == pytest.approx(2.0 * (1e-4 + 2**20 / 1e9), rel=0.05)
    trip = 2 * cluster.link.transfer_s(4 * 256 * MICRO)
    assert cluster.op_overhead_s == pytest.approx((2e-3 - trip) / 2)
    assert cluster.contention == 0.0
    # The update contention: the median launch's, kept in the cluster file.
    assert cluster.update_contention == pytest.approx(0.2)
    # o_tp: the median launch's (8 ms), less the two all-reduces the fitted link prices,
    # over 2 projections x 2 passes.
    alpha, beta = ring_cost(cluster.link, 2, "all_reduce")
    assert cluster.tp_op_overhead_s == pytest.approx((8e-3 - 2 * (alpha * 262144 + beta)) / 4)
    assert cluster.tp_op_overhead_s > 1e-3
    # o_sp: the median launch's 12 ms, less the all-gather the model charges, over 3
    alpha, beta = ring_cost(cluster.link, 2, "all_gather")
    assert cluster.tp_sequence_overhead_s == pytest.approx((12e-3 - alpha * 262144 - beta) / 3)
    write_json(tmp_path / "cluster.json", cluster)
    assert load_cluster(tmp_path / "cluster.json") == cluster


_LINK = {
    "samples": [(n, 5e-5 + n / 4e9, 6e-5 + n / 4e9) for n in (4, 1024, 65536, 2**20)],
    "allreduce": [(n, 1e-4 + n / 1e9) for n in (4, 1024, 65536, 2**20)],
}


def _exact_launch(o: float, kappa: float, compute: dict[int, float]) -> dict:
    """A launch's result whose steady-state slopes follow (1 + k)(F + B + 2 o) + C exactly, C
    the round trip of a calibration stage's activations over ``_LINK``; widths as ``compute``'s
    keys, F + B its values."""
    link = fit_link(_LINK["samples"])
    slope = {
        w: (1 + kappa) * (f + 2 * o) + 2 * link.transfer_s(4 * w * MICRO)
        for w, f in compute.items()
    }
    engine = [
        {"width": w, "compute": compute[w],
         "steps": {str(m): [0.01 + m * slope[w]] * 3 for m in (2, 4, 8, 16)}}
        for w in compute
    ]  # fmt: skip
    return {**_LINK, "memory": 2**30, "engine": engine}


def test_calibrate_fits_engine_cost_and_contention(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two widths whose steady-state slopes follow (1 + k)(F + B + 2 o) + C exactly.
    o, kappa = 3e-4, 0.4
    result = _exact_launch(o, kappa, {256: 4e-4, 1024: 7e-3})
    monkeypatch.setattr(calibrate_module, "measure", lambda *a, **k: result)
    cluster, _ = calibrate_module.calibrate(2, launches=2, solo_launches=0, widths=(256, 1024))
    assert cluster.solo_op_overhead_s is None
    assert cluster.op_overhead_s == pytest.approx(o, rel=1e-6)
    assert cluster.contention == pytest.approx(kappa, rel=1e-6)


def test_calibrate_fits_one_line_through_every_launchs_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Three launches in different host phases (their stage times differ), each exactly on its
    # own line: (o, k) = (2e-4, 0.2), (3e-4, 0.4), (5e-4, 0.9).  The cluster's (o, k) is the
    # least-squares line through all six (F + B, slope - C) points, not any launch's own.
    lines = [(2e-4, 0.2, {256: 4e-4, 1024: 9e-3}), (3e-4, 0.4, {256: 6e-4, 1024: 6e-3}),
             (5e-4, 0.9, {256: 5e-4, 1024: 7e-3})]  # fmt: skip
    launches = iter([_exact_launch(*line) for line in lines])
    monkeypatch.setattr(calibrate_module, "measure", lambda *a, **k: next(launches))
    cluster, _ = calibrate_module.calibrate(2, launches=3, solo_launches=0, widths=(256, 1024))
    x = [f for _, _, compute in lines for f in compute.values()]
    y = [(1 + k) * (f + 2 * o) for o, k, compute in lines for f in compute.values()]
    b, a = np.polyfit(x, y, 1)
    assert cluster.contention == pytest.approx(b - 1, rel=1e-6)
    assert cluster.op_overhead_s == pytest.approx(a / (2 * b), rel=1e-6)
    assert 0.2 < cluster.contention < 0.9 and 2e-4 < cluster.op_overhead_s < 5e-4


WROTE_THEN_ABORTED = (
    'echo \'{"memory": 7}\' > "$OUT"\n'
    'echo "terminate called without an active exception" >&2\nexit 134\n'
)


@pytest.mark.parametrize(
    ("script", "error"),
    [
        # rank 0 wrote its result, then a rank aborted in gloo's teardown: the result stands
        (WROTE_THEN_ABORTED, None),
        # a rank failed before anything was written: one line with its last error line
        ('echo "RuntimeError: Connection closed by peer" >&2\nexit 1\n',
         "calibration ranks failed (exit 1): RuntimeError: Connection closed by peer"),
    ],
)  # fmt: skip
@pytest.mark.multirank  # the launch path, its ranks stood in for
def test_a_launch_failing_after_its_result_loses_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, script: str, error: str | None
) -> None:
    """The launch's ranks stood in for by a shell script (``sys.executable``) that finds the
    ``--out`` path among its arguments."""
    exe = tmp_path / "python"
    exe.write_text(
        '#!/bin/sh\nwhile [ "$#" -gt 0 ]; do [ "$1" = "--out" ] && OUT=$2; shift; done\n' + script
    )
    exe.chmod(0o755)
    monkeypatch.setattr(calibrate_module.sys, "executable", str(exe))
    if error is None:
        assert calibrate_module.measure(2, "cpu", 1024, 1, None, 30.0) == {"memory": 7}
    else:
        with pytest.raises(StageFailedError, match=re.escape(error)):
            calibrate_module.measure(2, "cpu", 1024, 1, None, 30.0)
