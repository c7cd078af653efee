"""Tensor-parallel units at t = 2: the cost model's per-rank time and memory against measured.

    PYTHONPATH=. .venv/bin/python -m benchmarks.tp_units.main [--models llama bert ...]
        [--rounds 3] [--d-model 256] [--seq-len 128] [--microbatch 2]

For each zoo transformer (``pipeplan.models.zoo``, 2 layers per stack, ``--d-model`` wide with
4 heads of ``d / 4``, 2 key-value heads where the model groups them, ``--seq-len`` tokens,
float32) and the bundled GPT (its MLP splits, its fused attention does not), every distinct
splittable unit (a transformer layer: ``--max-stages 1``) is measured three ways, one thread
per rank, in interleaved rounds (each round profiles every model once, then the next round):

1. **profile**: ``pipeplan profile --method units`` (the traced unit alone, as the planner
   sees it): forward f and backward g, saved bytes a, the annotation
   (:mod:`pipeplan.profiler.tp_annotate`);
2. **t = 1**: the traced unit, unsplit, in the harness that measures the split
   (:func:`pipeplan.profiler.tp_measure.measure_split` with t = 1): the same execution path
   as (3) without the split;
3. **t = 2 measured**: the traced unit split as the runtime splits a stage
   (:func:`pipeplan.intake.tp_stages.split_stage_body`, torch's ``parallelize_module``) on 2
   gloo ranks, the all-reduces included (``pipeplan profile --tensor-parallel 2``).

The model (:func:`pipeplan.solvers.tensor_parallel.tp_profile`, from a profile whose
``tp_timings`` are removed so that every unit is modelled) predicts (3) from (1), and, as a
check of the model's formulas alone, from (2), with phi, sigma, k, X of the annotation:

    per rank:  f s + c_F,  g s + c_B,   s = 1 - phi + phi / 2,
               c_F = k AR(X b / k) + n o_tp,   c_B = k_c AR(X b / k) + n o_tp
    params:    w - w_s / 2;   saved: a (1 - sigma / 2)

(k row-wise and k_c column-wise projections, n = k + k_c.)  AR is the 2-rank gloo all-reduce
of this host, measured here (``time_allreduce`` of :mod:`pipeplan.runtime.linkbench` from
4 KiB to 4 MiB, an affine fit) and given to the model as ``Cluster.intra_node_link`` (the
ring's w / b + 2 a at 2 ranks); o_tp is what ``pipeplan calibrate`` measures
(:mod:`pipeplan.runtime.tp_overhead`: an MLP whole and split over the same 2 ranks), given as
``Cluster.tp_op_overhead_s``.  Both are measured at the start of every round, and the model
takes their medians over the rounds, as calibrate takes the median over its launches.  Errors are
|predicted - measured| / measured of f + g per rank, of the parameter bytes on a rank and of
the saved bytes on a rank; medians over units, with the spread over rounds of the measured
time (min-max over rounds of each round's median, relative).

Writes ``results.json`` beside this file and prints the README's tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine
from pipeplan.planner.errors import PipeplanError

HERE = Path(__file__).resolve().parent
GQA = ("llama", "mistral", "qwen2", "gemma")
ZOO = (*GQA, "phi", "gpt_neox", "bert", "roberta", "electra", "t5", "bart")
MODELS = (*ZOO, "gpt")
AR_SIZES = tuple(4096 * 4**i for i in range(6))

MODEL = "pipeplan.solvers.tensor_parallel"


def model_args(name: str, d: int, seq: int) -> tuple[str, dict[str, Any]]:
    """(model, model arguments) of one benchmark model."""
    if name == "gpt":
        return "pipeplan.models.gpt:gpt", {
            "n_layers": 2, "d_model": d, "n_heads": 4, "seq_len": seq, "vocab": 128,
        }  # fmt: skip
    kwargs: dict[str, Any] = {"n_layers": 2, "d_model": d, "seq_len": seq, "heads": 4}
    if name in GQA:
        kwargs["kv_heads"] = 2
    return f"pipeplan.models.zoo:{name}", kwargs


def _allreduce_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from pipeplan.runtime.linkbench import time_allreduce
    from pipeplan.runtime.tp_overhead import measure_tp_overhead

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        points = time_allreduce(list(AR_SIZES), 30, "cpu")
        tp = measure_tp_overhead("cpu", 30)
        if rank == 0:
            Path(out + ".part").write_text(json.dumps({"points": points, "tp": tp}))
            os.replace(out + ".part", out)
    finally:
        dist.destroy_process_group()


def allreduce_fit() -> dict[str, Any]:
    """The 2-rank gloo all-reduce of this host: its points and (seconds per byte, seconds);
    and o_tp, from the calibration MLP measured on the same 2 ranks."""
    import tempfile

    import torch.multiprocessing as mp

    from pipeplan.planner.host import free_port
    from pipeplan.runtime.linkbench import fit_affine

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ar.json")
        try:
            mp.start_processes(
                _allreduce_rank, args=(free_port(), out), nprocs=2, start_method="spawn"
            )
        except mp.ProcessExitedException:
            if not os.path.exists(out):  # else a rank aborted in gloo's teardown, after it
                raise
        got = json.loads(Path(out).read_text())
    from pipeplan.runtime.tp_overhead import tp_overhead

    points = [tuple(p) for p in got["points"]]
    alpha, beta = fit_affine(points)  # type: ignore[arg-type]
    o_tp = tp_overhead(got["tp"], cluster(alpha, beta).link)
    return {"points": points, "alpha_s_per_byte": alpha, "beta_s": beta, "tp": got["tp"],
            "o_tp_s": o_tp}  # fmt: skip


def cluster(alpha: float, beta: float, o_tp: float = 0.0) -> Any:
    """A 2-device node whose tensor-parallel ring all-reduce at 2 ranks is alpha w + beta, and
    whose split projections cost o_tp of host work per pass."""
    from pipeplan.planner.types import Cluster, Link

    link = Link(bandwidth_Bps=1.0 / alpha, latency_s=beta / 2)  # ring at 2: w / b + 2 a
    base = Cluster.homogeneous(2, 64 << 30, link=link)
    return base.model_copy(
        update={"tensor_parallel": 2, "intra_node_link": link, "devices_per_node": 2,
                "tp_op_overhead_s": o_tp}
    )  # fmt: skip


def predict(
    profile: Any, k: int, timing: Any, alpha: float, beta: float, b: int, o_tp: float = 0.0
) -> tuple[float, float, int, int]:
    """Unit k's per-rank (forward s, backward s, parameter bytes, saved bytes) at t = 2,
    modelled from ``timing`` (its unsharded Timing at size b) by
    :func:`pipeplan.solvers.tensor_parallel.tp_profile`."""
    from pipeplan.solvers.tensor_parallel import tp_profile

    unit = profile.units[k].model_copy(update={"timings": {b: timing}, "tp_timings": {}})
    units = tuple(unit if u.index == k else u for u in profile.units)
    got = tp_profile(profile.model_copy(update={"units": units}), cluster(alpha, beta, o_tp))
    m = got.units[k]
    return m.timings[b].forward_s, m.timings[b].backward_s, m.param_bytes, m.timings[b].saved_bytes


def one_round(name: str, d: int, seq: int, b: int, repeats: int) -> list[dict[str, Any]]:
    """Profile, measure at t = 1 and t = 2: one row per distinct splittable unit."""
    from pipeplan.profiler import profile_model
    from pipeplan.profiler.tp_measure import measure_split

    model, kwargs = model_args(name, d, seq)
    profile = profile_model(
        model, batch_size=b, model_kwargs=kwargs, microbatch_sizes=(b,), method="units",
        max_stages=1, progress=False, warmup=2, repeats=repeats, threads=1,
    )  # fmt: skip
    one = measure_split(profile, 1, warmup=2, repeats=repeats, threads=1)
    two = measure_split(profile, 2, warmup=2, repeats=repeats, threads=1)
    rows = []
    for k, m in two.items():
        u = profile.units[k]
        tp = u.tensor_parallel
        assert tp is not None
        rows.append(
            {
                "model": name, "unit": u.name, "profile": profile.model_dump(mode="json"),
                "index": k, "t1": one[k].timings[b].model_dump(), "t2": m.timings[b].model_dump(),
                "t1_params": one[k].param_bytes, "t2_params": m.param_bytes,
            }
        )  # fmt: skip
    return rows


def _err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def summarise(
    rows: list[dict[str, Any]], alpha: float, beta: float, b: int, o_tp: float = 0.0
) -> list[dict[str, Any]]:
    """Per unit, medians over rounds and the model's errors (module docstring)."""
    from pipeplan.planner.types import Profile, Timing

    by_unit: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_unit.setdefault((r["model"], r["unit"]), []).append(r)
    out = []
    for (model, unit), rs in by_unit.items():
        profiles = [Profile.model_validate(r["profile"]) for r in rs]
        k = rs[0]["index"]
        profile = profiles[0]
        tp = profile.units[k].tensor_parallel
        assert tp is not None

        def med(values: Any) -> float:
            return float(statistics.median(values))

        timings = [p.units[k].timings[b] for p in profiles]
        base = timings[0].model_copy(
            update={
                "forward_s": med(t.forward_s for t in timings),
                "backward_s": med(t.backward_s for t in timings),
            }
        )
        t1 = Timing(
            forward_s=med(r["t1"]["forward_s"] for r in rs),
            backward_s=med(r["t1"]["backward_s"] for r in rs),
            saved_bytes=int(med(r["t1"]["saved_bytes"] for r in rs)),
            output_bytes=rs[0]["t1"]["output_bytes"],
        )
        pf, pg, _, p_saved = predict(profile, k, base, alpha, beta, b, o_tp)
        qf, qg, q_params, q_saved = predict(profile, k, t1, alpha, beta, b, o_tp)
        per_round = [r["t2"]["forward_s"] + r["t2"]["backward_s"] for r in rs]
        meas = med(per_round)
        meas_saved = med(r["t2"]["saved_bytes"] for r in rs)
        meas_params = rs[0]["t2_params"]
        # c_F + c_B: what the model adds to the split share of t = 1's compute
        c = qf + qg - (t1.forward_s + t1.backward_s) * (1 - tp.sharded_flop_fraction / 2)
        out.append(
            {
                "model": model, "unit": unit, "rounds": len(rs),
                "phi": tp.sharded_flop_fraction, "sigma": tp.sharded_saved_fraction,
                "allreduces": tp.allreduces, "c_ms": 1e3 * c,
                "profile_ms": 1e3 * (base.forward_s + base.backward_s),
                "t1_ms": 1e3 * (t1.forward_s + t1.backward_s),
                "t2_ms": 1e3 * meas, "t2_spread": (max(per_round) - min(per_round)) / meas,
                "pred_profile_ms": 1e3 * (pf + pg), "pred_t1_ms": 1e3 * (qf + qg),
                "time_err_profile": _err(pf + pg, meas), "time_err_t1": _err(qf + qg, meas),
                "params_pred": q_params, "params_meas": meas_params,
                "params_err": _err(q_params, meas_params),
                "saved_profile": base.saved_bytes, "saved_t1": t1.saved_bytes,
                "saved_pred_profile": p_saved, "saved_pred_t1": q_saved, "saved_meas": meas_saved,
                "saved_err_profile": _err(p_saved, meas_saved),
                "saved_err_t1": _err(q_saved, meas_saved),
            }
        )  # fmt: skip
    return out


