"""The command line answers at once: ``pipeplan --help``, a command's ``--help`` and a bad
option import neither torch nor pandas, matplotlib or OR-Tools (issue 41).

Each case runs ``python -X importtime -m pipeplan ...`` in a process of its own and reads the
modules it imported from the import-time lines on stderr, so a top-level import of torch in
``pipeplan/cli.py`` (or in anything it imports at the top) fails here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeplan.planner.io import write_json
from pipeplan.planner.synthetic import synthetic_profile

HEAVY = ("torch", "pandas", "matplotlib", "ortools")


def _imports(args: list[str]) -> tuple[int, str, set[str]]:
    """Exit code, stdout and stderr (without the import-time lines), every module imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    lines = proc.stderr.splitlines()
    names = {line.rpartition("|")[2].strip() for line in lines if line.startswith("import time:")}
    rest = "\n".join(line for line in lines if not line.startswith("import time:"))
    return proc.returncode, proc.stdout + rest, names


def _heavy(names: set[str]) -> list[str]:
    return sorted(n for n in names if n.split(".")[0] in HEAVY)


def test_the_check_sees_a_heavy_import() -> None:
    """Not vacuous: the import-time lines name torch when something imports it."""
    code, _, names = _imports(["-c", "import pipeplan.cli; import torch.nn"])
    assert code == 0 and "pipeplan.cli" in names
    assert "torch" in _heavy(names) and "torch.nn" in _heavy(names)


OUT = ["-o", "{tmp}/plan.json"]


@pytest.mark.parametrize(
    ("argv", "exit_code", "says"),
    [
        (["--help"], 0, "Usage"),
        (["plan", "--help"], 0, "--memory"),
        (["profile", "--help"], 0, "--batch-size"),
        (["run", "--help"], 0, "--steps"),
        (["plan", "{tmp}/missing.json", "--memory", "nonsense", *OUT], 2, "no such file"),
        (["plan", "{profile}", "-p", "2", "--memory", "nonsense", *OUT], 2, "memory 'nonsense'"),
        (["plan", "{profile}", "-p", "2", "--memory", "1GiB", "--solver", "x", *OUT], 2, "'x'"),
        (["plan", "{profile}", "--microbatches", "many", *OUT], 2, "--microbatches 'many'"),
        (["plan", "--no-such-option"], 2, "No such option"),
        (["show", "{tmp}/missing.json"], 2, "no such file"),
    ],
)
def test_help_and_bad_options_import_no_heavy_package(
    tmp_path: Path, argv: list[str], exit_code: int, says: str
) -> None:
    profile = tmp_path / "profile.json"
    write_json(profile, synthetic_profile(6, batch_size=8, seed=1))
    args = [a.format(tmp=tmp_path, profile=profile) for a in argv]
    code, err, names = _imports(["-m", "pipeplan", *args])
    assert code == exit_code, err
    assert "Traceback" not in err and not (tmp_path / "plan.json").exists()
    assert "pipeplan.cli" in names
    assert not _heavy(names), f"pipeplan {' '.join(argv)} imported {_heavy(names)[:5]}"
    if exit_code:
        assert says in err
    else:
        assert (
            says
            in subprocess.run(
                [sys.executable, "-m", "pipeplan", *args],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
