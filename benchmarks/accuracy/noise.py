"""The accuracy benchmark's own repeatability: how far the two halves of one run disagree.

    .venv/bin/python -m benchmarks.accuracy.noise benchmarks/accuracy/results/run17-rounds.csv

Round r of a configuration gives the ratio q_r = measured_r / bracketed_r: the round's median
step over the mean of the predictions from the profiles taken just before and just after it.
The bracketed error of the configuration is median_r(q_r) - 1.  With the rounds split into a
first and a second half,

    split = |mean(q, first half) / mean(q, second half) - 1|

is how far the same plan, predicted from the same kind of profile and measured the same way,
moved between the halves of one run: the noise floor.  A cost model whose errors are within the
split cannot be told from an exact one by this benchmark.

Across runs (``--across``, the runs' ``runN.csv``): a configuration's error that is the cost
model's own comes back run after run, with one sign; noise does not.  Per configuration,

    bias = median over runs of its signed bracketed error,

with the runs' least and greatest error beside it, and ``agree`` the share of runs whose error
has the bias's sign.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

CONFIG = ["model", "stages", "m", "checkpoint"]


def split_halves(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: ``split`` (above), ``spread`` (max q / min q - 1) and ``error``
    (|median q - 1|, the bracketed error), from a ``rounds.csv`` frame (columns ``round``,
    ``measured_ms``, ``before_ms``, ``after_ms`` and the configuration's)."""
    q = rounds.assign(q=rounds["measured_ms"] / ((rounds["before_ms"] + rounds["after_ms"]) / 2))
    rows = []
    for key, group in q.sort_values("round").groupby(CONFIG, sort=False):
        v = group["q"].to_numpy()
        half = len(v) // 2
        if half == 0:
            continue
        first, second = float(np.mean(v[:half])), float(np.mean(v[len(v) - half :]))
        rows.append(
            {
                **dict(zip(CONFIG, key, strict=True)),
                "split": abs(first / second - 1),
                "spread": float(v.max() / v.min() - 1),
                "error": abs(float(np.median(v)) - 1),
            }
        )
    return pd.DataFrame(rows)


def summary(halves: pd.DataFrame, limit: float = 0.15) -> dict[str, float]:
    """Median, 90th percentile and worst split, and how many configurations' split and error
    exceed ``limit``."""
    return {
        "configurations": len(halves),
        "split_median": float(halves["split"].median()),
        "split_p90": float(halves["split"].quantile(0.9)),
        "split_worst": float(halves["split"].max()),
        "split_over": int((halves["split"] > limit).sum()),
        "error_over": int((halves["error"] > limit).sum()),
    }


def across_runs(runs: list[pd.DataFrame]) -> pd.DataFrame:
    """Per configuration over several runs' result frames (column ``bracketed_error``):
    ``bias``, ``least``, ``greatest`` and ``agree`` (see the module docstring), and ``runs``,
    how many runs measured it.  Sorted by |bias|, largest first."""
    frame = pd.concat(runs, ignore_index=True)
    errors = frame.groupby(CONFIG)["bracketed_error"]
    out = pd.DataFrame({"bias": errors.median(), "least": errors.min(), "greatest": errors.max()})
    out["runs"] = errors.count()
    bias = frame.join(out["bias"], on=CONFIG)["bias"]
    agrees = np.sign(frame["bracketed_error"]) == np.sign(bias)
    out["agree"] = agrees.groupby([frame[c] for c in CONFIG]).mean()
    return out.reindex(out["bias"].abs().sort_values(ascending=False).index).reset_index()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="rounds.csv files of accuracy runs")
    ap.add_argument("--limit", type=float, default=0.15)
    ap.add_argument(
        "--across", action="store_true", help="the files are runN.csv: per-configuration bias"
    )
    args = ap.parse_args()
    if args.across:
        bias = across_runs([pd.read_csv(path) for path in args.files])
        large = bias["bias"].abs()
        print(bias.head(10).round(3).to_string(index=False))
        print(
            f"configurations: {len(bias)}; |bias| > 5 %: {int((large > 0.05).sum())}, "
            f"> 10 %: {int((large > 0.10).sum())}, > {args.limit:.0%}: "
            f"{int((large > args.limit).sum())}; median |bias| {large.median():.1%}"
        )
        return
    rows = []
    for path in args.files:
        s = summary(split_halves(pd.read_csv(path)), args.limit)
        rows.append({"run": path.name, **s})
    print(pd.DataFrame(rows).round(3).to_string(index=False))


if __name__ == "__main__":
    main()
