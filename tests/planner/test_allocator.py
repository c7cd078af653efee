import ctypes
import platform

import pytest

from pipeplan.planner import allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_heap_applies_every_setting_with_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    real = ctypes.CDLL

    class Recording:
        def __init__(self, name: str) -> None:
            self._lib = real(name)
            outer = self

            def mallopt(param: int, value: int) -> int:
                calls.append((param, value))
                return int(outer._lib.mallopt(param, value))

            self.mallopt = mallopt

    monkeypatch.setattr(allocator.ctypes, "CDLL", Recording)
    allocator.keep_heap.cache_clear()
    try:
        assert allocator.keep_heap() is True
    finally:
        allocator.keep_heap.cache_clear()
    assert dict(calls) == allocator.SETTINGS
    assert allocator.SETTINGS[-1] >= 1 << 30  # trim threshold: freed memory stays mapped


def test_keep_heap_is_false_without_a_c_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    allocator.keep_heap.cache_clear()
    try:
        assert allocator.keep_heap() is False
    finally:
        allocator.keep_heap.cache_clear()
