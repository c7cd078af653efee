"""What a save says when a rank cannot write its part: the system's words, whichever library
raised (``saving._why``); the multi-rank runs are in ``test_runtime_faults.py``."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from safetensors import SafetensorError

from pipeplan.runtime import saving


def test_a_full_disk_is_named_whichever_library_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    assert saving._why(full, tmp_path) == "No space left on device"
    said = SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )
    assert saving._why(said, tmp_path) == "No space left on device"
    silent = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    monkeypatch.setattr(saving, "FULL_DISK_BYTES", 0)  # a disk with room: the library's words
    assert saving._why(silent, tmp_path) == (
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
    )
    monkeypatch.setattr(saving, "FULL_DISK_BYTES", 1 << 62)  # a disk with no room left
    assert saving._why(silent, tmp_path) == "No space left on device"
