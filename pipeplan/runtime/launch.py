"""``pipeplan run``: check a plan against its model, start torchrun on this machine, and report.

Before anything starts, :func:`preflight` loads the plan and the model, traces the model and
compares the graph fingerprint and unit names with the plan's, so a plan for another model, a
missing model, an impossible device request or a save to resume made on another mesh fails in a
second with one line (exit 2).

:func:`launch` then runs ``python -m pipeplan.runtime.forkrun --standalone --nproc-per-node P -m
pipeplan.runtime.worker ...`` with one rank per stage: torchrun's own agent, whose ranks are
forked from it once it has imported torch's pipelining (:mod:`pipeplan.runtime.forkrun`).  If a rank raises or dies, torchrun's agent stops
the others and exits non-zero; :func:`failure` reads the ranks' error files and names the stage
that failed first (an error caused by a peer's death, such as a closed connection, is not the
root cause), and :func:`launch` raises :class:`~pipeplan.planner.errors.StageFailedError`.

While the job runs, :func:`pipeplan.runtime.supervise.supervise` forwards SIGTERM, SIGINT and
SIGHUP to torchrun and every rank, and ends the job when a rank stops beating for ``--timeout``
seconds (stopped or frozen); the error then names the signal and the step, or the stalled stage.
The job also ends with ``pipeplan run`` itself: torchrun gets SIGTERM when its parent dies
(:func:`~pipeplan.runtime.supervise.die_with_parent`) and each rank watches the launcher's pid
(``PIPEPLAN_LAUNCHER``, :mod:`pipeplan.runtime.worker`).  A ``--save`` folder is held by a
lock while the job runs (:mod:`pipeplan.runtime.save_lock`); a job stopped by a signal or a
failure leaves no partial save in it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeplan.planner.errors import InvalidRequestError, StageFailedError
from pipeplan.planner.families import stages_of_rank
from pipeplan.planner.io import load_plan
from pipeplan.planner.types import Plan
from pipeplan.report.progress import progress_bar
from pipeplan.runtime.error_files import read_errors
from pipeplan.runtime.save_lock import check_free, hold
from pipeplan.runtime.stage_errors import rank_label
from pipeplan.runtime.supervise import die_with_parent, forwarded_signals, process_start, supervise

__all__ = ["check_source", "failure", "launch", "preflight", "preloads", "worker_command"]


def preflight(
    plan_path: str | os.PathLike[str],
    *,
    model: str | None = None,
    model_args: Sequence[str] = (),
    device: str = "cpu",
    threads: int | None = None,
    outputs: Sequence[str | os.PathLike[str] | None] = (),
    resume: str | os.PathLike[str] | None = None,
    save: str | os.PathLike[str] | None = None,
    weights: str | os.PathLike[str] | None = None,
) -> Plan:
    """Everything that can be checked before launching; raises a PipeplanError naming the fix.
    ``resume``: the save the run continues, which must have been made on the plan's mesh;
    ``save``: the folder it saves into; neither may be one a live job still writes;
    ``weights``: a checkpoint that must hold every tensor of the model, shape and dtype as the
    plan runs it (read from its header)."""
    import torch

    from pipeplan.intake.graph import group_units
    from pipeplan.intake.meta import trace_meta
    from pipeplan.intake.model import load_model, parse_model_args
    from pipeplan.intake.spec import cast_batch, cast_floating
    from pipeplan.intake.trace import trace_model
    from pipeplan.runtime.stages import check_plan, check_schedule

    plan = load_plan(plan_path)
    check_schedule(plan)
    for option, folder in (("--resume", resume), ("--save", save)):
        if folder is not None:
            check_free(option, folder)
    if resume is not None:
        from pipeplan.runtime.saving import check_mesh, mesh_record
        from pipeplan.runtime.snapshots import resolve

        folder, manifest = resolve(Path(resume))
        if manifest is not None:
            check_mesh(folder, manifest, mesh_record(plan))
    for out in outputs:
        if out is not None and not Path(out).resolve().parent.is_dir():
            raise InvalidRequestError(f"cannot write {out}: its directory does not exist")
    if threads is not None and threads < 1:
        raise InvalidRequestError(f"--threads {threads} must be at least 1")
    if device not in ("cpu", "cuda"):
        raise InvalidRequestError(f"--device {device!r} is not cpu or cuda")
    if device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        ranks = plan.pipeline_ranks * plan.cluster.data_parallel * plan.cluster.tensor_parallel
        if have < ranks:
            raise InvalidRequestError(
                f"the plan needs {ranks} ranks but this machine has {have} CUDA devices; "
                f"run on CPU (--device cpu) or launch across machines with torchrun"
            )
    kwargs: dict[str, Any] = dict(plan.model_kwargs) if model is None else {}
    kwargs.update(parse_model_args(list(model_args)))
    if model is None:
        check_source(plan)
    # a model of more than REAL_BUILD_BYTES of parameters is built and traced on meta, so
    # that the launcher holds none of its weights (a 70B model is 280 GB in float32); a
    # smaller one is built for real, which traces faster than fake tensors do
    on_meta = _param_bytes(plan) > REAL_BUILD_BYTES
    spec = load_model(model or plan.model, kwargs, meta=on_meta)
    if plan.cluster.tensor_parallel > 1:  # the model must split t ways: one line, exit 2
        from pipeplan.intake.tp_sequence import hidden_size
        from pipeplan.runtime.loss import vocab_size
        from pipeplan.runtime.mesh import tensor_parallel_styles

        styles = tensor_parallel_styles(spec.module, plan.cluster.tensor_parallel)
        if plan.cluster.sequence_parallel:
            hidden_size(spec.module, styles)
        if plan.cluster.loss_parallel:
            vocab_size(spec.module, styles)
    dtype = getattr(torch, plan.dtype)
    module = cast_floating(spec.module, dtype)
    inputs, _ = cast_batch(*spec.batch(plan.microbatch_size), dtype, torch.device("cpu"))
    traced = (trace_meta if on_meta else trace_model)(module, inputs, tracer=plan.tracer)
    check_plan(plan, traced, group_units(traced, plan.granularity, plan.unit_expansions))
    if weights is not None:
        from pipeplan.runtime.weights import check_weights

        check_weights(Path(weights), module)
    return plan


#: The parameter bytes up to which ``preflight`` builds the model for real.
REAL_BUILD_BYTES = 2 << 30


def _param_bytes(plan: Plan) -> float:
    """The model's parameter bytes, from the plan's per-rank memory: each stage's parameters
    over the data-parallel mode's factor (:func:`~pipeplan.planner.collectives.state_factors`),
    times the tensor-parallel degree (an upper bound where TP leaves a part whole)."""
    from pipeplan.planner.collectives import state_factors

    factor = state_factors(plan.optimizer, plan.cluster).params
    per_rank = sum(s.memory.params for s in plan.stages) / factor
    return per_rank * plan.cluster.tensor_parallel


def _ranks(plan: Plan) -> str:
    """``4 stages``, or ``2 ranks x 2 stages`` for a plan of several stages per rank."""
    v = plan.stages_per_rank
    return f"{plan.n_stages} stages" if v == 1 else f"{plan.pipeline_ranks} ranks x {v} stages"


def check_source(plan: Plan) -> None:
    """Refuse an ``hf:`` config file that changed since the plan was made (its SHA-256)."""
    if plan.model_sha256 is None or not plan.model.startswith("hf:"):
        return
    from pipeplan.intake.hf_source import file_sha256
    from pipeplan.planner.errors import FingerprintMismatchError

    path = Path(plan.model[3:])
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise InvalidRequestError(f"the plan's model config {path} does not exist")
    if file_sha256(path) != plan.model_sha256:
        raise FingerprintMismatchError(
            f"{path} changed since the plan was made (SHA-256 {plan.model_sha256[:12]}..., now "
            f"{file_sha256(path)[:12]}...); profile and plan it again"
        )


def preloads(model: str) -> list[str]:
    """What the agent imports for the ranks besides torch's pipelining
    (:mod:`pipeplan.runtime.forkrun`): ``transformers`` for an ``hf:`` model, the module of
    one of pipeplan's own models.  A user's module is left to the ranks: its import may start
    threads or an accelerator, which a fork does not survive."""
    from pipeplan.intake.model import model_module

    module = model_module(model)
    return [module] if module == "transformers" or module.startswith("pipeplan.") else []


def worker_command(plan: Plan, plan_path: str | os.PathLike[str], args: Sequence[str]) -> list[str]:
    """The torchrun command line for one machine, one rank per stage and replica: torchrun's
    agent with forked ranks (:mod:`pipeplan.runtime.forkrun`)."""
    preload = preloads(plan.model)
    return [
        sys.executable,
        "-m",
        "pipeplan.runtime.forkrun",
        *(["--preload", ",".join(preload)] if preload else []),
        "--standalone",
        "--nproc-per-node",
        str(plan.pipeline_ranks * plan.cluster.data_parallel * plan.cluster.tensor_parallel),
        "--monitor-interval",
        "0.1",
        "-m",
        "pipeplan.runtime.worker",
        str(plan_path),
        *args,
    ]


_FAILURE = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)[^\n]*?(SIG\w+)?\)?\s*$",
    re.MULTILINE,
)


def _exit_codes(log: str) -> dict[int, str]:
    """Rank -> exit code (and signal) from torchrun's failure summary."""
    codes: dict[int, str] = {}
    for m in _FAILURE.finditer(log):
        codes.setdefault(int(m.group(1)), m.group(2) + (f" ({m.group(3)})" if m.group(3) else ""))
    return codes


