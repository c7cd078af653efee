"""torchrun with its ranks forked from an agent that has already imported torch's pipelining.

``python -m pipeplan.runtime.forkrun [--preload M[,M ...]] [torchrun's options] (-m MODULE |
SCRIPT) [ARGS ...]``
runs what ``python -m torch.distributed.run`` with the same arguments runs: torchrun's own
parser (:func:`torch.distributed.run.parse_args`), configuration
(:func:`~torch.distributed.run.config_from_args`) and elastic agent
(:func:`~torch.distributed.launcher.api.elastic_launch`): the same rendezvous, environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...), failure summary, error files and
``OMP_NUM_THREADS``.  Only the ranks start differently: torchrun's agent starts each rank as a
new interpreter (:class:`~torch.distributed.elastic.multiprocessing.api.SubprocessContext`),
which imports torch and ``torch.distributed.pipelining`` again, 3.2 CPU seconds a rank on a
2-core host (``torch._dynamo`` and ``torch.distributed.tensor`` come with pipelining); here the
agent imports them once (:data:`PRELOAD`, and the modules ``--preload`` names, such as the
model's: one that fails to import is left to the ranks, which report it) and forks its ranks
(``--start-method fork``, the agent's
:class:`~torch.distributed.elastic.multiprocessing.api.MultiprocessContext`), each of which then
runs the module or script as ``__main__`` with torchrun's ``sys.argv``.  A 2-rank job that only
joins its process group: 9-10 CPU s under torchrun, 4 under forkrun.

Forking is safe here because the agent has touched no accelerator and started no Python thread
when it forks: it has only imported modules and started torch's rendezvous store.  One of
torch's launcher calls would touch CUDA: :class:`~torch.distributed.launcher.api.LaunchConfig`
asks ``torch.cuda.is_available()``, whose default answer initializes the CUDA driver and
registers torch's fork handler, after which every forked rank fails its first CUDA call
("Cannot re-initialize CUDA in forked subprocess").  The agent asks it with
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (torch's fork-safe check, through NVML), and the ranks get
the environment back as it was (:data:`NVML_SET`).  Each rank
starts a session of its own (``os.setsid``), as torchrun's ranks do (``start_new_session``):
a signal to the terminal's process group reaches the agent, which stops its ranks, not the
ranks directly.  Its ``/proc/<pid>/cmdline`` is the agent's, which names the rank's module.
One thing differs in a failure: the agent's summary names the first rank it sees end, not
every rank that failed; :mod:`pipeplan.runtime.worker` makes a rank whose error a peer's death
caused wait a second before it exits, so that the root cause is the one named.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import signal
import sys
import uuid
from collections.abc import Sequence

__all__ = ["FORKED", "NVML_SET", "PRELOAD", "fork_safe_cuda_check", "main", "run_rank"]

#: Set to ``1`` in a forked rank's environment.  A rank must end by returning (or
#: ``sys.exit(0)``), not ``os._exit(0)``: the agent waits for each rank's return value.
FORKED = "PIPEPLAN_FORKED_RANK"

#: Set in the agent's environment when it set ``PYTORCH_NVML_BASED_CUDA_CHECK`` itself, so that
#: a rank removes both (:func:`run_rank`).
NVML_SET = "PIPEPLAN_FORKRUN_SET_NVML_CHECK"
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"

#: What the agent imports before it forks: what every pipeplan rank imports first.
PRELOAD = ("torch", "torch.distributed.pipelining", "pipeplan.runtime.engine")


def run_rank(module: bool, target: str, *args: str) -> None:
    """A forked rank: a session of its own, the signal handlers of a new interpreter (the
    agent's would turn torchrun's SIGTERM into an exception a rank blocked in a collective
    never raises), then ``target`` (a module with ``module``, else a
    script path) as ``__main__`` with ``sys.argv = [target, *args]``.  ``sys.exit(0)`` ends
    the rank as a return does; any other exit status is the rank's."""
    if os.getsid(0) != os.getpid():
        os.setsid()
    os.environ[FORKED] = "1"
    if os.environ.pop(NVML_SET, None):
        os.environ.pop(NVML_CHECK, None)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # not the agent's handlers
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if threads := os.environ.get("OMP_NUM_THREADS"):  # torch read it when the agent imported it
        import torch

        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):  # as torchrun's ``python -u``
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise


def fork_safe_cuda_check() -> None:
    """Make ``torch.cuda.is_available()`` in this process ask NVML, which leaves the CUDA driver
    uninitialized and the process safe to fork (module docstring), unless the user chose."""
    if NVML_CHECK not in os.environ:
        os.environ[NVML_CHECK] = "1"
        os.environ[NVML_SET] = "1"


def main(argv: Sequence[str] | None = None) -> None:
    """Parse torchrun's arguments, import :data:`PRELOAD`, and run torchrun's agent with a
    forked rank per local rank (module docstring)."""
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    fork_safe_cuda_check()  # before LaunchConfig and the preloads ask torch.cuda.is_available()
    rest = list(sys.argv[1:] if argv is None else argv)
    preload = list(PRELOAD)
    if rest[:1] == ["--preload"] and len(rest) > 1:
        preload += [m for m in rest[1].split(",") if m]
        rest = rest[2:]
    args = torchrun.parse_args(rest)
    if args.no_python or args.run_path:
        print("error: forkrun forks Python ranks: drop --no-python and --run-path, or use "
              "torchrun", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    if args.standalone:  # as torch.distributed.run.run does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = (
            "c10d",
            "localhost:0",
            str(uuid.uuid4()),
        )
    if args.master_port is None:
        args.master_port = 29500
    config, _, cmd_args = torchrun.config_from_args(args)  # sets OMP_NUM_THREADS as torchrun
    config.start_method = "fork"
    for name in preload:
        if name in PRELOAD:
            importlib.import_module(name)
        else:  # the rank imports it again and reports what fails
            with contextlib.suppress(Exception):
                importlib.import_module(name)
    # config_from_args's command line: ["-u", ("-m",) target, *args]
    rest = cmd_args[1:]
    module = rest[0] == "-m"
    target, *script_args = rest[1:] if module else rest
    sys.stdout.flush()
    sys.stderr.flush()
    elastic_launch(config=config, entrypoint=run_rank)(module, target, *script_args)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
