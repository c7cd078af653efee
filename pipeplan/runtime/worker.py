"""One rank of ``pipeplan run``: ``python -m pipeplan.runtime.worker PLAN [options]`` under torchrun.

``pipeplan run`` starts it for one machine; for several machines start it with your own
launcher, one rank per stage, e.g. on each of two nodes::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint HOST:29500 \\
        -m pipeplan.runtime.worker plan.json --steps 20 --report report.json

Rank j runs stage j (rank (r p + j) t + k for replica r and tensor-parallel index k of a
plan with replicas and tensor parallelism, :mod:`pipeplan.runtime.mesh`), or, for a plan of v chunks per rank (interleaved, looped, zero-bubble,
V), the v stages :func:`pipeplan.planner.families.stages_of_rank` names.  By default (``--init stage``) every rank builds the model on ``meta``
and materializes only its stages' modules (:mod:`pipeplan.intake.meta`), initialised from ``--seed``
and each module's name, so the values do not depend on the split; or it reads them from
``--weights`` (:mod:`pipeplan.runtime.checkpoint`).  ``--init full`` builds the whole model on every
rank, seeded with ``--seed`` (for models whose graph needs real values to be cut).
``--save DIR`` saves the run at its end, and every ``--save-every K`` steps, into step folders
made visible whole (:mod:`pipeplan.runtime.saving`): weights one shard per rank (its
stages' tensors by the model's names, each once; whole under FSDP2), each rank's
optimizer and RNG states (its own shards under FSDP2), the step; ``--keep K`` keeps the K saves made last.  ``--resume DIR`` continues a saved run from its latest
complete save.  Rank 0 gathers the measurements, writes the run report (``--report``) and the
Chrome trace (``--trace``), and prints measured vs predicted.

A plan whose rank count is not the world size, a missing model or a plan made for another
model stops every rank before the pipeline starts, with one line and status 2.

Failures: a rank that raises writes ``error-<rank>.json`` (stage, error, traceback;
:mod:`pipeplan.runtime.error_files`) into ``--run-dir`` when one is given, prints one line and
exits with status 1; torchrun then stops the other ranks, and a rank blocked on a dead peer
fails on the closed connection or, at the latest, at the process group's ``--timeout``.  A rank also ends itself (status 143, as SIGTERM)
within half a second of losing its launcher: when its parent (torchrun) changes, or when the
``pipeplan run`` named by ``PIPEPLAN_LAUNCHER`` (pid) and ``PIPEPLAN_LAUNCHER_START`` is gone
(:func:`_watchdog`).  With ``--run-dir``, each rank also keeps a
heartbeat there (``beat-<rank>``: pid, step, time, rewritten every 0.5 s by a thread), from
which ``pipeplan run`` tells a stopped or frozen rank from one waiting on it.

Messages number steps as the save folders do: "at step N" is the N-th step (counting those a
resumed run restored), whose save would be ``step-N``; a failure during a save names the
folder being written.

For tests, ``PIPEPLAN_FAIL=STAGE:STEP[:MODE]`` makes stage STAGE fail before its first forward
of step STEP (0-based, warm-up included): MODE ``raise`` (default) raises a RuntimeError,
``exit`` calls ``os._exit(3)``, ``kill`` sends itself SIGKILL; at the save after step STEP
(1-based: the steps done), once the stage wrote its files, ``kill-save`` sends itself SIGKILL
and ``enospc`` raises ``OSError(ENOSPC)``, as a full disk would; ``teardown`` aborts after the
run's last barrier, as gloo's teardown can ("terminate called without an active exception").
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from pipeplan.planner.types import OPTIMIZERS
from pipeplan.runtime.error_files import PEER_LINGER_S, await_errors, is_peer_error, write_error
from pipeplan.runtime.forkrun import FORKED

if TYPE_CHECKING:
    from pipeplan.intake.spec import ModelSpec

__all__ = ["default_threads", "main", "parse_args"]

#: The step this rank is running (for the error message), ``None`` before the first.
_progress: dict[str, int | None] = {"step": None}


def default_threads(local_ranks: int) -> int:
    """CPU threads per rank: the cores this process may use, shared evenly among local ranks."""
    from pipeplan.planner.host import threads_per_rank

    return threads_per_rank(local_ranks)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m pipeplan.runtime.worker", description=__doc__.split("\n")[0]
    )
    ap.add_argument("plan", help="plan JSON written by `pipeplan plan`")
    ap.add_argument("--model", help="package.module:callable (default: the plan's model)")
    ap.add_argument("--model-arg", action="append", default=[], help="KEY=VALUE for the model")
    ap.add_argument("--steps", type=int, default=10, help="measured steps")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    ap.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per rank")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--report", help="run report JSON to write (rank 0)")
    ap.add_argument("--trace", help="Chrome-trace JSON of the last step to write (rank 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, s")
    ap.add_argument("--run-dir", help="directory for per-rank error files")
    ap.add_argument("--quiet", action="store_true", help="do not print the comparison table")
    ap.add_argument(
        "--init",
        default="auto",
        choices=("auto", "stage", "full"),
        help="build the model on meta and materialize only this rank's stage (stage), "
        "build the whole model on every rank (full), or stage unless something on meta has "
        "no initializer and the whole model fits in host memory (auto)",
    )
    ap.add_argument(
        "--weights",
        help="checkpoint to start from: .safetensors, torch state dict, or sharded folder",
    )
    ap.add_argument("--save", help="save the run here at its end (step folders, see above)")
    ap.add_argument("--save-every", type=int, default=0, help="also save every K steps")
    ap.add_argument("--keep", type=int, default=0, help="keep the K saves made last (0: all)")
    ap.add_argument("--resume", help="continue the run saved here (its latest complete save)")
    ap.add_argument(
        "--batch-norm",
        default="deferred",
        choices=("deferred", "microbatch"),
        help="running statistics once per step (deferred) or once per micro-batch",
    )
    return ap.parse_args(argv)


def _whole_build_needed(spec: ModelSpec, local_world: int, rank: int) -> bool:
    """``--init auto``: whether to build the whole model on every rank, as ``--init full``.

    Yes when a ``meta`` parameter or buffer has no initializer (a bare ``cls_token``: a
    stage-local build would refuse it) and ``local_world`` copies of the model's parameters fit
    in half the host's available memory; every rank decides the same from the whole model, so
    a tied parameter gets one value.  Otherwise the stage-local build goes on (and refuses,
    naming the tensor, where one has no initializer).
    """
    from pipeplan.intake.meta import uninitialised
    from pipeplan.planner.host import host_available_bytes

    missing = uninitialised(spec.module, spec.init_weights)
    if not missing:
        return False
    params = {id(p): p for p in spec.module.parameters()}.values()
    need = local_world * sum(p.numel() * p.element_size() for p in params)
    fits = 2 * need <= host_available_bytes()
    if rank == 0:
        what = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        how = (
            "every rank builds the whole model (--init full)"
            if fits
            else f"the whole model ({local_world} x {need // local_world} bytes) does not fit "
            "in host memory, so each rank builds its stage"
        )
        print(f"note: nothing initialises {what} on meta; {how}", flush=True)  # shown
    return fits


def _injected(rank: int) -> tuple[int, str, str] | None:
    """This rank's ``PIPEPLAN_FAIL`` (see the module docstring) as (step, mode, the whole
    spec), or ``None`` where it names another rank or is not set."""
    spec = os.environ.get("PIPEPLAN_FAIL", "")
    if not spec:
        return None
    parts = spec.split(":")
    if int(parts[0]) != rank:
        return None
    return int(parts[1]) if len(parts) > 1 else 0, parts[2] if len(parts) > 2 else "raise", spec


def _fault_hook(rank: int) -> Callable[[int, int], None] | None:
    """The ``PIPEPLAN_FAIL`` hook of a step (modes ``raise``, ``exit`` and ``kill``), if any."""
    injected = _injected(rank)
    if injected is None or injected[1] not in ("raise", "exit", "kill"):
        return None
    step, mode, spec = injected

    def fault(at_step: int, microbatch: int) -> None:
        if at_step != step or microbatch != 0:
            return
        if mode == "exit":
            os._exit(3)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure (PIPEPLAN_FAIL={spec})")

    return fault


def _save_fault(rank: int) -> Callable[[int], None] | None:
    """The ``PIPEPLAN_FAIL`` hook of a save (modes ``kill-save`` and ``enospc``), if any."""
    injected = _injected(rank)
    if injected is None or injected[1] not in ("kill-save", "enospc"):
        return None
    step, mode, spec = injected

    def fault(at_step: int) -> None:
        if at_step != step:
            return
        if mode == "kill-save":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, f"No space left on device (injected: PIPEPLAN_FAIL={spec})")

    return fault


def _heartbeat(run_dir: str | None, rank: int, period_s: float = 0.5) -> Callable[[], bool]:
    """Rewrite ``beat-<rank>`` (pid, step, time) every ``period_s`` from a daemon thread: it
    stops when the process is stopped or frozen, not when it waits on a peer.  Returns the
    function that writes it, which each step also calls (so the step is current)."""
    lock = threading.Lock()
    if not run_dir:
        return lambda: False
    path, tmp = Path(run_dir) / f"beat-{rank}", Path(run_dir) / f".beat-{rank}.tmp"

    def write() -> bool:
        """Whether it was written (not when the run folder went away with the launcher)."""
        with lock:
            try:
                tmp.write_text(json.dumps([os.getpid(), _progress["step"], time.time()]))
                os.replace(tmp, path)
            except OSError:
                return False
        return True

    def beat() -> None:
        while write():
            time.sleep(period_s)

    threading.Thread(target=beat, name="pipeplan-heartbeat", daemon=True).start()
    return write


def _watchdog(period_s: float = 0.5) -> None:
    """End this rank (``os._exit(143)``) from a daemon thread once its launcher is gone: its
    parent changed (torchrun killed: the rank was handed to init) or the ``pipeplan run``
    that ``PIPEPLAN_LAUNCHER`` names ended (killed with SIGKILL, it could not stop the job)."""
    from pipeplan.runtime.supervise import process_start

    parent = os.getppid()
    launcher = int(os.environ.get("PIPEPLAN_LAUNCHER", "0") or 0)
    start = os.environ.get("PIPEPLAN_LAUNCHER_START", "")

    def gone() -> str | None:
        if os.getppid() != parent:
            return f"its parent (pid {parent}) ended"
        if launcher and str(process_start(launcher)) != start:
            return f"pipeplan run (pid {launcher}) ended"
        return None

    def watch() -> None:
        while (why := gone()) is None:
            time.sleep(period_s)
        rank = os.environ.get("RANK", "0")
        with contextlib.suppress(OSError, ValueError):
            print(f"error: rank {rank} stopped: {why}", file=sys.stderr, flush=True)
        os._exit(143)

    threading.Thread(target=watch, name="pipeplan-watchdog", daemon=True).start()


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost cause (PipelineStage wraps a stage's error in a RuntimeError); a pipeplan
    error that names the stage and unit is kept rather than the exception it explains."""
    from pipeplan.planner.errors import PipeplanError

    while exc.__cause__ is not None and not isinstance(exc, PipeplanError):
        exc = exc.__cause__
    return exc