def tables(result: dict[str, Any]) -> str:
    """The README's tables."""
    units = result["units"]
    lines = [
        (
            "| model | unit | phi | sigma | c_F + c_B ms | profile f+g ms | t=1 ms | t=2 measured ms "
            "(spread) | predicted from profile ms (err) | predicted from t=1 ms (err) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for u in units:
        lines.append(
            f"| {u['model']} | {u['unit']} | {u['phi']:.2f} | {u['sigma']:.2f} | "
            f"{u['c_ms']:.2f} | {u['profile_ms']:.1f} | {u['t1_ms']:.1f} | "
            f"{u['t2_ms']:.1f} ({100 * u['t2_spread']:.0f} %) | "
            f"{u['pred_profile_ms']:.1f} ({100 * u['time_err_profile']:.0f} %) | "
            f"{u['pred_t1_ms']:.1f} ({100 * u['time_err_t1']:.0f} %) |"
        )
    lines += [
        "",
        (
            "| model | unit | params predicted | params measured (err) | saved: profile / t=1 | "
            "saved predicted from profile (err) | from t=1 (err) | saved measured |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for u in units:
        lines.append(
            f"| {u['model']} | {u['unit']} | {u['params_pred']} | {u['params_meas']} "
            f"({100 * u['params_err']:.1f} %) | {u['saved_profile']} / {u['saved_t1']} | "
            f"{u['saved_pred_profile']} ({100 * u['saved_err_profile']:.1f} %) | "
            f"{u['saved_pred_t1']} ({100 * u['saved_err_t1']:.1f} %) | {u['saved_meas']:.0f} |"
        )
    s = result["summary"]
    lines += ["", "| figure | median | worst |", "|---|---|---|"]
    for key in (
        "time_err_profile", "time_err_t1", "params_err", "saved_err_profile", "saved_err_t1",
        "t2_spread",
    ):  # fmt: skip
        lines.append(f"| {key} | {100 * s[key][0]:.1f} % | {100 * s[key][1]:.1f} % |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--microbatch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-o", "--output", default=str(HERE / "results.json"))
    ap.add_argument(
        "--from-rows", action="store_true", help="summarise out/rows.json again, measure nothing"
    )
    args = ap.parse_args()
    started = time.time()
    raw = HERE / "out" / "rows.json"
    if args.from_rows:  # the measurements of an earlier run, modelled again
        saved = json.loads(raw.read_text())
        env, ar, rows, failed = saved["machine"], saved["allreduce"], saved["rows"], saved["failed"]
        args = argparse.Namespace(**{**saved["args"], "output": args.output})
    else:
        env = machine()
        fits = []
        rows = []
        failed = {}
        for r in range(args.rounds):
            fits.append(allreduce_fit())  # each round, beside its units: the host drifts
            for name in args.models:
                if name in failed:
                    continue
                print(f"round {r + 1}/{args.rounds}: {name}", flush=True)
                try:
                    rows += one_round(
                        name, args.d_model, args.seq_len, args.microbatch, args.repeats
                    )
                except (PipeplanError, RuntimeError) as exc:  # the harness cannot split it
                    failed[name] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        env["uptime_after"] = machine()["uptime"]
        ar = {
            "rounds": fits,
            **{
                k: statistics.median(f[k] for f in fits)
                for k in ("alpha_s_per_byte", "beta_s", "o_tp_s")
            },
        }
        raw.parent.mkdir(exist_ok=True)
        kept = {k: v for k, v in vars(args).items() if k not in ("output", "from_rows")}
        raw.write_text(
            json.dumps(
                {"machine": env, "allreduce": ar, "rows": rows, "failed": failed, "args": kept}
            )
        )
    units = summarise(
        rows, ar["alpha_s_per_byte"], ar["beta_s"], args.microbatch, ar.get("o_tp_s", 0.0)
    )
    keys = ("time_err_profile", "time_err_t1", "params_err", "saved_err_profile", "saved_err_t1")
    summary = {
        key: (statistics.median(u[key] for u in units), max(u[key] for u in units))
        for key in (*keys, "t2_spread")
    }
    result = {
        "command": "python -m benchmarks.tp_units.main " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k not in ("output", "from_rows")
        ),
        "machine": env, "model": MODEL, "allreduce": ar, "failed": failed, "units": units,
        "summary": summary,
        "wall_s": time.time() - started,
    }  # fmt: skip
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(tables(result))
    if failed:
        print("failed:", json.dumps(failed, indent=1))


if __name__ == "__main__":
    main()
