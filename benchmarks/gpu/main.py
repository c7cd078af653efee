"""One prepared check of every CUDA path, run in one call whenever a GPU is lent (issue 35).

    benchmarks/gpu/run.sh [OUT]                                  # on the GPU machine
    PYTHONPATH=. .venv/bin/python -m benchmarks.gpu.main --device cpu --size small -o out/gpu

Stages, each timed, each failure recorded and the next one run:

1. ``environment``: GPU, driver, torch, CUDA and nccl versions.
2. ``profile``: ``pipeplan profile --device D --dtype bfloat16`` of the bundled GPT (at a GPU
   size: 24 layers, d 1024, vocabulary 32k, sequence 1024) and of a 1B-class Llama from an
   ``hf:`` config (``--method units``): wall time, per-unit F, B, saved and parameter bytes.
3. ``calibrate``: ``pipeplan calibrate --device D --nproc 1`` (the engine alone; one GPU has
   no link to measure).  Run before 4, so the 1-stage plans are charged the engine's cost.
4. ``run``: ``pipeplan run --device D`` of the GPT's 1-stage plans at m = 4 and 8 (meta build,
   the stage materialized on the device, nccl with one rank): measured step and peak memory
   beside the plan's.
5. ``alone``: every stage of the GPT's 4-stage plan measured alone on the one device
   (:mod:`benchmarks.gpu.alone`): F + B per micro-batch and peak memory beside the plan's.
6. ``nccl``: what one GPU can run of nccl: a 1-rank process group, its barrier and the
   runtime's in-place gradient all-reduce at sizes up to 16 MiB.  Two ranks cannot share one
   GPU under nccl (it refuses a duplicate device), so the link itself is not measured.
7. ``tensor parallel``: t = 1 against t = 2 on two GPUs (nccl) where the machine has them:
   ``pipeplan calibrate``'s MLP (:mod:`pipeplan.runtime.tp_overhead`) whole and split by
   ``parallelize_module``, forward + backward per rank.  With one GPU it says so; the CPU dry
   run takes two gloo ranks.

Writes ``results.json`` (every number) and ``table.md`` (the summary, against the goals:
predicted / measured step within 10 % for the 1-stage runs, peak memory within 5 %, each stage
alone within 10 % of the plan) to ``-o`` (default ``$OUT``).  ``--size small`` shrinks every
model so that the CPU dry run in the test suite passes through every stage in seconds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["SIZES", "check", "main"]

LLAMA_1B = {  # Llama 3.2 1B's shape (random weights): 1.24 B parameters
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "use_cache": False,
}

#: Per size: the GPT's model arguments and batch, the Llama config's overrides, its sequence
#: and batch, the runs' micro-batch counts and steps, the calibration's arguments, the
#: profiles' arguments and the stages' repeats alone.  ``small`` is the CPU dry run's: one run
#: (m = 4), the micro-batch sizes the plans use and no more.
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {
        "gpt": {"vocab": 32768, "d_model": 1024, "n_layers": 24, "n_heads": 16, "seq_len": 1024},
        "gpt_batch": 16,
        "llama": {},
        "llama_seq": 1024,
        "llama_batch": 8,
        "ms": (4, 8),
        "steps": ("--steps", "10", "--warmup", "3"),
        "calibrate": ("--solo-launches", "1"),
        "profile": ("--warmup", "2", "--repeats", "5"),
        "gpt_profile": (),
        "llama_profile": (),
        "repeats": 5,
    },
    "small": {
        "gpt": {"vocab": 256, "d_model": 32, "n_layers": 4, "n_heads": 2, "seq_len": 16},
        "gpt_batch": 8,
        "llama": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
        },
        "llama_seq": 16,
        "llama_batch": 4,
        "ms": (4,),
        "steps": ("--steps", "2", "--warmup", "1"),
        "calibrate": ("--solo-launches", "1", "--repeats", "2", "--width", "32"),
        "profile": ("--warmup", "0", "--repeats", "1"),
        "gpt_profile": ("--microbatch-sizes", "1,2"),
        "llama_profile": ("--microbatch-sizes", "4"),
        "repeats": 1,
    },
}

GOALS = {"run step": 0.10, "run memory": 0.05, "alone time": 0.10}
"""|predicted / measured - 1| each check is held to."""


def _cli(*args: str) -> None:
    """``pipeplan ARGS`` in this process; raise with the exit code if it fails."""
    from pipeplan.cli import main

    try:
        main(list(args))
    except SystemExit as exc:
        if exc.code:
            raise RuntimeError(f"pipeplan {' '.join(args[:2])} exited {exc.code}") from None


# ---- the stages ---------------------------------------------------------------------------


def _version(v: object) -> str:
    """nccl's version, a tuple (2, 27, 3) in recent torch, an int 22703 in older ones."""
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_cores": os.cpu_count(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env |= {
            "gpu": props.name,
            "gpu_memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
            "nccl": _version(torch.cuda.nccl.version()),
        }
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        try:
            env["driver"] = subprocess.run(
                query, capture_output=True, text=True, check=False
            ).stdout.strip()
        except OSError:
            env["driver"] = None
    else:
        env["gpu"] = None
    return env


