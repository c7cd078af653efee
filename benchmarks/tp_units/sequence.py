"""Sequence parallelism's host cost: a pipeline step at pp 1 x tp 2, predicted against measured.

    PYTHONPATH=. .venv/bin/python -m benchmarks.tp_units.sequence [--pairs 3]

A 2-layer zoo Llama (d 128, 4 heads, 2 key-value heads, sequence 64, batch 8, micro-batch 2)
is profiled once (``pipeplan profile``), this host calibrated once (``pipeplan calibrate
--nproc 2``: o_tp and o_sp, :mod:`pipeplan.runtime.tp_overhead`), and planned at pp 1 x tp 2,
1F1B, m = 4, three ways: tensor parallelism alone, with ``--sequence-parallel``, and with it
on the calibrated cluster with o_sp set to 0 (the model before it was measured).  The first two
then run (``pipeplan run``, 10 steps after 2 warm-up, one thread per rank) in ``--pairs``
interleaved pairs; each run's median step is compared with its plan's prediction.

Writes ``results-sequence.json`` beside this file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import machine, pipeplan

HERE = Path(__file__).resolve().parent
MODEL = [
    "pipeplan.models.zoo:llama",
    *("--model-arg", "n_layers=2", "--model-arg", "d_model=128", "--model-arg", "seq_len=64"),
    *("--model-arg", "heads=4", "--model-arg", "kv_heads=2"),
]


def _step(path: Path) -> float:
    return float(json.loads(path.read_text())["step_time_s"])


def measure(pairs: int, tmp: Path) -> dict[str, Any]:
    """Profile, calibrate, plan three ways, run the two pairwise (module docstring)."""
    prof, cal = tmp / "profile.json", tmp / "cluster.json"
    pipeplan("profile", *MODEL, "-b", "8", "--microbatch-sizes", "2", "--threads", "1",
             "--quiet", "-o", str(prof))  # fmt: skip
    pipeplan("calibrate", "--nproc", "2", "--threads", "1", "--quiet", "-o", str(cal))
    cluster = json.loads(cal.read_text())
    (tmp / "no-osp.json").write_text(json.dumps({**cluster, "tp_sequence_overhead_s": 0.0}))
    base = ["--stages", "1", "--tensor-parallel", "2", "--microbatches", "4", "--schedule", "1f1b"]
    plans = {"tp": (cal, []), "sp": (cal, ["--sequence-parallel"]),
             "sp, o_sp = 0": (tmp / "no-osp.json", ["--sequence-parallel"])}  # fmt: skip
    predicted = {}
    for name, (cfile, extra) in plans.items():
        out = tmp / f"{name.replace(' ', '').replace(',', '-')}.plan.json"
        pipeplan("plan", str(prof), "-o", str(out), "--cluster", str(cfile), *base, *extra)
        predicted[name] = _step(out)
    measured: dict[str, list[float]] = {"tp": [], "sp": []}
    for i in range(pairs):
        for name, steps in measured.items():
            report = tmp / f"{name}-{i}.report.json"
            pipeplan("run", str(tmp / f"{name}.plan.json"), "--steps", "10", "--threads", "1",
                     "--report", str(report))  # fmt: skip
            steps.append(_step(report))
    return {
        "o_tp_s": cluster["tp_op_overhead_s"],
        "o_sp_s": cluster["tp_sequence_overhead_s"],
        "predicted_s": predicted,
        "measured_s": measured,
        "ratios": [s / t for s, t in zip(measured["sp"], measured["tp"], strict=True)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("-o", "--output", default=str(HERE / "results-sequence.json"))
    args = ap.parse_args()
    before = machine()
    with tempfile.TemporaryDirectory(prefix="pipeplan-sp-") as tmp:
        got = measure(args.pairs, Path(tmp))
    result = {"machine": before, "after": machine()["uptime"], **got}
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    pred, meas = got["predicted_s"], got["measured_s"]
    for name in ("tp", "sp"):
        med = statistics.median(meas[name])
        print(f"{name}: predicted {1e3 * pred[name]:.1f} ms, measured "
              f"{', '.join(f'{1e3 * x:.1f}' for x in meas[name])} ms "
              f"(median {1e3 * med:.1f}, error {100 * (pred[name] - med) / med:+.1f} %)")  # fmt: skip
    print(f"sp with o_sp = 0: predicted {1e3 * pred['sp, o_sp = 0']:.1f} ms")
    print(f"o_tp {1e3 * got['o_tp_s']:.2f} ms, o_sp {1e3 * got['o_sp_s']:.2f} ms; sp / tp "
          f"predicted {pred['sp'] / pred['tp']:.2f}, measured "
          f"{', '.join(f'{r:.2f}' for r in got['ratios'])}")  # fmt: skip


if __name__ == "__main__":
    main()
