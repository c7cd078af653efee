"""The argument list of a `pipeplan` run, shared by test_cli and test_compare."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def cli_argv(
    command: str, source: Path | str, out: Path, options: str = "", *, args: Sequence[str] = ()
) -> list[str]:
    """``COMMAND SOURCE OPTIONS ARGS -o OUT``: ``options`` split at spaces, ``args`` as given."""
    return [command, str(source), *options.split(), *args, "-o", str(out)]
