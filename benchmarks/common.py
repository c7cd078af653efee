"""What the benchmarks share: a description of the machine they ran on."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["machine", "models_parser", "pipeplan"]

_PIPEPLAN = [sys.executable, "-c", "from pipeplan.cli import main; main()"]


def pipeplan(*args: str) -> None:
    """Run ``pipeplan ARGS`` in a subprocess; raise with its error output if it fails."""
    # A benchmark plans with the cluster it names, never with a calibration left on the machine.
    env = {**os.environ, "PIPEPLAN_HOME": str(Path(__file__).parent / ".no-calibration")}
    proc = subprocess.run([*_PIPEPLAN, *args], capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"pipeplan {' '.join(args[:2])} failed: {proc.stderr[-2000:]}")


def models_parser(doc: str, models: Iterable[str], here: Path) -> argparse.ArgumentParser:
    """A benchmark's arguments: ``--models`` (a subset of ``models``) and ``-o`` (results)."""
    names = list(models)
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=names, choices=names)
    ap.add_argument("-o", "--output", default=str(here / "results.json"))
    return ap


def machine() -> dict[str, str]:
    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    cpu = next(
        (line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "uptime": subprocess.run(
            ["uptime"], capture_output=True, text=True, check=False
        ).stdout.strip(),
    }
