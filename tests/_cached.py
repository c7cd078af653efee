"""A sweep computed once per test session, whichever xdist worker asks first.

A module-scoped fixture is rebuilt whenever pytest tears it down between two of its module's
tests (an xdist worker whose queue ran dry does), and a session-scoped one once per xdist
worker; the zoo's sweeps take minutes each, and the export tests' profiles are read by test
files that ``--dist loadfile`` sends to different workers: the first build is pickled under the
session's temporary root (the one its xdist workers share, never an earlier session's), behind
a file lock, and every later build reads it back.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from filelock import FileLock

T = TypeVar("T")


def once_per_session(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]
) -> T:
    """``build(folder)`` the first time in this test session, its pickle afterwards."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # .../pytest-N/popen-gwK: the session's is N
        root = root.parent
    cache = root / f"{name}.pkl"
    with FileLock(str(root / f"{name}.lock")):
        if cache.exists():
            return pickle.loads(cache.read_bytes())
        folder = root / name
        folder.mkdir(exist_ok=True)
        result = build(folder)
        cache.write_bytes(pickle.dumps(result))
        return result