def _preload(model: str) -> None:
    """Import what building and tracing the model will import (its module, transformers for
    an ``hf:`` config, torch.export and fake tensors), so the memory baseline counts it."""
    import importlib

    import torch._subclasses.fake_tensor
    import torch.export  # noqa: F401

    from pipeplan.intake.model import model_module

    try:
        importlib.import_module(model_module(model))
    except Exception:  # noqa: BLE001, S110 - load_model reports a model that does not import
        pass


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from pipeplan.intake.model import load_model, parse_model_args
    from pipeplan.planner.allocator import keep_heap
    from pipeplan.planner.errors import InvalidRequestError
    from pipeplan.planner.io import load_plan, write_json, write_text
    from pipeplan.runtime import saving
    from pipeplan.runtime.engine import PipelineRunner
    from pipeplan.runtime.memory import ResidentPeak
    from pipeplan.runtime.records import RankRecord, chrome_trace, gather_report, print_comparison

    rank = int(os.environ.get("RANK", "0"))
    _watchdog()
    beat = _heartbeat(args.run_dir, rank)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    cuda = args.device == "cuda"
    keep_heap()  # before the model and the steps allocate anything (see pipeplan.planner.allocator)
    threads = None
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        threads = args.threads or default_threads(local_world)
        torch.set_num_threads(threads)
        device = torch.device("cpu")
    plan = load_plan(args.plan)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    replicas, t = plan.cluster.data_parallel, plan.cluster.tensor_parallel
    p = plan.pipeline_ranks
    if world != p * replicas * t:
        v = plan.stages_per_rank
        what = f"{p} stages" if v == 1 else f"{p} ranks of {v} stages"
        tp = f" x {t} tensor-parallel ranks" if t > 1 else ""
        raise InvalidRequestError(
            f"{args.plan} has {what} x {replicas} replicas{tp} but the world size is {world}; "
            f"launch one rank per stage, replica and tensor-parallel rank (e.g. "
            f"--nproc-per-node {p * replicas * t})"
        )
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    kwargs = dict(plan.model_kwargs) if args.model is None else {}
    kwargs.update(parse_model_args(args.model_arg))
    resident = ResidentPeak()
    if not cuda:
        _preload(args.model or plan.model)
        resident.start()  # the libraries and the process group are loaded; the model is not
    torch.manual_seed(args.seed)
    spec = load_model(args.model or plan.model, kwargs, meta=args.init != "full")
    if (
        args.init == "auto"
        and not (args.weights or args.resume)
        and _whole_build_needed(spec, local_world, rank)
    ):
        torch.manual_seed(args.seed)
        spec = load_model(args.model or plan.model, kwargs)
    info = saving.run_info(plan, args.optimizer, args.lr, args.seed)
    resume, start = saving.resume_point(args.resume, info) if args.resume else (None, 0)
    runner = PipelineRunner(
        plan,
        spec,
        device=device,
        optimizer=args.optimizer,
        lr=args.lr,
        fault=_fault_hook(rank),
        batch_norm=args.batch_norm,
        seed=args.seed,
        weights=str(resume) if resume is not None else args.weights,
    )
    torch.manual_seed(args.seed + 1)
    inputs, target = spec.batch(plan.batch_size * replicas)  # the global batch
    if resume is not None:
        start = saving.restore(runner, resume)
    saved = [start]
    save_fault = _save_fault(rank)

    def after_step(done: int) -> None:
        if args.save and args.save_every > 0 and done % args.save_every == 0:
            _progress["step"] = done  # a failure now is the save of step-<done>'s
            saving.save(runner, args.save, done, info, save_fault, args.keep)
            saved[0] = done

    def on_step(step: int) -> None:
        if cuda and step == start + args.warmup:
            torch.cuda.reset_peak_memory_stats(device)
        _progress["step"] = step + 1  # the step under way, numbered as its save's folder
        beat()
        if rank == 0 and args.run_dir:  # the launcher's progress bar reads it
            (Path(args.run_dir) / "progress").write_text(str(step - start))

    record = runner.measure(
        inputs, target, RankRecord(stage=runner.rank, threads=threads, chunks=runner.chunks),
        warmup=args.warmup, steps=args.steps, on_step=on_step, start=start,
        after_step=after_step,
    )  # fmt: skip
    if cuda:
        record.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device))
    else:
        record.resident_growth_bytes = resident.growth()
    done = start + args.warmup + args.steps
    if args.save and saved[0] != done:
        _progress["step"] = done
        saving.save(runner, args.save, done, info, save_fault, args.keep)
    if args.weights and args.run_dir:  # what this rank read, for the tests
        write_text(Path(args.run_dir) / f"weights-{rank}.json", json.dumps(runner.checkpoint_reads))
    report = gather_report(plan, record, backend=backend, warmup_steps=args.warmup)
    if report is not None:
        if args.report:
            write_json(args.report, report)
        if args.trace:
            write_text(args.trace, json.dumps(chrome_trace(report, plan)) + "\n")
        if not args.quiet:
            from rich.console import Console

            print_comparison(report, plan, Console(width=None if sys.stdout.isatty() else 120))
    dist.barrier()
    if args.run_dir:  # every rank finished: a failure after this (teardown) loses nothing
        (Path(args.run_dir) / f"done-{rank}").touch()
    if (_injected(rank) or (0, "", ""))[1] == "teardown":
        os.abort()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        run(args)
    except BaseException as exc:  # every failure: error file, one line, non-zero exit
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        from pipeplan.planner.errors import PipeplanError

        cause = _root_cause(exc)
        step = _progress["step"]
        msg = " ".join(str(cause).split())[:500]
        code = 2 if isinstance(cause, PipeplanError) and step is None else 1  # 2: bad request
        if args.run_dir:
            write_error(Path(args.run_dir), rank, step, cause, code == 2)
        if code == 2:
            if rank == 0:
                print(f"error: {msg}", file=sys.stderr, flush=True)
        else:
            at = f" at step {step}" if step is not None else ""
            print(
                f"error: stage {rank} (rank {rank}) failed{at}: {type(cause).__name__}: {msg}",
                file=sys.stderr,
                flush=True,
            )
        import torch.distributed as dist

        if dist.is_initialized():  # do not wait for communication threads that may hang
            if is_peer_error(cause):
                # a peer died first: let the agent see that death before this exit, or a
                # forked rank's agent (pipeplan.runtime.forkrun, which reports only the first
                # rank it sees end) may name this one, and the dead peer's exit code is lost
                time.sleep(PEER_LINGER_S)
            elif getattr(cause, "collective", False) and args.run_dir:
                # every rank learnt this error in one collective: let them write theirs
                await_errors(Path(args.run_dir), dist.get_world_size())
            os._exit(code)
        sys.exit(code)


if __name__ == "__main__":
    main()
    # A clean run ends without the interpreter's finalization: Gloo's worker threads can still
    # hold work whose tensors reach back into Python, and tearing them down while the
    # interpreter goes away aborts the process now and then ("terminate called without an
    # active exception", SIGABRT; pytorch/pytorch#179291).  Every result is written by now.
    # A rank forked by pipeplan.runtime.forkrun returns instead: the agent waits for its
    # return value, and a fork ends without the interpreter's finalization anyway.
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get(FORKED) != "1":
        os._exit(0)
