"""Time to stop ``pipeplan run`` under each fault, on 2 and 4 CPU ranks, and what survived.

The bundled MLP (``width=256, depth=8``) is profiled once and planned on 2 and on 4 stages
(GPipe, Adam).  Each run trains for many steps saving every 20 (``--save-every 20``); once its
first save is complete the fault is sent, and the time from the fault to the moment
``pipeplan run`` has exited with every torchrun and rank process gone is measured:

- ``SIGTERM`` to ``pipeplan run``; ``SIGINT`` to its process group;
- ``SIGKILL`` of the last rank;
- ``SIGSTOP`` of rank 1 (``--timeout 10``);
- ``ENOSPC`` in stage 1's part of the save after step 40 (injected: ``PIPEPLAN_FAIL``; time
  from the save of step 20 to the exit, so it includes 20 steps);
- ``--resume`` from a save whose first shard had one byte flipped (time of the refusal);
- ``SIGKILL`` of ``pipeplan run`` itself (the OOM killer) and ``SIGHUP`` (a closed terminal);
- ``SIGKILL`` of torchrun;
- a real full disk: the save folder on a tmpfs, shrunk (``mount -o remount,size=``) once the
  first save is complete to what it holds plus a quarter of a save, so the next save does not
  fit (needs root to mount; the row says so where it cannot).

``--only FAULT`` (repeatable) runs those faults alone and writes ``results-partial.json``.

After each, the save folder's ``latest`` is read back through every check of
``CheckpointReader`` (sizes, SHA-256, save ids).  Prints one JSON line per case and the
Markdown table, and writes ``results.json``.

    PYTHONPATH=. .venv/bin/python -m benchmarks.faults.main     # about 5 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine, pipeplan
from pipeplan.runtime.supervise import live_processes, parent_pid

HERE = Path(__file__).parent
_PIPEPLAN = [sys.executable, "-c", "from pipeplan.cli import main; main()"]
FAULTS = (
    "SIGTERM",
    "SIGINT",
    "SIGKILL rank",
    "SIGSTOP rank 1",
    "ENOSPC in a save",
    "corrupt shard",
    "SIGKILL launcher",
    "SIGHUP launcher",
    "SIGKILL torchrun",
    "full tmpfs",
)


def _pids(run_root: Path, ranks: int) -> dict[int, int]:
    out = {}
    for rank in range(ranks):
        for path in run_root.glob(f"pipeplan-run-*/beat-{rank}"):
            try:
                out[rank] = int(json.loads(path.read_text())[0])
            except (OSError, ValueError):
                pass
    return out


def _survived(save: Path) -> str:
    from pipeplan.planner.errors import ModelLoadError
    from pipeplan.runtime.checkpoint import CheckpointReader

    try:
        reader = CheckpointReader(save)
        for key in sorted(reader.keys()):
            reader.read(key)
    except ModelLoadError as exc:
        return f"damaged: {exc}"
    return f"{reader.folder.name} complete"


def _mount(folder: Path, size: str, *options: str) -> bool:
    folder.mkdir(exist_ok=True)
    opts = ",".join([*options, f"size={size}"])
    cmd = ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(folder)]
    return subprocess.run(cmd, check=False, capture_output=True).returncode == 0


def case(plan: Path, ranks: int, fault: str, work: Path) -> dict[str, Any]:
    save = work / "save"
    if fault == "full tmpfs":
        if not _mount(work / "disk", "256m"):
            return {"ranks": ranks, "fault": fault, "stop_s": 0.0, "status": None,
                    "message": "skipped: cannot mount a tmpfs (needs root)", "survived": "",
                    "left_behind": 0}  # fmt: skip
        save = work / "disk" / "save"
        try:
            return _case(plan, ranks, fault, work, save)
        finally:
            subprocess.run(["umount", str(work / "disk")], check=False)
    return _case(plan, ranks, fault, work, save)


def _case(plan: Path, ranks: int, fault: str, work: Path, save: Path) -> dict[str, Any]:
    env = {**os.environ, "TMPDIR": str(work), "OMP_NUM_THREADS": "1"}
    args = ["run", str(plan), "--quiet", "--warmup", "0", "--optimizer", "adam",
            "--save-every", "20", "--save", str(save)]  # fmt: skip
    if fault == "corrupt shard":
        subprocess.run([*_PIPEPLAN, *args, "--steps", "20"], check=True, env=env,
                       capture_output=True)  # fmt: skip
        shard = save / "step-000020" / f"model-00001-of-{ranks:05d}.safetensors"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        start = time.monotonic()
        resume = [*args[:7], "--steps", "1", "--resume", str(save)]  # no --save-every
        proc = subprocess.run([*_PIPEPLAN, *resume], env=env, capture_output=True, text=True,
                              check=False)  # fmt: skip
        shard.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF]))  # undo, to check the rest
        return _row(ranks, fault, time.monotonic() - start, proc.returncode, proc.stderr, save)
    extra = {"ENOSPC in a save": {"PIPEPLAN_FAIL": "1:40:enospc"}}.get(fault, {})
    timeout = ["--timeout", "10"] if fault == "SIGSTOP rank 1" else []
    popen = subprocess.Popen([*_PIPEPLAN, *args, "--steps", "1000000", *timeout],
                             env={**env, **extra}, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)  # fmt: skip
    while not (save / "latest").exists() and popen.poll() is None:
        time.sleep(0.02)
    start = time.monotonic()
    pids = _pids(work, ranks)
    if fault == "SIGTERM":
        popen.send_signal(signal.SIGTERM)
    elif fault == "SIGINT":
        os.killpg(popen.pid, signal.SIGINT)
    elif fault == "SIGKILL rank":
        os.kill(pids[ranks - 1], signal.SIGKILL)
    elif fault == "SIGSTOP rank 1":
        os.kill(pids[1], signal.SIGSTOP)
    elif fault == "SIGKILL launcher":
        popen.kill()
    elif fault == "SIGHUP launcher":
        popen.send_signal(signal.SIGHUP)
    elif fault == "SIGKILL torchrun":
        # torchrun's agent is pipeplan run's child; its ranks, its forks, share its command line
        agent = next(p for p in live_processes(str(save)) if parent_pid(p) == popen.pid)
        os.kill(agent, signal.SIGKILL)
    elif fault == "full tmpfs":  # room for what is there and a quarter of a save more
        disk = save.parent
        one = sum(
            f.stat().st_size for f in (save / (save / "latest").read_text().strip()).iterdir()
        )
        used = shutil.disk_usage(disk).used
        start = time.monotonic()
        _mount(disk, str(used + one // 4), "remount")
    _, err = popen.communicate(timeout=600)
    while live_processes(str(save)):
        time.sleep(0.02)
    return _row(ranks, fault, time.monotonic() - start, popen.returncode, err, save)


def _row(ranks: int, fault: str, took: float, code: int, err: str, save: Path) -> dict[str, Any]:
    return {
        "ranks": ranks,
        "fault": fault,
        "stop_s": round(took, 2),
        "status": code,
        "message": " ".join(err[err.find("error:") :].split())[:300],
        "survived": _survived(save),
        "left_behind": len(live_processes(str(save))),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| ranks | fault | time to stop | status | processes left | last save | message |",
             "|---:|---|---:|---:|---:|---|---|"]  # fmt: skip
    for r in rows:
        msg = r["message"].removeprefix("error: ")[:140]
        lines.append(f"| {r['ranks']} | {r['fault']} | {r['stop_s']:.1f} s | {r['status']} | "
                     f"{r['left_behind']} | {r['survived']} | {msg} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    only = [a for flag, a in zip(sys.argv[1:], sys.argv[2:], strict=False) if flag == "--only"]
    faults = [f for f in FAULTS if not only or f in only]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pipeplan-faults-") as tmp:
        work = Path(tmp)
        profile = work / "mlp.profile.json"
        pipeplan("profile", "pipeplan.models.mlp:mlp", "--model-arg", "width=256",
                 "--model-arg", "in_features=256", "--batch-size", "16", "--max-stages", "4",
                 "--warmup", "0", "--repeats", "1", "-o", str(profile))  # fmt: skip
        for ranks in (2, 4):
            plan = work / f"plan{ranks}.json"
            pipeplan("plan", str(profile), "--stages", str(ranks), "--memory", "64GiB",
                     "--microbatches", "4", "--schedule", "gpipe", "--optimizer", "adam",
                     "-o", str(plan))  # fmt: skip
            for i, fault in enumerate(faults):
                folder = work / f"r{ranks}-{i}"
                folder.mkdir()
                row = case(plan, ranks, fault, folder)
                print(json.dumps(row), flush=True)
                rows.append(row)
    out = {"machine": machine(), "rows": rows}
    name = "results-partial.json" if only else "results.json"
    (HERE / name).write_text(json.dumps(out, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
