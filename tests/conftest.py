"""Fixtures shared across the test packages."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pipeplan.cli import main

CliRunner = Callable[[list[str]], tuple[int, str, str]]


@pytest.fixture(autouse=True)
def _pipeplan_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test (and every process it starts) keeps its calibrations in a directory of its own:
    one left on the developer's machine, or by another test, must not change what it plans."""
    monkeypatch.setenv("PIPEPLAN_HOME", str(tmp_path_factory.mktemp("home")))


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
