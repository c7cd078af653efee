"""This host's resources, as every floor reads them: cores, threads per rank, memory, a port.

``pipeplan run`` gives each of R local ranks ``cores // R`` threads (at least 1), with
``cores`` the CPUs this process may run on (its affinity).  ``pipeplan profile`` on CPU times
with :func:`threads_per_rank` of :data:`PROFILE_RANKS` ranks unless told ``--threads``: the
fewest ranks a pipeline has, so that a 2-stage run on this host (and, on a host of at most 2
cores, any run) uses the threads the profile was measured with.  Where a plan's stage count
gives each rank other threads, :func:`threads_mismatch` says so, at ``plan`` and at ``run``
(docs/profiling.md).  :func:`busy_host` says when other jobs loaded the host while a profile
was measured.
"""

from __future__ import annotations

import os
import socket

__all__ = [
    "PROFILE_RANKS",
    "busy_host",
    "cores",
    "free_port",
    "host_available_bytes",
    "threads_mismatch",
    "threads_per_rank",
]

#: The ranks ``pipeplan profile`` shares this host's cores among by default.
PROFILE_RANKS = 2


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def threads_per_rank(local_ranks: int) -> int:
    """CPU threads per rank: this host's cores shared evenly among ``local_ranks`` ranks."""
    return max(1, cores() // max(1, local_ranks))


def threads_mismatch(profiled: int | None, per_rank: int) -> str | None:
    """The warning when a profile measured with ``profiled`` threads is run with ``per_rank``
    threads per rank, or ``None`` when they agree (or the profile is not a CPU one).

    >>> threads_mismatch(2, 2) is None, threads_mismatch(None, 1) is None
    (True, True)
    >>> print(threads_mismatch(2, 1))
    the profile was measured with 2 thread(s) but each rank runs 1; predictions assume 2 (profile with --threads 1, or run with --threads 2)
    """
    if profiled is None or profiled == per_rank:
        return None
    return (
        f"the profile was measured with {profiled} thread(s) but each rank runs {per_rank}; "
        f"predictions assume {profiled} (profile with --threads {per_rank}, or run with "
        f"--threads {profiled})"
    )


def busy_host(
    before: float, after: float, threads: int, n_cores: int, rounds: int = 1
) -> str | None:
    """The warning when other jobs loaded the host while a CPU profile was measured, or
    ``None``: the load average ``before`` the measurement, or ``after`` it less the profile's
    own ``threads``, exceeds the ``n_cores - threads`` cores left free for it.  Times measured
    so mislead (a sweep of 17 vision models profiled under load mispredicted by a median of
    +158 %, on an idle host by +2 to +18 %); ``--rounds`` takes medians over bursts.

    >>> busy_host(0.1, 1.1, 1, 2) is None
    True
    >>> print(busy_host(7.5, 8.0, 1, 2))
    the host was busy while profiling: load average 7.5 on 2 cores, of which 1 is left free for the profile's 1 thread(s); its times may mislead (profile on an idle host, or with --rounds 3 to take medians over bursts)
    """
    others = max(before, after - threads)
    free = n_cores - threads
    if others <= free:
        return None
    remedy = "--rounds 3" if rounds < 3 else f"more --rounds than {rounds}"
    return (
        f"the host was busy while profiling: load average {others:.1f} on {n_cores} cores, of "
        f"which {free} {'is' if free == 1 else 'are'} left free for the profile's {threads} "
        f"thread(s); its times may mislead (profile on an idle host, or with {remedy} to take "
        f"medians over bursts)"
    )


def host_available_bytes() -> int:
    """The host's ``MemAvailable`` (``/proc/meminfo``; physical memory where there is none)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def free_port() -> int:
    """A TCP port on this host that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
