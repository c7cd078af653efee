"""Keep glibc's heap from handing a training step's memory back to the kernel between steps.

A training step allocates and frees the same buffers every step: activations, gradients
(``zero_grad(set_to_none=True)``), the optimizer's temporaries.  With glibc's defaults, freed
memory at the top of the heap is returned to the kernel (``M_TRIM_THRESHOLD``) and blocks
above a dynamic threshold are ``mmap`` ed afresh each time, so every step page-faults and
zeroes its memory again.  A profiler that times one unit in a tight loop reuses its memory
and never sees that cost; a rank that runs whole steps does.

Measured on the quality benchmark's uneven CNN, uniform 2-stage plan (2 ranks, gloo, one
thread each, 2-vCPU EPYC VM): 211-215 ms per step with the defaults, 172-173 ms with the
thresholds below, against 170 ms predicted.

:func:`keep_heap` sets, through ``mallopt``:

* ``M_TRIM_THRESHOLD`` = 1 GiB: free memory at the heap's top stays mapped;
* ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's maximum): smaller blocks come from the heap and are
  reused, larger ones are still ``mmap`` ed (setting it also stops glibc raising it on its own);
* ``M_TOP_PAD`` = 64 MiB: the heap grows in large steps.

It is what ``MALLOC_TRIM_THRESHOLD_`` and friends do from the environment, done in process
so that every rank gets it however it was launched.  Other C libraries (or a preloaded
jemalloc/tcmalloc) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["keep_heap"]

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

SETTINGS: dict[int, int] = {
    _M_TRIM_THRESHOLD: 1 << 30,
    _M_MMAP_THRESHOLD: 32 << 20,
    _M_TOP_PAD: 64 << 20,
}


@functools.cache
def keep_heap() -> bool:
    """Apply :data:`SETTINGS` with glibc's ``mallopt``; ``False`` where there is no glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
