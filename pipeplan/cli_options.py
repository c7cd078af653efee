"""What ``pipeplan``'s commands share: their common options, and turning option strings into
the values :mod:`pipeplan.api` takes.

A string that does not parse is the user's error: ``fail`` prints one line ``error: ...`` and
exits with status 2, before any file is written.  ``check_output`` vets an output path,
``parse_pins`` the ``--pin`` options.  Every other check of a request is the API's (its
``InvalidRequestError``, which the entry point prints the same way).  Nothing here imports
more than typer, so ``pipeplan --help`` starts at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, NoReturn

import typer

__all__ = [
    "DEBUG",
    "USAGE_ERROR",
    "Output",
    "Quiet",
    "check_output",
    "fail",
    "parse_pins",
    "usage_line",
]

Output = Annotated[Path, typer.Option("-o", "--output", help="File to write (atomically).")]
"""The ``-o/--output`` option of the commands that write a file."""

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
"""The ``-q/--quiet`` option of the commands that take long (profile, calibrate, run)."""


#: click's UsageError (typer vendors click, and exports only its subclass BadParameter).
USAGE_ERROR: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError"
)


def usage_line(exc: Exception) -> str:
    """A usage error (a bad option value, a missing argument, an unknown option or command) in
    one line, naming the command's help: ``Missing argument 'PROFILE'; see pipeplan plan
    --help``."""
    names, ctx = [], getattr(exc, "ctx", None)
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    where = " ".join(["pipeplan", *reversed(names)])
    message = " ".join(getattr(exc, "format_message", exc.__str__)().split()).rstrip(".")
    return f"{message}; see {where} --help"


#: Whether the command line asked for tracebacks (``--debug`` or ``PIPEPLAN_DEBUG``; set by
#: :func:`pipeplan.cli.main`).
DEBUG = [False]


def fail(message: str) -> NoReturn:
    """Print ``error: MESSAGE`` on stderr and exit with status 2 (a user's error)."""
    from pipeplan.report.terminal import err_console

    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def check_output(path: Path) -> None:
    """``fail`` unless ``path`` can be written: not a directory, in a directory that exists."""
    if path.is_dir():
        fail(f"output {path} is a directory; give a file name such as {path / 'out.json'}")
    nearest = next((p for p in path.parents if p.exists()), Path("."))
    if not nearest.is_dir():
        fail(f"output {path}: {nearest} is a file, not a directory; give a path in a folder")
    if not path.parent.exists():
        fail(f"output directory {path.parent} does not exist; create it first")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        fail(f"output directory {path.parent} is not writable; give a folder you can write to")


def parse_pins(pins: list[str] | None) -> dict[int, int]:
    """``--pin UNIT:STAGE`` options as {unit: stage}; ``fail`` on one that is not two integers."""
    out: dict[int, int] = {}
    for pin in pins or []:
        unit, sep, stage = pin.partition(":")
        if not sep or not unit.isdigit() or not stage.isdigit():
            fail(f"--pin {pin!r} must be UNIT:STAGE with integers, e.g. --pin 0:0")
        out[int(unit)] = int(stage)
    return out