def profile(out: Path, device: str, size: dict[str, Any]) -> list[dict[str, Any]]:
    from pipeplan.planner.io import load_profile

    config = out / "llama-1b.json"
    config.write_text(json.dumps(LLAMA_1B | size["llama"], indent=2) + "\n")
    gpt_args = [a for k, v in size["gpt"].items() for a in ("--model-arg", f"{k}={v}")]
    jobs = {
        "gpt": ["pipeplan.models.gpt:gpt", "-b", str(size["gpt_batch"]), *gpt_args,
                *size["gpt_profile"]],
        "llama": [f"hf:{config}", "-b", str(size["llama_batch"]), "--method", "units",
                  "--seq-len", str(size["llama_seq"]), *size["llama_profile"]],
    }  # fmt: skip
    results = []
    for name, args in jobs.items():
        path = out / f"{name}.profile.json"
        t0 = time.perf_counter()
        _cli("profile", *args, "--device", device, "--dtype", "bfloat16", "--max-stages", "4",
             *size["profile"], "--quiet", "-o", str(path))  # fmt: skip
        seconds = time.perf_counter() - t0
        prof = load_profile(path)
        b = max(prof.microbatch_sizes)
        results.append({
            "model": name, "method": prof.method, "seconds": seconds, "units": [
                {"name": u.name, "forward_ms": u.timings[b].forward_s * 1e3,
                 "backward_ms": u.timings[b].backward_s * 1e3,
                 "saved_bytes": u.timings[b].saved_bytes, "param_bytes": u.param_bytes}
                for u in prof.units
            ], "microbatch_size": b,
        })  # fmt: skip
    return results


def calibrate(out: Path, device: str, size: dict[str, Any]) -> dict[str, Any]:
    from pipeplan.planner.io import load_cluster

    path = out / "cluster.json"
    t0 = time.perf_counter()
    _cli("calibrate", "--device", device, "--nproc", "1", *size["calibrate"], "--quiet",
         "-o", str(path))  # fmt: skip
    cluster = load_cluster(path)
    return {
        "seconds": time.perf_counter() - t0,
        "op_overhead_us": (cluster.solo_op_overhead_s or 0.0) * 1e6,
        "step_overhead_us": cluster.step_overhead_s * 1e6,
        "memory_bytes": cluster.devices[0].memory_bytes,
    }


def _memory(device: str) -> int:
    import torch

    if device == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory)
    return 64 * 2**30


