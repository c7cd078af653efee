"""The supervisor's view of processes: what a stopped job may have left behind."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

from pipeplan.runtime.supervise import live_processes


def test_live_processes_finds_a_marked_process_until_it_is_reaped() -> None:
    marker = f"pipeplan-test-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        # Popen returns once exec has closed its error pipe, which Linux does before it sets the
        # new image's arguments: for that moment /proc/PID/cmdline reads empty, so poll.
        deadline = time.monotonic() + 10.0
        found = live_processes(marker)
        while not found and time.monotonic() < deadline:
            time.sleep(0.01)
            found = live_processes(marker)
        assert list(found) == [proc.pid] and marker in found[proc.pid]
    finally:
        proc.kill()
    proc.wait()  # reaped: gone from /proc
    assert live_processes(marker) == {}
    # a zombie (killed, not yet reaped) is not alive either
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    zombie.kill()
    for _ in range(200):
        if not live_processes(marker):
            break
        time.sleep(0.01)
    assert live_processes(marker) == {}
    zombie.wait()
