"""Profile a 7B-class Llama unit by unit, plan it, and check the plans' memory by hand.

    PYTHONPATH=. .venv/bin/python -m benchmarks.profile_units.main [--skip-7b] [--skip-compare]

1. **7B profile.**  ``pipeplan profile hf:benchmarks/profile_units/config.json --batch-size 32
   --microbatch-sizes 1 --seq-len 128 --method units`` (32 layers, hidden 4096, intermediate 11008, 32 heads, vocab
   32000, float32, micro-batch 1) in a child process: its wall time and its peak resident
   memory (``ru_maxrss`` of that child, from ``os.wait4``).  Goals: at most 10 minutes and
   6 GiB.  Only micro-batch size 1 is measured; the batch of 32 lets the plans pipeline 32
   micro-batches (with one, every partition has the same step time).
2. **Plans.**  ``pipeplan plan --stages P --memory 80GiB`` (Adam, the defaults otherwise) for
   P = 8 and 16, and each stage's predicted memory (parameters, gradients, optimizer state,
   activations) against a hand count made here from ``config.json`` alone, independently of
   the profile: the stage's parameters by formula (below), as many bytes again of gradients,
   two Adam states, and its units' activations by formula, for as many micro-batches as the
   plan's schedule keeps in flight (:func:`stage_rows`).
3. **Whole against units** on a model that fits (the bundled GPT at its default size, batch 8,
   one thread, 3 rounds): whole, units, whole again, and per unit and micro-batch size the
   ratio of the units method's forward + backward to the mean of the two whole profiles';
   median and spread, with the second whole profile's ratio to the first as the host's drift.

Hand count (float32, 4 bytes; h hidden, i intermediate, V vocab, T tokens, n heads, kv heads):

- decoder layer: q and o 2 h^2, k and v 2 h (kv h / n), gate, up and down 3 h i, two RMSNorms
  2 h; the embedding V h; the final norm h and the head V h (untied).
- a layer saves for backward, per token: its input and the attention norm's output (2 h), q, k,
  v and the rotated q, k (5 h), the attention's output and the o projection's input (2 h),
  the residual sum and the MLP norm's output (2 h), gate, up, silu(gate) and their product
  (4 i); and the attention probabilities, n T per token.  The head saves its norm's input and
  output (2 h) and the logits (V); the embedding the token ids.

Writes ``results.json`` beside this file and prints the README's tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIG = HERE / "config.json"
GiB = 1 << 30
STAGES = (8, 16)
SEQ = 128
#: The mini-batch the plans split into micro-batches of 1 (m = 32); only size 1 is profiled.
BATCH = 32


def _pipeplan(*args: str) -> tuple[float, int]:
    """Run ``pipeplan ARGS`` in a child; (wall seconds, its peak resident bytes)."""
    exe = Path(sys.executable).with_name("pipeplan")
    start = time.perf_counter()
    proc = subprocess.Popen([str(exe), *args], cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"pipeplan {' '.join(args)} failed")
    return wall, usage.ru_maxrss * 1024  # KiB on Linux


def hand_count(config: dict[str, Any], seq: int = SEQ) -> dict[str, dict[str, int]]:
    """Bytes of parameters, of one micro-batch's (one sample's) saved activations and of its
    input, by part of the model (``layer``, ``embed``, ``head``; the head's activations include
    the loss's), from the config alone (module docstring)."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", n)
    hd = h // n
    f = 4
    layer = 2 * h * h + 2 * h * (hd * kv) + 3 * h * i + 2 * h
    hidden = f * seq * (h + 2 * hd)  # the hidden state, and rotary cos and sin
    return {
        "layer": {
            "params": f * layer,
            "activations": f * seq * (11 * h + 4 * i + n * seq),
            "input": hidden,
        },
        "embed": {"params": f * v * h, "activations": 8 * seq, "input": 8 * seq},
        "head": {"params": f * (v * h + h), "activations": f * seq * (2 * h + v), "input": hidden},
    }


def _part(unit: str) -> str:
    if "layers." in unit:
        return "layer"
    return "embed" if "embed" in unit else "head"


def stage_rows(plan: dict[str, Any], hand: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Per stage: the plan's memory at its peak and the hand count (GiB).  The hand count
    takes the plan's choices (m, schedule, which stages recompute, and whether the peak is the
    first backward, where no gradient exists yet: the plan's ``grads`` is then 0) and its own
    bytes: the parameters, Adam's two states, the gradients at the peak, and the activations
    the peak holds: a recomputing stage one micro-batch's, another stage those of the q
    micro-batches in flight (GPipe: m; one fewer at a later backward)."""
    p, m = len(plan["stages"]), plan["microbatches"]
    rows = []
    for st in plan["stages"]:
        j = st["index"]
        q = m if plan["schedule"] == "gpipe" else min(m, p - j)
        mem = st["memory"]
        first = mem["grads"] == 0
        later = q if plan["schedule"] == "1f1b" and m > q else q - 1
        parts = [_part(u) for u in st["unit_names"]]
        params = sum(hand[x]["params"] for x in parts)
        acts = sum(hand[x]["activations"] for x in parts)
        held = acts if st["recompute"] else (q if first else later) * acts
        grads = 0 if first else params
        other = sum(mem.get(k, 0) for k in
                    ("stashed_inputs", "gradient_buffers", "outputs", "transient"))  # fmt: skip
        rows.append({
            "stage": j,
            "units": f"{st['unit_names'][0]} .. {st['unit_names'][-1]}",
            "layers": parts.count("layer"),
            "recompute": st["recompute"],
            "peak": "first backward" if first else "later backward",
            "plan": {**{k: mem[k] / GiB for k in
                        ("params", "grads", "optimizer", "activations", "total")},
                     "other": other / GiB},
            "hand": {"params": params / GiB, "grads": grads / GiB, "optimizer": 2 * params / GiB,
                     "activations": held / GiB, "total": (3 * params + grads + held) / GiB},
        })  # fmt: skip
    return rows


def profile_7b(out: Path) -> dict[str, Any]:
    profile = out / "llama7b.profile.json"
    wall, rss = _pipeplan(
        "profile", f"hf:{CONFIG.relative_to(ROOT)}", "--batch-size", str(BATCH),
        "--microbatch-sizes", "1", "--seq-len", str(SEQ), "--method", "units", "--quiet",
        "-o", str(profile),
    )  # fmt: skip
    data = json.loads(profile.read_text())
    measured = [u["name"] for u in data["units"] if u.get("measured_as") is None]
    hand = hand_count(json.loads(CONFIG.read_text()))
    result: dict[str, Any] = {
        "wall_s": wall,
        "peak_rss_bytes": rss,
        "units": len(data["units"]),
        "measured": measured,
        "layer_timing": data["units"][1]["timings"]["1"],
        "layer_param_bytes": data["units"][1]["param_bytes"],
        "hand": hand,
        "plans": {},
    }
    for p in STAGES:
        plan_path = out / f"llama7b.plan{p}.json"
        _pipeplan("plan", str(profile), "--stages", str(p), "--memory", "80GiB",
                  "--checkpoint", "except_last", "-o", str(plan_path))  # as recorded  # fmt: skip
        plan = json.loads(plan_path.read_text())
        result["plans"][p] = {
            "microbatches": plan.get("microbatches"),
            "schedule": plan.get("schedule"),
            "stages": stage_rows(plan, hand),
        }
    return result


def compare(threads: int = 1) -> dict[str, Any]:
    """Whole against units on the bundled GPT: per-unit ratios of forward + backward."""
    import torch

    from pipeplan.profiler import profile_model

    opts: dict[str, Any] = {"batch_size": 8, "rounds": 3, "threads": threads, "progress": False}
    torch.manual_seed(0)
    whole = profile_model("pipeplan.models.gpt:gpt", method="whole", **opts)
    units = profile_model("pipeplan.models.gpt:gpt", method="units", **opts)
    again = profile_model("pipeplan.models.gpt:gpt", method="whole", **opts)  # the host's drift
    ratios: dict[str, list[float]] = {}
    drift: dict[str, list[float]] = {}
    rows = []
    for uw, uu, ua in zip(whole.units, units.units, again.units):
        for b in whole.microbatch_sizes:
            tw, tu, ta = (u.timings[b].forward_s + u.timings[b].backward_s for u in (uw, uu, ua))
            r = tu / ((tw + ta) / 2)
            ratios.setdefault(str(b), []).append(r)
            drift.setdefault(str(b), []).append(ta / tw)
            rows.append({"unit": uw.name, "b": b, "measured_as": uu.measured_as,
                         "whole_s": tw, "units_s": tu, "whole_again_s": ta, "ratio": r})  # fmt: skip
    every = [r for rs in ratios.values() for r in rs]

    def stats(xs: list[float]) -> dict[str, float]:
        q1, med, q3 = np.percentile(xs, [25, 50, 75])
        return {"median": med, "q1": q1, "q3": q3, "min": min(xs), "max": max(xs), "n": len(xs)}

    def total(p: Any, b: int) -> float:
        return sum(u.timings[b].forward_s + u.timings[b].backward_s for u in p.units)

    def wholes(b: int) -> float:
        return (total(whole, b) + total(again, b)) / 2

    return {
        "model": "pipeplan.models.gpt:gpt (defaults)",
        "options": opts,
        "units": len(whole.units),
        "measured": sum(u.measured_as is None for u in units.units),
        "by_size": {b: stats(rs) for b, rs in ratios.items()},
        "whole_again_by_size": {b: stats(rs) for b, rs in drift.items()},
        "all": stats(every),
        "sum_ratio": {str(b): total(units, b) / wholes(b) for b in whole.microbatch_sizes},
        "update_adam_ratio": 2
        * units.update_s["adam"]
        / (whole.update_s["adam"] + again.update_s["adam"]),
        "rows": rows,
    }


def _print(results: dict[str, Any]) -> None:
    big = results.get("llama7b")
    if big:
        print(f"7B profile: {big['wall_s'] / 60:.1f} min, peak RSS {big['peak_rss_bytes'] / GiB:.2f}"
              f" GiB, {big['units']} units, measured {big['measured']}")  # fmt: skip
        for p, plan in big["plans"].items():
            print(f"\n{p} stages (m = {plan['microbatches']}, {plan['schedule']}), GiB plan / hand")
            print("| stage | units | layers | peak at | params | grads | Adam | activations "
                  "| buffers, outputs, working (plan) | total |")  # fmt: skip
            print("|---:|---|---:|---|---:|---:|---:|---:|---:|---:|")
            for r in plan["stages"]:
                pl, hd = r["plan"], r["hand"]
                print(
                    f"| {r['stage']} | {r['units']} | {r['layers']} | {r['peak']} "
                    f"| {pl['params']:.2f} / {hd['params']:.2f} "
                    f"| {pl['grads']:.2f} / {hd['grads']:.2f} "
                    f"| {pl['optimizer']:.2f} / {hd['optimizer']:.2f} "
                    f"| {pl['activations']:.3f} / {hd['activations']:.3f} "
                    f"| {pl['other']:.3f} "
                    f"| {pl['total']:.2f} / {hd['total']:.2f} |"
                )
    cmp_ = results.get("compare")
    if cmp_:
        print(f"\nwhole vs units, {cmp_['model']}: units / mean whole, forward + backward per unit")
        for b, s in cmp_["by_size"].items():
            print(f"b={b}: median {s['median']:.2f}, IQR {s['q1']:.2f}-{s['q3']:.2f}, "
                  f"range {s['min']:.2f}-{s['max']:.2f} (n={s['n']}); "
                  f"sum {cmp_['sum_ratio'][str(b)]:.2f}")  # fmt: skip
            d = cmp_["whole_again_by_size"][b]
            print(f"     whole again / whole: median {d['median']:.2f}, "
                  f"IQR {d['q1']:.2f}-{d['q3']:.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-7b", action="store_true")
    ap.add_argument("--skip-compare", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = HERE / "results.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if not args.skip_7b:
        results["llama7b"] = profile_7b(args.out)
    if not args.skip_compare:
        results["compare"] = compare()
    import torch

    results["versions"] = {"python": sys.version.split()[0], "torch": torch.__version__}
    path.write_text(json.dumps(results, indent=2, default=float) + "\n")
    _print(results)


if __name__ == "__main__":
    main()