def run(out: Path, device: str, size: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPT's 1-stage plans at m = 4 and 8, run; charged the calibration when it ran."""
    from pipeplan.planner.io import load_cluster, load_profile, load_report, write_json
    from pipeplan.planner.types import Cluster, PlanOptions
    from pipeplan.solvers import SOLVERS

    prof = load_profile(out / "gpt.profile.json")
    calibrated = out / "cluster.json"
    cluster = (
        load_cluster(calibrated) if calibrated.exists() else Cluster.homogeneous(1, _memory(device))
    )
    results = []
    for m in size["ms"]:
        plan = SOLVERS["dp"](prof, cluster, PlanOptions(microbatches=m))
        path, report_path = out / f"gpt.p1.m{m}.plan.json", out / f"gpt.p1.m{m}.report.json"
        write_json(path, plan)
        t0 = time.perf_counter()
        _cli("run", str(path), "--device", device, *size["steps"], "--quiet",
             "--report", str(report_path))  # fmt: skip
        report = load_report(report_path)
        peak = report.stages[0].peak_memory_bytes
        results.append({
            "m": m, "seconds": time.perf_counter() - t0, "calibrated": calibrated.exists(),
            "predicted_ms": report.predicted_step_time_s * 1e3,
            "measured_ms": report.step_time_s * 1e3,
            "step_ratio": report.predicted_step_time_s / report.step_time_s,
            "predicted_bytes": plan.stages[0].memory.total, "peak_bytes": peak,
            "memory_ratio": plan.stages[0].memory.total / peak if peak else None,
        })  # fmt: skip
    return results


def alone(out: Path, device: str, size: dict[str, Any]) -> list[dict[str, Any]]:
    """Every stage of the GPT's 4-stage plan, measured alone (:mod:`benchmarks.gpu.alone`)."""
    import torch

    from benchmarks.gpu.alone import measure_stages
    from pipeplan.planner.io import load_profile, write_json
    from pipeplan.planner.types import Cluster, PlanOptions
    from pipeplan.solvers import SOLVERS

    prof = load_profile(out / "gpt.profile.json")
    plan = SOLVERS["dp"](prof, Cluster.homogeneous(4, _memory(device)), PlanOptions(microbatches=8))
    write_json(out / "gpt.p4.plan.json", plan)
    records = measure_stages(plan, torch.device(device), repeats=size["repeats"])
    for r in records:
        r["time_ratio"] = r["predicted_s"] / r["measured_s"]
        r["memory_ratio"] = r["predicted_bytes"] / r["peak_bytes"]
    return records


def nccl(device: str) -> dict[str, Any]:
    """A 1-rank process group on the device's backend: barrier and the gradient all-reduce."""
    import torch.distributed as dist

    from pipeplan.runtime.linkbench import message_sizes, time_allreduce

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.barrier()
        sizes = message_sizes(16 * 2**20)
        times = time_allreduce(sizes, 5, "cuda:0" if device == "cuda" else "cpu")
    finally:
        dist.destroy_process_group()
    return {
        "backend": backend,
        "world_size": 1,
        "allreduce_us": {str(b): s * 1e6 for b, s in times},
        "note": "two ranks cannot share one GPU under nccl; the link is not measured",
    }


def _tp_rank(rank: int, port: int, out: str, device: str) -> None:
    import torch
    import torch.distributed as dist

    from pipeplan.runtime.tp_overhead import measure_tp_overhead

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        got = measure_tp_overhead(f"cuda:{rank}" if device == "cuda" else "cpu", 20)
        if rank == 0:
            Path(out).write_text(json.dumps(got))
        dist.barrier()  # no rank tears its groups down while its peer still talks to it
    finally:
        dist.destroy_process_group()


def tensor_parallel(out: Path, device: str) -> dict[str, Any]:
    """t = 1 against t = 2 of the calibration MLP on 2 ranks (module docstring, stage 7)."""
    import torch
    import torch.multiprocessing as mp

    from pipeplan.planner.host import free_port
    from pipeplan.runtime.tp_overhead import TOKENS, WIDTH

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and gpus < 2:
        return {"gpus": gpus, "note": f"this machine has {gpus} GPU; t = 2 needs 2"}
    path = out / "tensor_parallel.json"
    mp.start_processes(
        _tp_rank, args=(free_port(), str(path), device), nprocs=2, start_method="spawn"
    )
    got = json.loads(path.read_text())
    return {
        "gpus": gpus,
        "backend": "nccl" if device == "cuda" else "gloo",
        "mlp": f"Linear({WIDTH}, {4 * WIDTH}), GELU, Linear({4 * WIDTH}, {WIDTH}); {TOKENS} tokens",
        "whole_ms": 1e3 * got["whole_s"],
        "split_ms": 1e3 * got["split_s"],
        "note": "forward + backward per rank, the slower rank's median of 20",
    }


# ---- the check ----------------------------------------------------------------------------


def check(out: Path, device: str, size_name: str) -> dict[str, Any]:
    """Run every stage into ``out``; ``results.json`` and ``table.md`` there.  Returns the
    results (``errors`` names each stage that failed, with its traceback's last lines)."""
    out.mkdir(parents=True, exist_ok=True)
    # the calibration is kept where `pipeplan plan` finds it: here, not in the user's cache
    home = os.environ.get("PIPEPLAN_HOME")
    os.environ["PIPEPLAN_HOME"] = str(out / "home")
    try:
        return _check(out, device, size_name)
    finally:
        if home is None:
            del os.environ["PIPEPLAN_HOME"]
        else:
            os.environ["PIPEPLAN_HOME"] = home


def _check(out: Path, device: str, size_name: str) -> dict[str, Any]:
    size = SIZES[size_name]
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "size": size_name,
        "stages": {},
        "seconds": {},
        "errors": {},
    }
    stages: list[tuple[str, Callable[[], Any]]] = [
        ("environment", lambda: environment(device)),
        ("profile", lambda: profile(out, device, size)),
        ("calibrate", lambda: calibrate(out, device, size)),
        ("run", lambda: run(out, device, size)),
        ("alone", lambda: alone(out, device, size)),
        ("nccl", lambda: nccl(device)),
        ("tensor parallel", lambda: tensor_parallel(out, device)),
    ]
    for name, fn in stages:
        t0 = time.perf_counter()
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            results["stages"][name] = fn()
        except Exception as exc:  # noqa: BLE001 - a failure is a result: record it, go on
            tail = traceback.format_exc().strip().splitlines()[-6:]
            results["errors"][name] = f"{type(exc).__name__}: {exc}\n" + "\n".join(tail)
            print(results["errors"][name], file=sys.stderr, flush=True)
        results["seconds"][name] = time.perf_counter() - t0
        _release(device)  # what a stage cached on the GPU is not the next stage's to lose
        # after every stage, so a call stopped at its time limit still returns what ran
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        (out / "table.md").write_text(table(results))
    return results