def failure(
    run_dir: Path,
    n_ranks: int,
    returncode: int | None,
    log: str,
    frozen: dict[int, float] | None = None,
    n_stages: int | None = None,
    chunks: list[list[int]] | None = None,
    tensor_parallel: int = 1,
) -> StageFailedError:
    """The error to raise for a failed run: the stage that failed first and why.

    ``n_stages``: the pipeline ranks p; with ``tensor_parallel`` t, global rank g runs
    pipeline rank (g // t) mod p (``Plan.layout``), which the message names with the global
    rank where they differ (``stage 1 (rank 3)``); ``chunks``: for a plan of several stages
    per rank, each pipeline rank's stages, which the message names (``rank 0 (stages 0 and
    3)``) rather than one stage.

    In order: the earliest error a rank raised itself; else a rank that stopped beating
    (``frozen``: rank -> seconds without a heartbeat; stopped or frozen, its peers timed out
    waiting for it); else the one rank that left no error file (it died: killed, ``os._exit``,
    out of memory) and that torchrun did not stop itself; else the earliest error caused by a
    peer; else the tail of torchrun's log.
    """
    errors = read_errors(run_dir)
    own = sorted((e for e in errors if not e.get("peer")), key=lambda e: e.get("time", 0))
    codes = _exit_codes(log)
    silent = sorted(set(range(n_ranks)) - {int(e["stage"]) for e in errors})
    # the agent's summary gives a rank's exit code: SIGTERM (-15) is the agent stopping it;
    # forkrun's agent lists only the first rank it saw end, so a silent rank it does not list
    # was stopped too where another silent rank is listed
    listed = [r for r in silent if r in codes and not codes[r].startswith("-15")]
    died = listed or [r for r in silent if not codes.get(r, "").startswith("-15")] or silent

    t, p = tensor_parallel, n_stages or n_ranks

    def who(rank: int) -> str | None:
        """``rank 0 (stages 0 and 3)`` for a rank holding several chunks, ``stage 1 (rank
        3)`` where the global rank is not the stage, else ``None``."""
        if chunks:
            return rank_label(rank, chunks[(rank // t) % len(chunks)])
        stage = (rank // t) % p
        return None if stage == rank else f"stage {stage} (rank {rank})"

    def consequence(culprit: int) -> str:
        others = sorted({int(e["stage"]) for e in errors} - {culprit})
        if not others:
            return ""
        names = ", ".join(map(str, others))
        what = "rank" if chunks else "stage"
        return f" ({what}{'s' if len(others) > 1 else ''} {names} stopped as a consequence)"

    if own:
        e = own[0]
        at = f" at step {e['step']}" if e.get("step") is not None else ""
        if e.get("located"):  # its message names the stage and the step: not "stage N failed"
            return StageFailedError(
                e["message"] + consequence(int(e["stage"])), rank_traceback=e.get("traceback")
            )
        request = all(o.get("request") for o in own)  # refused before the first step
        if len(own) == n_ranks > 1 and len({(o["type"], o["message"]) for o in own}) == 1:
            # the same error on every rank (the model run once on each to build the stages)
            return StageFailedError(
                f"every stage failed{at}: {e['type']}: {e['message']}",
                bad_request=request,
                rank_traceback=e.get("traceback"),
            )
        name = who(int(e["stage"])) or f"stage {e['stage']}"
        return StageFailedError(
            f"{name} failed{at}: {e['type']}: {e['message']}" + consequence(int(e["stage"])),
            bad_request=request,
            rank_traceback=e.get("traceback"),
        )
    if frozen:
        rank = min(frozen, key=lambda r: -frozen[r])  # the one silent longest
        name = who(rank) or f"stage {rank} (rank {rank})"
        return StageFailedError(
            f"{name} stopped making progress: no heartbeat for "
            f"{frozen[rank]:.0f} s (the process is stopped or frozen); the job was stopped"
            + consequence(rank)
        )
    if len(died) == 1:
        stage = died[0]
        code = f" with exit code {codes[stage]}" if stage in codes else ""
        native = next(
            (" ".join(line.split())[:300] for line in log.splitlines()
             if "what():" in line or "terminate called" in line),
            None,
        )  # fmt: skip
        why = f": {native}" if native else " (killed, os._exit or out of memory?)"
        name = who(stage) or f"stage {stage}"
        return StageFailedError(
            f"{name} died{code} without a Python error{why}{consequence(stage)}"
        )
    if errors:
        e = min(errors, key=lambda e: e.get("time", 0))
        name = who(int(e["stage"])) or f"stage {e['stage']}"
        return StageFailedError(f"{name} failed: {e['type']}: {e['message']}")
    tail = " | ".join(line.strip() for line in log.strip().splitlines()[-5:])
    return StageFailedError(f"torchrun exited with status {returncode}: {tail}")


def watch(
    proc: subprocess.Popen[Any], poll: Callable[[], None], timeout_s: float | None = None
) -> int | None:
    """Wait for ``proc``, calling ``poll`` every quarter second and once more after it ends
    (to read its progress); its exit status, or ``None`` after killing it at ``timeout_s``."""
    start = time.monotonic()
    while True:
        try:
            code: int | None = proc.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            code = None
        poll()
        if code is not None:
            return code
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            proc.kill()
            proc.wait()
            return None


def launch(
    plan: Plan,
    plan_path: str | os.PathLike[str],
    worker_args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    steps: int = 0,
    progress: bool = False,
    timeout_s: float = 300.0,
    save: str | os.PathLike[str] | None = None,
) -> None:
    """Run the worker under torchrun; raise :class:`StageFailedError` if any rank fails, a
    rank stalls for ``timeout_s`` or a signal stops the job.

    Rank 0's standard output (the comparison table) is passed through; torchrun's and the
    ranks' standard error are kept and shown only when the cause of a failure is unknown.
    With ``progress``, a bar on stderr follows rank 0 through its ``steps`` steps (warm-up
    included).  ``save``: the run's ``--save`` folder, locked while the job runs; the partial
    save a stopped or failed job leaves there is removed.
    """
    ranks = plan.pipeline_ranks * plan.cluster.data_parallel * plan.cluster.tensor_parallel
    env = {**(os.environ if env is None else env), "PIPEPLAN_LAUNCHER": str(os.getpid())}
    env["PIPEPLAN_LAUNCHER_START"] = str(process_start(os.getpid()))  # the ranks' watchdog
    with hold(save), tempfile.TemporaryDirectory(prefix="pipeplan-run-") as tmp:
        run_dir = Path(tmp)
        cmd = worker_command(plan, plan_path, [*worker_args, "--run-dir", str(run_dir)])
        log_path, step_file = run_dir / "torchrun.log", run_dir / "progress"
        with open(log_path, "w") as log, progress_bar(progress and steps > 0) as bar:
            task = bar.add_task(f"{_ranks(plan)}: starting", total=steps)

            def poll() -> None:
                try:
                    step = int(step_file.read_text())
                    bar.update(task, completed=step, description=f"{_ranks(plan)}: step")
                except (OSError, ValueError):  # not started, or being written
                    pass

            with forwarded_signals() as received:  # before the job starts: none is missed
                proc = subprocess.Popen(
                    cmd, stdout=None, stderr=log, env=env, start_new_session=True,
                    preexec_fn=die_with_parent(),  # noqa: PLW1509 - prepared before the fork
                )  # fmt: skip
                outcome = supervise(proc, run_dir, ranks, poll, timeout_s, received)

            if outcome.code == 0:
                bar.update(task, completed=steps)
        if outcome.agent_killed and outcome.code is not None:
            name = signal.Signals(-outcome.code).name
            raise StageFailedError(f"torchrun ended by {name}; every rank ended")
        if outcome.signal is not None:
            name = signal.Signals(outcome.signal).name
            at = f" at step {outcome.step}" if outcome.step is not None else " before step 1"
            raise StageFailedError(
                f"stopped by {name}{at}: torchrun and every rank ended", signal=outcome.signal
            )
        finished = all((run_dir / f"done-{r}").exists() for r in range(ranks))
        if outcome.code != 0 and finished:  # a rank failed in its process group's teardown
            print(f"note: a rank exited with status {outcome.code} after every rank finished "
                  "the run (in its process group's teardown); its results stand",
                  file=sys.stderr)  # fmt: skip
        elif outcome.code != 0:
            raise failure(
                run_dir,
                ranks,
                outcome.code,
                log_path.read_text(),
                outcome.frozen,
                plan.pipeline_ranks,
                _chunks(plan),
                plan.cluster.tensor_parallel,
            )


def _chunks(plan: Plan) -> list[list[int]] | None:
    """Each pipeline rank's stages, for a plan of several stages per rank."""
    p, v = plan.pipeline_ranks, plan.stages_per_rank
    if v == 1:
        return None
    return [sorted(stages_of_rank(plan.schedule, p, v, r)) for r in range(p)]
