"""What the benchmarks share: a description of the machine they ran on."""

from __future__ import annotations

import os
import platform
import subprocess

__all__ = ["machine"]


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
