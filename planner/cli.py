"""The ``pipeplan`` command line.

    pipeplan profile MODEL --batch-size B [--device cpu|cuda[:i]] -o profile.json
    pipeplan plan profile.json --stages P --memory 16GiB [--microbatches auto|M] -o plan.json
    pipeplan show plan.json|profile.json

Every error a user can cause prints one line ``error: ...`` and exits with status 2; no
traceback, no partial file.  Commands import their package lazily, so ``pipeplan show`` does
not pay for importing OR-Tools or torch.distributed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from planner.errors import InfeasiblePlanError, InvalidRequestError, PipeplanError
from planner.io import (
    format_bytes,
    load_any,
    load_cluster,
    load_profile,
    parse_bytes,
    parse_duration,
    parse_rate,
    write_json,
)
from planner.types import OPTIMIZERS, Cluster, Link, Plan, PlanOptions, Profile

__all__ = ["app", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Automatic pipeline-partition planner for PyTorch.",
)
console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

Output = Annotated[Path, typer.Option("-o", "--output", help="File to write (atomically).")]


def _fail(message: str) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _check_output(path: Path) -> None:
    if path.is_dir():
        _fail(f"output {path} is a directory; give a file name such as {path / 'out.json'}")
    if not path.parent.exists():
        _fail(f"output directory {path.parent} does not exist; create it first")


# --------------------------------------------------------------------------------------------
# profile
# --------------------------------------------------------------------------------------------


@app.command()
def profile(
    model: Annotated[str, typer.Argument(help="package.module:callable, e.g. models.gpt:gpt")],
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Mini-batch size B.")],
    output: Output = Path("profile.json"),
    device: Annotated[str, typer.Option(help="cpu or cuda[:i].")] = "cpu",
    microbatch_sizes: Annotated[
        str | None, typer.Option(help="Comma-separated sizes; default: powers of two dividing B.")
    ] = None,
    granularity: Annotated[str, typer.Option(help="auto, top, depth:N or node.")] = "auto",
    tracer: Annotated[str, typer.Option(help="auto, fx or export.")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32, float64, bfloat16 or float16.")] = "float32",
    warmup: Annotated[int, typer.Option(min=0)] = 2,
    repeats: Annotated[int, typer.Option(min=1)] = 5,
    model_arg: Annotated[
        list[str] | None,
        typer.Option("--model-arg", help="KEY=VALUE passed to the model callable."),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads while measuring: use the runtime's per rank.")
    ] = None,
    rounds: Annotated[
        int, typer.Option(help="Repeat the whole sweep; median of rounds (robust to bursts).")
    ] = 1,
) -> None:
    """Trace MODEL, group it into units and measure every unit at several micro-batch sizes."""
    from planner.model import parse_model_args
    from profiler import profile_model

    _check_output(output)
    if batch_size <= 0:
        _fail(f"--batch-size {batch_size} must be positive")
    sizes = None
    if microbatch_sizes:
        try:
            sizes = [int(s) for s in microbatch_sizes.split(",")]
        except ValueError:
            _fail(f"--microbatch-sizes {microbatch_sizes!r} must be integers like 1,2,4")
    prof = profile_model(
        model,
        batch_size=batch_size,
        model_kwargs=parse_model_args(model_arg),
        microbatch_sizes=sizes,
        device=device,
        granularity=granularity,
        tracer=tracer,
        dtype=dtype,
        warmup=warmup,
        repeats=repeats,
        progress=progress,
        threads=threads,
        rounds=rounds,
    )
    write_json(output, prof)
    console.print(
        f"profiled {prof.model}: {prof.n_units} units ({prof.tracer}), "
        f"micro-batch sizes {list(prof.microbatch_sizes)} -> {output}"
    )


# --------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------


def _parse_pins(pins: list[str] | None) -> dict[int, int]:
    out: dict[int, int] = {}
    for pin in pins or []:
        unit, sep, stage = pin.partition(":")
        if not sep or not unit.isdigit() or not stage.isdigit():
            _fail(f"--pin {pin!r} must be UNIT:STAGE with integers, e.g. --pin 0:0")
        out[int(unit)] = int(stage)
    return out


def make_cluster(
    stages: int | None,
    memory: str | None,
    bandwidth: str | None,
    latency: str | None,
    cluster_file: Path | None,
) -> Cluster:
    """The cluster from --cluster, or from --stages/--memory/--bandwidth/--latency."""
    if cluster_file is not None:
        cluster = load_cluster(cluster_file)
        if stages is not None and stages != cluster.n_stages:
            raise InvalidRequestError(
                f"--stages {stages} contradicts {cluster_file} ({cluster.n_stages} devices); "
                f"drop --stages"
            )
        if memory is not None:
            mem = parse_bytes(memory)
            devices = tuple(d.model_copy(update={"memory_bytes": mem}) for d in cluster.devices)
            cluster = cluster.model_copy(update={"devices": devices})
        return cluster
    if stages is None or memory is None:
        raise InvalidRequestError("give --stages and --memory, or a --cluster file")
    if stages < 1:
        raise InvalidRequestError(f"--stages {stages} must be at least 1")
    link = Link(
        bandwidth_Bps=parse_rate(bandwidth) if bandwidth else None,
        latency_s=parse_duration(latency) if latency else 0.0,
    )
    return Cluster.homogeneous(stages, parse_bytes(memory), link)


@app.command()
def plan(
    profile_file: Annotated[Path, typer.Argument(metavar="PROFILE", help="A profile JSON file.")],
    output: Output = Path("plan.json"),
    stages: Annotated[int | None, typer.Option("--stages", "-p", help="Number of stages.")] = None,
    memory: Annotated[str | None, typer.Option(help="Memory per device, e.g. 16GiB.")] = None,
    microbatches: Annotated[str, typer.Option(help="auto or a count m.")] = "auto",
    checkpoint: Annotated[str, typer.Option(help="always, except_last or never.")] = "except_last",
    schedule: Annotated[str, typer.Option(help="gpipe or 1f1b.")] = "gpipe",
    optimizer: Annotated[str, typer.Option(help="sgd, momentum or adam.")] = "adam",
    bandwidth: Annotated[str | None, typer.Option(help="Link bandwidth, e.g. 10GB/s.")] = None,
    latency: Annotated[str | None, typer.Option(help="Link latency, e.g. 5us.")] = None,
    cluster: Annotated[Path | None, typer.Option(help="Cluster description JSON.")] = None,
    solver: Annotated[str, typer.Option(help="dp, cpsat, uniform, params or torchgpipe.")] = "dp",
    time_limit: Annotated[float | None, typer.Option(help="Seconds (CP-SAT).")] = None,
    pin: Annotated[list[str] | None, typer.Option(help="UNIT:STAGE (CP-SAT).")] = None,
    min_units: Annotated[int, typer.Option(help="Fewest units per stage (CP-SAT).")] = 1,
    max_units: Annotated[int | None, typer.Option(help="Most units per stage (CP-SAT).")] = None,
    record_solve_time: Annotated[
        bool, typer.Option(help="Store the solve time (the file is then not reproducible).")
    ] = False,
) -> None:
    """Choose stage boundaries and the micro-batch count for PROFILE; write the plan."""
    from solvers import SOLVERS

    _check_output(output)
    prof = load_profile(profile_file)
    if isinstance(prof, Profile) is False:  # pragma: no cover - load_profile guarantees it
        _fail(f"{profile_file} is not a profile")
    if solver not in SOLVERS:
        _fail(f"--solver {solver!r} is unknown; choose one of {', '.join(SOLVERS)}")
    m: int | None = None
    if microbatches != "auto":
        if not microbatches.isdigit() or int(microbatches) < 1:
            _fail(f"--microbatches {microbatches!r} must be 'auto' or a positive integer")
        m = int(microbatches)
    choices = {
        "--checkpoint": (checkpoint, ("always", "except_last", "never")),
        "--schedule": (schedule, ("gpipe", "1f1b")),
        "--optimizer": (optimizer, OPTIMIZERS),
    }
    for flag, (value, allowed) in choices.items():
        if value not in allowed:
            _fail(f"{flag} {value!r} is not one of {', '.join(allowed)}")
    options = PlanOptions(
        microbatches=m,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        schedule=schedule,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        pinned=_parse_pins(pin),
        min_units=max(1, min_units),
        max_units=max_units,
        time_limit_s=time_limit,
    )
    clus = make_cluster(stages, memory, bandwidth, latency, cluster)
    try:
        result = SOLVERS[solver](prof, clus, options)
    except InfeasiblePlanError as exc:
        _fail(str(exc))
    if not record_solve_time:
        result = result.model_copy(update={"solve_time_s": None})
    write_json(output, result)
    _print_plan(result)
    console.print(f"-> {output}")


# --------------------------------------------------------------------------------------------
# show
# --------------------------------------------------------------------------------------------


def _print_plan(p: Plan) -> None:
    table = Table(title=f"{p.model}: {p.n_stages} stages, m = {p.microbatches} ({p.solver})")
    for col in ("stage", "units", "F ms", "B ms", "C ms", "t ms", "memory", "limit", "fits"):
        table.add_column(col, justify="right")
    slowest = max(s.time_s for s in p.stages)
    for s in p.stages:
        mark = "*" if s.time_s == slowest else ""
        table.add_row(
            str(s.index),
            f"{s.first_unit}-{s.last_unit} ({s.unit_names[0]}..{s.unit_names[-1]})",
            f"{s.forward_s * 1e3:.3f}",
            f"{s.backward_s * 1e3:.3f}",
            f"{s.comm_s * 1e3:.3f}",
            f"{s.time_s * 1e3:.3f}{mark}",
            format_bytes(s.memory.total),
            format_bytes(s.memory_limit),
            "yes" if s.feasible else "NO",
        )
    console.print(table)
    gap = f", gap {p.gap:.2%}" if p.gap is not None else ""
    console.print(
        f"step time {p.step_time_s * 1e3:.3f} ms (simulated "
        f"{(p.simulated_step_time_s or p.step_time_s) * 1e3:.3f} ms, lower bound "
        f"{(p.lower_bound_s or 0) * 1e3:.3f} ms), bubble {p.bubble_fraction:.1%}, "
        f"{p.throughput:.1f} samples/s, micro-batch size {p.microbatch_size}, "
        f"checkpoint {p.checkpoint}, schedule {p.schedule}, status {p.status}{gap}"
    )
    for sync in p.tied_syncs:
        stages = ", ".join(map(str, sync.stages))
        console.print(
            f"tied gradients: stages {stages} sum {format_bytes(sync.bytes)} after their last "
            f"backward, {sync.seconds * 1e3:.3f} ms, before updating"
        )


def _print_profile(p: Profile) -> None:
    b = max(p.microbatch_sizes)
    table = Table(title=f"{p.model}: {p.n_units} units, traced with {p.tracer}, {p.device.name}")
    for col in ("unit", "name", f"fwd ms @{b}", f"bwd ms @{b}", "saved", "params", "cut/sample"):
        table.add_column(col, justify="right")
    for u in p.units:
        t = u.timings[b]
        cut = p.cuts[u.index].bytes_per_sample if u.index < len(p.cuts) else 0
        table.add_row(
            str(u.index),
            u.name,
            f"{t.forward_s * 1e3:.3f}",
            f"{t.backward_s * 1e3:.3f}",
            format_bytes(t.saved_bytes),
            format_bytes(u.param_bytes),
            format_bytes(cut),
        )
    console.print(table)
    console.print(
        f"batch {p.batch_size}, micro-batch sizes {list(p.microbatch_sizes)}, dtype {p.dtype}, "
        f"torch {p.torch_version}, threads {p.device.threads}, fingerprint {p.graph_fingerprint}"
    )


@app.command()
def show(
    file: Annotated[Path, typer.Argument(help="A plan, profile, cluster or run report.")],
) -> None:
    """Print a plan or profile as a table."""
    obj = load_any(file)
    if isinstance(obj, Plan):
        _print_plan(obj)
    elif isinstance(obj, Profile):
        _print_profile(obj)
    else:
        console.print_json(obj.model_dump_json(by_alias=True))


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------


@app.command()
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
) -> None:
    """Run PLAN as a pipeline on this machine (torchrun, one rank per stage); compare with it."""
    from planner.errors import StageFailedError
    from runtime.launch import launch, preflight

    if optimizer is not None and optimizer not in OPTIMIZERS:
        _fail(f"--optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    p = preflight(
        plan_file,
        model=model,
        model_args=model_arg or [],
        device=device,
        threads=threads,
        outputs=[report, trace],
    )
    if device == "cpu":
        from runtime.worker import default_threads

        per_rank = threads or default_threads(p.n_stages)
        if p.profiled_threads is not None and p.profiled_threads != per_rank:
            err_console.print(
                f"[yellow]warning:[/] the profile was measured with {p.profiled_threads} "
                f"thread(s) but each rank runs {per_rank}; predictions assume "
                f"{p.profiled_threads} (profile with --threads {per_rank}, or run with "
                f"--threads {p.profiled_threads})",
                highlight=False,
                soft_wrap=True,
            )
    if optimizer is not None and optimizer != p.optimizer:
        err_console.print(
            f"[yellow]warning:[/] the plan was made for {p.optimizer} (its memory and update "
            f"time) but the run uses {optimizer}",
            highlight=False,
            soft_wrap=True,
        )
    optimizer = optimizer or p.optimizer
    args = [f"--steps={steps}", f"--warmup={warmup}", f"--optimizer={optimizer}", f"--lr={lr}"]
    args += [f"--device={device}", f"--seed={seed}", f"--timeout={timeout}"]
    args += [f"--model={model}"] if model else []
    args += [f"--model-arg={a}" for a in model_arg or []]
    args += [f"--threads={threads}"] if threads else []
    args += [f"--report={report.resolve()}"] if report else []
    args += [f"--trace={trace.resolve()}"] if trace else []
    try:
        launch(p, plan_file.resolve(), args)
    except StageFailedError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    for path, what in ((report, "report"), (trace, "trace")):
        if path:
            console.print(f"{what} -> {path}")


# --------------------------------------------------------------------------------------------
# compare
# --------------------------------------------------------------------------------------------


@app.command()
def compare(
    plan_files: Annotated[list[Path], typer.Argument(metavar="PLAN...", help="Plan JSON files.")],
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="table, csv, json or markdown.")
    ] = "table",
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="File to write (atomically).")
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="Also draw stage times and memory to this image (.png, .svg, .pdf)."),
    ] = None,
) -> None:
    """Compare plans side by side: per-stage times, bubble, step time and ratio to the best."""
    from planner.compare import FORMATS, compare_frame, format_cell, render
    from planner.io import load_plan, write_text

    if fmt not in FORMATS:
        _fail(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if output is not None:
        _check_output(output)
    if plot is not None:
        _check_output(plot)
        if plot.suffix.lower() not in (".png", ".svg", ".pdf"):
            _fail(f"--plot {plot} must end in .png, .svg or .pdf")
    plans = [load_plan(path) for path in plan_files]
    names = [path.stem for path in plan_files]
    df = compare_frame(plans, names)
    if plot is not None:
        from planner.plots import compare_figure

        compare_figure(plans, names).savefig(plot, dpi=120)
        err_console.print(f"figure -> {plot}")
    if output is not None:
        write_text(output, render(df, fmt))
        console.print(f"{len(plans)} plans -> {output}")
    elif fmt == "table":
        table = Table(title=f"{len(plans)} plans")
        for col in df.columns:
            left = col in ("name", "stage_ms", "stage_mem")
            width = (
                max(len(str(v)) for v in df[col]) if col in ("name", "solver", "status") else None
            )
            table.add_column(str(col), justify="left" if left else "right", min_width=width)
        for rec in df.to_dict(orient="records"):
            # Per-stage lists wrap at spaces: times to 0.1 ms, memory as 1.5 GiB.
            rec["stage_ms"] = " ".join(f"{float(t):.1f}" for t in rec["stage_ms"].split("/"))
            rec["stage_mem"] = " ".join(format_bytes(int(b)) for b in rec["stage_mem"].split("/"))
            table.add_row(*(format_cell(v) for v in rec.values()))
        console.print(table)
    else:
        sys.stdout.write(render(df, fmt))


# --------------------------------------------------------------------------------------------


@app.command()
def calibrate(
    output: Output = Path("cluster.json"),
    nproc: Annotated[int, typer.Option(help="Ranks (= stages) to describe.")] = 2,
    device: Annotated[str, typer.Option(help="cpu (gloo) or cuda (nccl).")] = "cpu",
    max_size: Annotated[str, typer.Option(help="Largest message, e.g. 16MiB.")] = "16MiB",
    repeats: Annotated[int, typer.Option(help="Round trips per size.")] = 20,
    launches: Annotated[
        int, typer.Option(help="Separate torchrun jobs; the cluster takes their medians.")
    ] = 3,
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
) -> None:
    """Measure the link, the tied-gradient all-reduce, the pipeline engine's cost per operation
    (on the ranks, and on one rank alone for 1-stage plans), the contention between stages
    that compute at once and between optimizer updates that run at once; write a cluster
    file."""
    from runtime.calibrate import calibrate as run_calibration
    from runtime.engine_fit import WIDTHS

    _check_output(output)
    if nproc < 2:
        _fail(f"--nproc {nproc}: calibration needs at least 2 ranks")
    cluster, samples = run_calibration(
        nproc,
        device=device,
        max_bytes=parse_bytes(max_size, "--max-size"),
        repeats=repeats,
        launches=launches,
        widths=tuple(widths) if widths else WIDTHS,
        memory_bytes=parse_bytes(memory) if memory else None,
        threads=threads,
    )
    write_json(output, cluster)
    link = cluster.link
    solo = (
        "not measured" if cluster.solo_op_overhead_s is None
        else f"{cluster.solo_op_overhead_s * 1e6:.0f} us"
    )  # fmt: skip
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
        f"memory {format_bytes(cluster.devices[0].memory_bytes)} per device -> {output}"
    )


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, turning PipeplanErrors into one line.

    Click runs standalone (usage errors exit 2 with its own message); errors pipeplan raises
    print ``error: ...`` and exit 2.
    """
    try:
        app(args=argv)
    except PipeplanError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
