"""Fixtures shared across the test packages."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pipeplan.cli import main

CliRunner = Callable[[list[str]], tuple[int, str, str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> CliRunner:
    """Run ``pipeplan ARGV`` in-process; returns (exit code, stdout, stderr)."""

    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run