def _release(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _verdict(ratio: float | None, goal: float) -> str:
    if ratio is None:
        return "-"
    return "ok" if abs(ratio - 1) <= goal else "MISS"


def table(results: dict[str, Any]) -> str:
    """The summary as Markdown: one row per number the goals judge, and the stages' times."""
    st, env = results["stages"], results["stages"].get("environment", {})
    head = (
        f"GPU check {results['date']}: {env.get('gpu') or 'no GPU'} ({results['device']}, "
        f"size {results['size']}), torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"nccl {env.get('nccl')}, driver {env.get('driver')}"
    )
    lines = [
        head,
        "",
        "| check | predicted | measured | predicted / measured | goal |",
        "|---|---:|---:|---:|---|",
    ]
    for r in st.get("run", []):
        lines.append(f"| p = 1, m = {r['m']}: step | {r['predicted_ms']:.2f} ms | "
                     f"{r['measured_ms']:.2f} ms | {r['step_ratio']:.3f} | "
                     f"{_verdict(r['step_ratio'], GOALS['run step'])} |")  # fmt: skip
        if r["peak_bytes"]:
            lines.append(f"| p = 1, m = {r['m']}: peak memory | {r['predicted_bytes'] / 2**20:.1f}"
                         f" MiB | {r['peak_bytes'] / 2**20:.1f} MiB | {r['memory_ratio']:.3f} | "
                         f"{_verdict(r['memory_ratio'], GOALS['run memory'])} |")  # fmt: skip
    for r in st.get("alone", []):
        lines.append(f"| p = 4, stage {r['stage']} alone: F + B | {r['predicted_s'] * 1e3:.2f} ms"
                     f" | {r['measured_s'] * 1e3:.2f} ms | {r['time_ratio']:.3f} | "
                     f"{_verdict(r['time_ratio'], GOALS['alone time'])} |")  # fmt: skip
        lines.append(f"| p = 4, stage {r['stage']} alone: peak memory | "
                     f"{r['predicted_bytes'] / 2**20:.1f} MiB | {r['peak_bytes'] / 2**20:.1f} MiB"
                     f" | {r['memory_ratio']:.3f} | "
                     f"{_verdict(r['memory_ratio'], GOALS['run memory'])} |")  # fmt: skip
    lines += ["", "| stage | seconds | result |", "|---|---:|---|"]
    for name, seconds in results["seconds"].items():
        what = (
            "FAILED: " + results["errors"][name].splitlines()[0]
            if name in results["errors"]
            else "ok"
        )
        lines.append(f"| {name} | {seconds:.1f} | {what} |")
    for p in st.get("profile", []):
        lines.append(f"\n{p['model']} profile ({p['method']}): {len(p['units'])} units in "
                     f"{p['seconds']:.1f} s")  # fmt: skip
    if "calibrate" in st:
        c = st["calibrate"]
        lines.append(f"\ncalibrate --nproc 1: engine {c['op_overhead_us']:.0f} us per operation,"
                     f" {c['step_overhead_us']:.0f} us per step ({c['seconds']:.1f} s)")  # fmt: skip
    if "nccl" in st:
        n = st["nccl"]
        big = max(n["allreduce_us"], key=int)
        lines.append(f"\n{n['backend']}, 1 rank: all-reduce of {int(big) // 2**20} MiB "
                     f"{n['allreduce_us'][big]:.0f} us; {n['note']}")  # fmt: skip
    if "tensor parallel" in st:
        t = st["tensor parallel"]
        if "split_ms" in t:
            lines.append(f"\ntensor parallel ({t['backend']}, {t['mlp']}): t = 1 "
                         f"{t['whole_ms']:.2f} ms, t = 2 {t['split_ms']:.2f} ms per rank "
                         f"({t['note']})")  # fmt: skip
        else:
            lines.append(f"\ntensor parallel: {t['note']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", choices=tuple(SIZES), default=None, help="default: gpu on cuda")
    ap.add_argument("-o", "--output", default=os.environ.get("OUT", "out/gpu"))
    args = ap.parse_args(argv)
    size = args.size or ("gpu" if args.device == "cuda" else "small")
    results = check(Path(args.output), args.device, size)
    print((Path(args.output) / "table.md").read_text())
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
