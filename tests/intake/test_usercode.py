"""Errors in the user's code (:mod:`pipeplan.intake.usercode`): one line with the user's
file:line and exit 2 on the command line (the traceback with ``--debug``), a
:class:`~pipeplan.planner.errors.UserCodeError` in Python."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeplan.intake.model import load_model
from pipeplan.planner.errors import UserCodeError

FAST = ["--warmup", "0", "--repeats", "1", "--quiet"]
SOURCE = (Path(__file__).parent / "_user_code.py").read_text().splitlines()


def _line_of(tag: str) -> int:
    return next(i for i, line in enumerate(SOURCE, start=1) if tag in line)


ERRORS = {
    "callable_raises": ("the model callable _user_code:callable_raises raised KeyError", "BUG-CALLABLE"),
    "make_batch_raises": ("the model's make_batch(1) raised RuntimeError", "BUG-BATCH"),
    "loss_raises": ("the model's loss raised AttributeError", "BUG-LOSS"),
    "forward_raises": ("the model's forward (Net) raised RuntimeError", "BUG-FORWARD"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ERRORS))
def test_user_code_errors_are_one_line_with_file_and_line(tmp_path: Path, cli, name: str) -> None:
    out = tmp_path / "p.json"
    code, _, err = cli(["profile", f"_user_code:{name}", "-b", "2", *FAST, "-o", str(out)])
    what, tag = ERRORS[name]
    assert code == 2 and not out.exists()
    line = " ".join(err.split())
    assert line.startswith(f"error: {what}"), line
    assert re.search(rf"_user_code\.py:{_line_of(tag)}\)$", line), line
    assert "Traceback" not in err


def test_debug_shows_the_traceback(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["profile", "_user_code:loss_raises", "-b", "2", *FAST, "-o", str(tmp_path / "p.json")]
    code, _, err = cli([*argv, "--debug"])
    assert code == 2 and "Traceback" in err and "AttributeError" in err
    monkeypatch.setenv("PIPEPLAN_DEBUG", "1")
    code, _, err = cli(argv)
    assert code == 2 and "Traceback" in err


def test_user_errors_raise_user_code_error() -> None:
    with pytest.raises(UserCodeError, match=r"KeyError: 'vocab_size' \(.*_user_code\.py:\d+\)"):
        load_model("_user_code:callable_raises")
