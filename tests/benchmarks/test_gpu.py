"""The GPU check (benchmarks/gpu) dry-run on CPU at small sizes, so that it cannot rot between
loans of a GPU: every stage runs and produces its numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

from benchmarks.gpu.main import check


def test_the_gpu_check_runs_every_stage_on_cpu(tmp_path: Path) -> None:
    results = check(tmp_path, "cpu", "small")
    assert results["errors"] == {}, results["errors"]
    st = results["stages"]
    assert list(st) == [
        "environment", "profile", "calibrate", "run", "alone", "nccl", "tensor parallel",
    ]  # fmt: skip
    assert st["environment"]["torch"] and st["environment"]["gpu"] is None

    def positive(*values: object) -> bool:
        return all(isinstance(v, (int, float)) and v > 0 and math.isfinite(v) for v in values)

    assert [p["model"] for p in st["profile"]] == ["gpt", "llama"]
    assert st["profile"][1]["method"] == "units"
    for p in st["profile"]:
        assert p["units"] and all(
            positive(u["forward_ms"], u["backward_ms"], u["param_bytes"]) for u in p["units"]
        )
    c = st["calibrate"]
    # the engine's cost is a fit clamped at zero: on an idle CPU it can be lost in the noise
    # (CI measured 0 us), so only its sign and finiteness are the check's
    assert positive(c["memory_bytes"])
    assert all(math.isfinite(c[k]) and c[k] >= 0 for k in ("op_overhead_us", "step_overhead_us"))
    assert (tmp_path / "home" / "cluster-cpu.json").exists()  # kept there, not in ~/.cache
    (r,) = st["run"]
    assert r["m"] == 4 and r["calibrated"]
    assert positive(r["predicted_ms"], r["measured_ms"], r["step_ratio"], r["peak_bytes"])
    assert len(st["alone"]) == 4
    for s in st["alone"]:
        assert positive(s["measured_s"], s["predicted_s"], s["peak_bytes"], s["time_ratio"])
    assert st["nccl"]["backend"] == "gloo" and positive(*st["nccl"]["allreduce_us"].values())
    tp = st["tensor parallel"]  # two gloo ranks on the CPU
    assert tp["backend"] == "gloo" and positive(tp["whole_ms"], tp["split_ms"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["stages"]["run"][0]["m"] == 4
    table = (tmp_path / "table.md").read_text()
    assert "| p = 1, m = 4: step |" in table and "| p = 4, stage 3 alone: F + B |" in table


def test_the_environment_stage_names_the_gpu_and_nccl(fake_cuda: SimpleNamespace) -> None:
    from benchmarks.gpu.main import environment

    env = environment("cuda")
    assert (env["gpu"], env["gpu_memory_bytes"], env["capability"]) == (
        "Fake H100",
        80 * 2**30,
        "9.0",
    )
    assert env["nccl"] == "2.27.3" and "driver" in env


def test_one_gpu_says_tensor_parallelism_needs_two(
    fake_cuda: SimpleNamespace, tmp_path: Path
) -> None:
    from benchmarks.gpu.main import tensor_parallel

    got = tensor_parallel(tmp_path, "cuda")
    assert got == {"gpus": 1, "note": "this machine has 1 GPU; t = 2 needs 2"}
