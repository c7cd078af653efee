"""The ``pipeplan`` commands that drive the runtime on this machine: ``run`` and ``calibrate``.

    pipeplan run plan.json [--steps N] [--report report.json] [--trace trace.json]
    pipeplan calibrate [--nproc P] [--device cpu|cuda] -o cluster.json

Both start torchrun jobs, one rank per stage.  ``pipeplan.cli`` registers them on its app; they
import what they use (the runtime, the tables) inside their functions, so other commands and
``pipeplan --help`` do not pay for torch.distributed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeplan.cli_options import DEBUG, Output, Quiet, check_output, fail

__all__ = ["calibrate", "check_resume", "run"]


def run(
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN", help="A plan JSON file.")],
    model: Annotated[str | None, typer.Option(help="Default: the plan's model.")] = None,
    model_arg: Annotated[
        list[str] | None,
        typer.Option("--model-arg", help="KEY=VALUE passed to the model callable."),
    ] = None,
    steps: Annotated[int, typer.Option(min=1, help="Measured steps.")] = 10,
    warmup: Annotated[int, typer.Option(min=0, help="Unmeasured steps first.")] = 2,
    optimizer: Annotated[
        str | None,
        typer.Option(help="sgd, momentum or adam; default: the plan's, whose update it timed."),
    ] = None,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 1e-3,
    threads: Annotated[int | None, typer.Option(help="CPU threads per rank.")] = None,
    report: Annotated[Path | None, typer.Option(help="Run report JSON to write.")] = None,
    trace: Annotated[Path | None, typer.Option(help="Chrome-trace JSON of the last step.")] = None,
    device: Annotated[str, typer.Option(help="cpu (gloo) or cuda (nccl).")] = "cpu",
    seed: Annotated[int, typer.Option(help="Seed for the model and the batch.")] = 0,
    timeout: Annotated[float, typer.Option(help="Process-group timeout, seconds.")] = 300.0,
    batch_norm: Annotated[
        str,
        typer.Option(
            help="BatchNorm running statistics: deferred (once per step, over the whole batch, "
            "as the unsplit model) or microbatch (once per micro-batch)."
        ),
    ] = "deferred",
    init: Annotated[
        str,
        typer.Option(
            help="stage: each rank builds the model on meta and materializes only its stage; "
            "full: each rank builds the whole model; auto: stage, unless something on meta has "
            "no initializer and the whole model fits in host memory, then full."
        ),
    ] = "auto",
    weights: Annotated[
        Path | None,
        typer.Option(
            help="Start from this checkpoint (.safetensors, torch state dict, or sharded "
            "folder with its index); each rank reads only its stage's tensors."
        ),
    ] = None,
    save: Annotated[
        Path | None,
        typer.Option(
            help="Save the run into this folder at its end: weights (sharded safetensors), "
            "optimizer and RNG states, step; each save is a step-N folder made visible whole, "
            "and DIR/latest names the newest."
        ),
    ] = None,
    save_every: Annotated[
        int, typer.Option(min=0, help="Also save every K steps (with --save).")
    ] = 0,
    keep: Annotated[
        int,
        typer.Option(
            min=0,
            help="Keep only the K saves made last in --save DIR, latest's always (0: keep all).",
        ),
    ] = 0,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Continue the run saved in this folder from its latest complete save (the "
            "newest complete one, said in one line, when the save 'latest' names is damaged; "
            "or from the step-N folder given); --steps counts the steps still to run."
        ),
    ] = None,
    quiet: Quiet = False,
) -> None:
    """Run PLAN as a pipeline on this machine (torchrun, one rank per stage); compare with it."""
    from pipeplan.planner.errors import StageFailedError
    from pipeplan.planner.types import OPTIMIZERS
    from pipeplan.report.terminal import batch_norm_note, console, err_console
    from pipeplan.runtime.launch import launch, preflight

    if optimizer is not None and optimizer not in OPTIMIZERS:
        fail(f"--optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if batch_norm not in ("deferred", "microbatch"):
        fail(f"--batch-norm {batch_norm!r} is not deferred or microbatch")
    if init not in ("auto", "stage", "full"):
        fail(f"--init {init!r} is not auto, stage or full")
    if weights is not None and not weights.exists():
        fail(f"--weights {weights} does not exist; pass a .safetensors file, a torch state "
             f"dict or a sharded checkpoint folder")  # fmt: skip
    if save is not None and save.exists() and not save.is_dir():
        fail(f"--save {save} is a file; pass a folder for the checkpoint's shards")
    if save_every and save is None:
        fail(f"--save-every {save_every} needs --save DIR, the folder to save into")
    if keep and save is None:
        fail(f"--keep {keep} needs --save DIR, the folder whose saves it keeps")
    if resume is not None and weights is not None:
        fail("--resume and --weights both say where to start; pass one")
    if resume is not None:
        resume = check_resume(resume)
    p = preflight(
        plan_file,
        model=model,
        model_args=model_arg or [],
        device=device,
        threads=threads,
        outputs=[report, trace],
        resume=resume,
        save=save,
        weights=weights,
    )
    if device == "cpu":
        from pipeplan.planner.host import threads_mismatch, threads_per_rank

        per_rank = threads or threads_per_rank(
            p.pipeline_ranks * p.cluster.data_parallel * p.cluster.tensor_parallel
        )
        if (warning := threads_mismatch(p.profiled_threads, per_rank)) is not None:
            err_console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    if optimizer is not None and optimizer != p.optimizer:
        err_console.print(
            f"[yellow]warning:[/] the plan was made for {p.optimizer} (its memory and update "
            f"time) but the run uses {optimizer}",
            highlight=False,
            soft_wrap=True,
        )
    if p.batch_dependent_layers:
        err_console.print(
            batch_norm_note(p.batch_dependent_layers, p.microbatches, batch_norm),
            highlight=False,
            soft_wrap=True,
        )
    optimizer = optimizer or p.optimizer
    args = [f"--batch-norm={batch_norm}", f"--init={init}"]
    args += [f"--weights={weights.resolve()}"] if weights else []
    args += (
        [f"--save={save.resolve()}", f"--save-every={save_every}", f"--keep={keep}"] if save else []
    )
    args += [f"--resume={resume.resolve()}"] if resume else []
    args += [f"--steps={steps}", f"--warmup={warmup}", f"--optimizer={optimizer}", f"--lr={lr}"]
    args += [f"--device={device}", f"--seed={seed}", f"--timeout={timeout}"]
    args += [f"--model={model}"] if model else []
    args += [f"--model-arg={a}" for a in model_arg or []]
    args += [f"--threads={threads}"] if threads else []
    args += [f"--report={report.resolve()}"] if report else []
    args += [f"--trace={trace.resolve()}"] if trace else []
    try:
        launch(
            p, plan_file.resolve(), args, steps=warmup + steps, progress=not quiet,
            timeout_s=timeout, save=save.resolve() if save else None,
        )  # fmt: skip
    except StageFailedError as exc:
        if exc.rank_traceback and DEBUG[0]:
            err_console.print(exc.rank_traceback, highlight=False, soft_wrap=True, markup=False)
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    for path, what in ((report, "report"), (trace, "trace"), (save, "weights")):
        if path:
            console.print(f"{what} -> {path}")


def check_resume(path: Path) -> Path:
    """The save to resume for ``--resume path``: ``path`` itself when it is a complete
    pipeplan save whose files are all there, whole and of the SHA-256 written (the ranks check
    the files they read again: a launch of your own torchrun has no preflight); when the save
    ``latest`` names is damaged, the newest complete one in the folder, said in one line;
    ``fail`` when there is none."""
    from pipeplan.planner.errors import ModelLoadError
    from pipeplan.report.terminal import err_console
    from pipeplan.runtime.snapshots import LATEST, committed_saves

    if not path.exists():
        fail(f"--resume {path} does not exist; pass the folder given to --save")
    try:
        _check_save(path)
        return path
    except ModelLoadError as exc:
        damaged = exc
    if (path / LATEST).is_file():  # a save root: its other saves, newest first
        for folder in committed_saves(path):
            try:
                _check_save(folder)
            except ModelLoadError:
                continue
            err_console.print(
                f"[yellow]warning:[/] --resume {path}: the save {LATEST} names is damaged "
                f"({damaged}); resuming from {folder.name}, the newest complete save",
                highlight=False,
                soft_wrap=True,
            )
            return folder
    fail(str(damaged))


def _check_save(path: Path) -> None:
    """Raise :class:`~pipeplan.planner.errors.ModelLoadError` unless ``path`` (a save root
    read at ``latest``, or a step folder) is a complete pipeplan save, every file whole."""
    from pipeplan.planner.errors import ModelLoadError
    from pipeplan.runtime.checkpoint import CheckpointReader
    from pipeplan.runtime.snapshots import check_file

    reader = CheckpointReader(path)
    if reader.manifest is None:
        raise ModelLoadError(
            f"--resume {path} is not a pipeplan save (no manifest.json); start from its "
            f"weights with --weights instead"
        )
    for name in reader.manifest["files"]:
        check_file(reader.folder, reader.manifest, name)


def calibrate(
    output: Output = Path("cluster.json"),
    nproc: Annotated[
        int, typer.Option(help="Ranks (= stages) to describe; 1: the engine alone, one device.")
    ] = 2,
    device: Annotated[str, typer.Option(help="cpu (gloo) or cuda (nccl).")] = "cpu",
    max_size: Annotated[str, typer.Option(help="Largest message, e.g. 16MiB.")] = "16MiB",
    repeats: Annotated[int, typer.Option(help="Round trips per size, and Adam steps.")] = 20,
    engine_repeats: Annotated[
        int, typer.Option(help="Pipeline steps per micro-batch count and round of the engine.")
    ] = 3,  # pipeplan.runtime.calibrate.ENGINE_REPEATS (imported lazily)
    launches: Annotated[
        int, typer.Option(help="Separate torchrun jobs; the cluster takes their medians.")
    ] = 3,
    solo_launches: Annotated[
        int, typer.Option(help="Launches of one rank alone, for 1-stage plans' engine cost.")
    ] = 2,
    widths: Annotated[
        list[int] | None,
        typer.Option(
            "--width",
            help="Width of the calibration stages' layers, repeatable "
            "(default 256, 512, 1024 and 1536); two or more fit the contention, one takes it "
            "as 0.",
        ),
    ] = None,
    memory: Annotated[
        str | None, typer.Option(help="Memory per device; default: the GPU's, or RAM / nproc.")
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads per rank; default as pipeplan run.")
    ] = None,
    quiet: Quiet = False,
) -> None:
    """Measure the link, the tied-gradient all-reduce, the pipeline engine's cost per operation
    (on the ranks, and on one rank alone for 1-stage plans), the contention between stages
    that compute at once and between optimizer updates that run at once; write a cluster
    file."""
    from rich.table import Table

    from pipeplan.planner.io import calibration_file, format_bytes, parse_bytes, write_json
    from pipeplan.report.terminal import console
    from pipeplan.runtime.calibrate import calibrate as run_calibration
    from pipeplan.runtime.engine_fit import WIDTHS

    check_output(output)
    if nproc < 1:
        fail(f"--nproc {nproc}: calibrate at least 1 rank")
    cluster, samples = run_calibration(
        nproc,
        device=device,
        max_bytes=parse_bytes(max_size, "--max-size"),
        repeats=repeats,
        engine_repeats=engine_repeats,
        launches=launches,
        solo_launches=solo_launches,
        widths=tuple(widths) if widths else WIDTHS,
        memory_bytes=parse_bytes(memory) if memory else None,
        threads=threads,
        progress=not quiet,
    )
    write_json(output, cluster)
    kept = calibration_file(device.split(":")[0])
    kept.parent.mkdir(parents=True, exist_ok=True)
    write_json(kept, cluster)  # what `pipeplan plan` charges by default on this machine
    link = cluster.link
    solo = (
        "not measured" if cluster.solo_op_overhead_s is None
        else f"{cluster.solo_op_overhead_s * 1e6:.0f} us"
    )  # fmt: skip
    if nproc == 1:
        console.print(
            f"1 rank, {device}: engine cost {solo} per forward/backward and "
            f"{cluster.step_overhead_s * 1e6:.0f} us per step (what 1-stage plans are charged), "
            f"memory {format_bytes(cluster.devices[0].memory_bytes)} -> {output} (and {kept}, "
            f"which pipeplan plan charges by default)"
        )
        return
    table = Table(title=f"{nproc} ranks, {device}: one-way time per message")
    for col in ("bytes", "send/recv", "batch_isend_irecv", "model"):
        table.add_column(col, justify="right")
    for size, raw, p2p in samples:
        model = link.transfer_s(size)
        table.add_row(
            format_bytes(size),
            f"{raw * 1e6:.1f} us",
            f"{p2p * 1e6:.1f} us",
            f"{model * 1e6:.1f} us",
        )
    console.print(table)
    console.print(
        f"latency {link.latency_s * 1e6:.1f} us, bandwidth {(link.bandwidth_Bps or 0) / 1e9:.2f} "
        f"GB/s, per-message overhead {link.overhead_s * 1e6:.1f} us, engine cost "
        f"{cluster.op_overhead_s * 1e6:.0f} us per forward/backward ({solo} alone) and "
        f"{cluster.step_overhead_s * 1e6:.0f} us per step, contention "
        f"{cluster.contention:.2f}, update contention {cluster.update_contention:.2f}, "
        f"tied-gradient all-reduce "
        f"{cluster.allreduce_s(2**20) * 1e3:.2f} ms per MiB, "
        f"memory {format_bytes(cluster.devices[0].memory_bytes)} per device -> {output} "
        f"(and {kept}, which pipeplan plan charges by default)"
    )
