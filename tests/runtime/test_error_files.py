"""The ranks' error files: written whole, read back, and waited for."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pipeplan.runtime.error_files import (
    any_error,
    await_errors,
    is_peer_error,
    read_errors,
    write_error,
)
from pipeplan.runtime.saving import CheckpointWriteError, PeerFailedError


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - the traceback of a raised error
        return caught


def test_an_error_file_says_who_failed_and_whether_a_peer_caused_it(tmp_path: Path) -> None:
    assert not any_error(tmp_path)
    write_error(tmp_path, 1, 2, _raised(CheckpointWriteError("stage 1 could not write")), False)
    write_error(tmp_path, 0, 2, _raised(PeerFailedError("stage 1 could not write")), False)
    write_error(tmp_path, 10, None, _raised(ValueError("bad  \n value")), True)
    (tmp_path / "error-3.json").write_text('{"rank": 3, "mess')  # torn: skipped
    errors = read_errors(tmp_path)
    assert any_error(tmp_path)
    assert [e["rank"] for e in errors] == [0, 1, 10]  # by rank, not by name
    peer, own, request = errors
    assert (own["located"], own["peer"], own["step"]) == (True, False, 2)
    assert (peer["located"], peer["peer"]) == (False, True)
    assert request["request"] and request["step"] is None and request["message"] == "bad value"
    assert "ValueError" in request["traceback"]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    ("exc", "peer"),
    [
        (PeerFailedError("x"), True),
        (RuntimeError("Connection closed by peer [127.0.0.1]:1234"), True),
        (RuntimeError("Timed out waiting 30000ms for recv operation"), True),
        (RuntimeError("boom"), False),
        (CheckpointWriteError("stage 1 could not write"), False),
    ],
)
def test_a_closed_or_timed_out_link_is_a_peer_error(exc: BaseException, peer: bool) -> None:
    assert is_peer_error(exc) is peer


def test_await_errors_returns_once_every_rank_wrote(tmp_path: Path) -> None:
    write_error(tmp_path, 1, 2, _raised(CheckpointWriteError("full")), False)

    def late() -> None:
        time.sleep(0.3)
        write_error(tmp_path, 0, 2, _raised(PeerFailedError("full")), False)

    thread = threading.Thread(target=late)
    start = time.monotonic()
    thread.start()
    assert await_errors(tmp_path, 2, timeout_s=10.0)
    took = time.monotonic() - start
    thread.join()
    assert 0.3 <= took < 5.0
    assert len(read_errors(tmp_path)) == 2


def test_await_errors_gives_up_after_its_timeout(tmp_path: Path) -> None:
    write_error(tmp_path, 1, 2, _raised(CheckpointWriteError("full")), False)
    start = time.monotonic()
    assert not await_errors(tmp_path, 2, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 2.0
