"""The ``pipeplan`` command line: a thin shell over :mod:`pipeplan.api`.

    pipeplan profile MODEL --batch-size B [--device cpu|cuda[:i]] -o profile.json
    pipeplan plan profile.json --stages P --memory 16GiB [--microbatches auto|M] -o plan.json
    pipeplan show plan.json|profile.json
    pipeplan export plan.json --to torchtitan|megatron|deepspeed|fqns [-o FILE]

Each command parses its option strings into values, calls the API (or the package that does the
work, where the API has no function for it), and prints the result.  The checks of a request are
the API's and its packages', made once for the command line and Python callers alike; every
error a user can cause prints one line ``error: ...`` and exits with status 2: no traceback, no
partial file (docs/cli.md: every command, its options and exit codes).  Commands import what
they use inside their functions, so ``pipeplan --help`` and a bad option answer without
importing torch, pandas or OR-Tools.  The shared options and string parsers live in
``pipeplan.cli_options``, the tables in ``pipeplan.report.terminal``, and the commands that
drive the runtime (``run``, ``calibrate``) in ``pipeplan.cli_runtime``; this module registers
them all.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

from pipeplan.cli_options import (
    DEBUG,
    USAGE_ERROR,
    Output,
    Quiet,
    check_output,
    fail,
    parse_pins,
    usage_line,
)
from pipeplan.cli_runtime import calibrate, run
from pipeplan.cli_views import compare, show
from pipeplan.planner.errors import PipeplanError

__all__ = ["app", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Automatic pipeline-partition planner for PyTorch. Add --debug (or set "
    "PIPEPLAN_DEBUG=1) to see the traceback behind an error.",
)


# --------------------------------------------------------------------------------------------
# profile
# --------------------------------------------------------------------------------------------


@app.command()
def profile(
    model: Annotated[
        str, typer.Argument(help="package.module:callable, e.g. pipeplan.models.gpt:gpt")
    ],
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
    quiet: Quiet = False,
    threads: Annotated[
        int | None,
        typer.Option(
            help="CPU threads while measuring (default: cores // 2, what each rank of a 2-stage run on this host gets)."
        ),
    ] = None,
    rounds: Annotated[
        int, typer.Option(help="Repeat the whole sweep; median of rounds (robust to bursts).")
    ] = 1,
    seq_len: Annotated[
        int | None,
        typer.Option(help="Tokens per sample: the model argument seq_len (e.g. for hf:...)."),
    ] = None,
    max_stages: Annotated[
        int,
        typer.Option(help="Refine auto units for up to this many stages (no unit > 1/P)."),
    ] = 8,
    method: Annotated[
        str,
        typer.Option(
            help="whole: whole training passes of the real model; units: built on meta, each "
            "distinct unit materialized alone and measured once; auto: whole if the training "
            "state (4 x params + activations) fits in half the available memory, else units."
        ),
    ] = "auto",
    tensor_parallel: Annotated[int, typer.Option(min=1, help="Also time units split T ways.")] = 1,
) -> None:
    """Trace MODEL, group it into units and measure every unit at several micro-batch sizes.

    MODEL is package.module:callable, or hf:PATH/config.json for a transformers model built
    from a local config with random weights (its head from the config's architectures).
    """
    from pipeplan import api
    from pipeplan.intake.model import parse_model_args
    from pipeplan.report.terminal import console

    check_output(output)
    sizes = None
    if microbatch_sizes:
        try:
            sizes = [int(s) for s in microbatch_sizes.split(",")]
        except ValueError:
            fail(f"--microbatch-sizes {microbatch_sizes!r} must be integers like 1,2,4")
    kwargs = parse_model_args(model_arg)
    if seq_len is not None:
        if seq_len <= 0:
            fail(f"--seq-len {seq_len} must be positive")
        kwargs["seq_len"] = seq_len
    before = _load_average()
    prof = api.profile(
        model,
        batch_size,
        model_kwargs=kwargs,
        microbatch_sizes=sizes,
        device=device,
        method=method,
        progress=not quiet,
        granularity=granularity,
        tracer=tracer,
        dtype=dtype,
        warmup=warmup,
        repeats=repeats,
        threads=threads,
        rounds=rounds,
        max_stages=max_stages,
        tensor_parallel=tensor_parallel,
    )
    api.save(prof, output)
    if prof.device.threads is not None and before is not None:
        from pipeplan.planner.host import busy_host, cores
        from pipeplan.report.terminal import err_console

        after = _load_average()
        warning = busy_host(before, after or 0.0, prof.device.threads, cores(), rounds)
        if warning is not None:
            err_console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    copied = sum(u.measured_as is not None for u in prof.units)
    split = sum(tensor_parallel in u.tp_timings for u in prof.units)
    console.print(
        f"profiled {prof.model} ({prof.method}"
        + (f", {prof.n_units - copied} measured, {copied} copied" if prof.method == "units" else "")
        + (f", {split} split {tensor_parallel} ways" if tensor_parallel > 1 else "")
        + f"): {prof.n_units} units ({prof.tracer}), "
        f"micro-batch sizes {list(prof.microbatch_sizes)} -> {output}"
    )


def _load_average() -> float | None:
    """The host's 1-minute load average (``None`` where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


# --------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------


@app.command()
def plan(
    profile_file: Annotated[Path, typer.Argument(metavar="PROFILE", help="A profile JSON file.")],
    output: Output = Path("plan.json"),
    stages: Annotated[int | None, typer.Option("--stages", "-p", help="Number of stages.")] = None,
    devices: Annotated[
        int | None,
        typer.Option(help="Devices N: choose stages p and data-parallel ranks N / p."),
    ] = None,
    global_batch_size: Annotated[
        int | None,
        typer.Option(
            help="Samples per step over every data-parallel rank (default: the profile's "
            "batch); m follows from it, the ranks and the micro-batch size."
        ),
    ] = None,
    data_parallel: Annotated[
        str,
        typer.Option(
            help="How a stage's data-parallel ranks hold its parameters, gradients and "
            "optimizer states: replicate, shard (FSDP2) or auto (both weighed)."
        ),
    ] = "auto",
    dp: Annotated[
        int | None,
        typer.Option(help="Data-parallel ranks per stage d, fixed (with --stages: p x d devices)."),
    ] = None,
    devices_per_node: Annotated[
        int | None,
        typer.Option(
            help="Devices per node K: with --devices, every tensor-parallel degree dividing K is "
            "weighed too (tensor-parallel groups stay inside a node)."
        ),
    ] = None,
    tensor_parallel: Annotated[
        int | None,
        typer.Option(
            help="Tensor-parallel degree t, fixed (default: searched when --devices-per-node is "
            "given, else 1; with --stages: p x t devices)."
        ),
    ] = None,
    sequence_parallel: Annotated[
        bool, typer.Option(help="With t > 1: split the norms' sequence too (Megatron's).")
    ] = False,
    loss_parallel: Annotated[
        bool,
        typer.Option(help="With t > 1: the loss reads a vocabulary-split head's logits split."),
    ] = False,
    intra_bandwidth: Annotated[
        str | None,
        typer.Option(
            help="Intra-node link bandwidth (NVLink), e.g. 400GB/s (default: --bandwidth)."
        ),
    ] = None,
    intra_latency: Annotated[
        str | None, typer.Option(help="Intra-node link latency, e.g. 2us (default: --latency).")
    ] = None,
    memory: Annotated[str | None, typer.Option(help="Memory per device, e.g. 16GiB.")] = None,
    microbatches: Annotated[str, typer.Option(help="auto or a count m.")] = "auto",
    checkpoint: Annotated[
        str,
        typer.Option(
            help="auto (each stage recomputes only if keeping its activations does not fit), "
            "always, except_last or never."
        ),
    ] = "auto",
    schedule: Annotated[
        str,
        typer.Option(
            help="gpipe, 1f1b, interleaved1f1b, loopedbfs, zb-interleaved, zbv, dualpipev (torch's "
            "schedules), or auto: the family, chunks per rank, cuts, m and recomputation chosen "
            "together, scored by replaying torch's action order."
        ),
    ] = "auto",
    optimizer: Annotated[str, typer.Option(help="sgd, momentum or adam.")] = "adam",
    bandwidth: Annotated[str | None, typer.Option(help="Link bandwidth, e.g. 10GB/s.")] = None,
    latency: Annotated[str | None, typer.Option(help="Link latency, e.g. 5us.")] = None,
    cluster: Annotated[Path | None, typer.Option(help="Cluster description JSON.")] = None,
    solver: Annotated[str, typer.Option(help="dp, cpsat, uniform, params or torchgpipe.")] = "dp",
    time_limit: Annotated[
        float | None,
        typer.Option(
            help="Seconds: CP-SAT's limit, and a wall-clock cap on the schedule solver's "
            "search (which otherwise stops after a fixed count of replayed actions, so that its plans "
            "do not depend on the machine)."
        ),
    ] = None,
    prove: Annotated[
        float,
        typer.Option(
            help="Multi-chunk plans: this much of CP-SAT's deterministic time per (family, v, m) "
            "on the exact model over torch's action order, to prove the plan optimal or "
            "tighten its gap (0: the local search alone)."
        ),
    ] = 0.0,
    pin: Annotated[list[str] | None, typer.Option(help="UNIT:STAGE (CP-SAT).")] = None,
    min_units: Annotated[int, typer.Option(help="Fewest units per stage (CP-SAT).")] = 1,
    max_units: Annotated[int | None, typer.Option(help="Most units per stage (CP-SAT).")] = None,
    record_solve_time: Annotated[
        bool, typer.Option(help="Store the solve time (the file is then not reproducible).")
    ] = False,
    target: Annotated[
        str | None,
        typer.Option(
            "--for",
            help="torchtitan, megatron, deepspeed or fqns: plan only cuts that framework can "
            "make (the best plan it can run, from this profile).",
        ),
    ] = None,
    calibration: Annotated[
        bool,
        typer.Option(
            help="Without --cluster, --bandwidth or --latency: charge the links, engine costs "
            "and contention of this machine's last `pipeplan calibrate` for the profile's "
            "device kind ($PIPEPLAN_HOME/cluster-KIND.json), if there is one."
        ),
    ] = True,
) -> None:
    """Choose stage boundaries and the micro-batch count for PROFILE; write the plan."""
    from pipeplan import api
    from pipeplan.report.terminal import console, err_console, frontier_table, print_plan

    check_output(output)
    if microbatches != "auto" and not microbatches.isdigit():
        fail(f"--microbatches {microbatches!r} must be 'auto' or a positive integer")
    request = api.plan_request(
        profile_file,
        stages=stages,
        memory=memory,
        cluster=cluster,
        devices=devices,
        bandwidth=bandwidth,
        latency=latency,
        solver=solver,
        calibrated=calibration,
        target=target,
        global_batch_size=global_batch_size,
        data_parallel=data_parallel,
        dp=dp,
        devices_per_node=devices_per_node,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        intra_bandwidth=intra_bandwidth,
        intra_latency=intra_latency,
        microbatches=None if microbatches == "auto" else int(microbatches),
        checkpoint=checkpoint,
        schedule=schedule,
        optimizer=optimizer,
        pinned=parse_pins(pin),
        min_units=max(1, min_units),
        max_units=max_units,
        time_limit_s=time_limit,
        prove=prove,
    )
    if request.calibration is not None:
        err_console.print(
            f"calibrated: links, engine costs and contention from {request.calibration} "
            "(pipeplan calibrate; --no-calibration to leave them out)",
            highlight=False,
        )
    if request.tensor_parallel_note is not None:
        err_console.print(request.tensor_parallel_note, highlight=False, soft_wrap=True)
    if request.devices is None:
        result = request.solve()
    else:
        choices = request.frontier()
        batch = request.global_batch or request.profile.batch_size
        console.print(frontier_table(request.devices, batch, choices))
        result = request.best(choices)
    if result.cluster.tensor_parallel > 1:
        from pipeplan.solvers.tensor_parallel import source_note

        console.print(source_note(request.profile, result.cluster), highlight=False)
    if not record_solve_time:
        result = result.model_copy(update={"solve_time_s": None})
    if result.profiled_threads is not None:  # before anything runs: what run will give a rank
        from pipeplan.planner.host import threads_mismatch, threads_per_rank

        ranks = result.n_stages * result.cluster.data_parallel * result.cluster.tensor_parallel
        per_rank = threads_per_rank(ranks)
        if (warning := threads_mismatch(result.profiled_threads, per_rank)) is not None:
            err_console.print(
                f"[yellow]warning:[/] on this host {warning}", highlight=False, soft_wrap=True
            )
    api.save(result, output)
    print_plan(result)
    console.print(f"-> {output}")


# --------------------------------------------------------------------------------------------
# show
# --------------------------------------------------------------------------------------------


app.command()(show)


# --------------------------------------------------------------------------------------------
# run (pipeplan.cli_runtime; registered here to keep the commands' order in --help)
# --------------------------------------------------------------------------------------------

app.command()(run)


# --------------------------------------------------------------------------------------------
# compare
# --------------------------------------------------------------------------------------------


app.command()(compare)


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------


@app.command()
def export(
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN", help="A plan JSON file.")],
    to: Annotated[str, typer.Option("--to", help="torchtitan, megatron, deepspeed or fqns.")],
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="File to write (atomically).")
    ] = None,
    profile_file: Annotated[
        Path | None,
        typer.Option(
            "--profile", help="The plan's profile: prices the closest plan a target can run."
        ),
    ] = None,
) -> None:
    """Write PLAN in a training framework's own terms (stage module names, layout, parts).

    A cut the target cannot make (inside a block, inside the embedding or the head) moves to
    the closest plan it can; one line on stderr says why and what that plan costs.
    """
    from pipeplan.export import export_plan
    from pipeplan.planner.io import load_plan, load_profile, write_text
    from pipeplan.report.terminal import console, err_console

    if output is not None:
        check_output(output)
    the_plan = load_plan(plan_file)
    prof = load_profile(profile_file) if profile_file is not None else None
    result = export_plan(the_plan, to, prof)  # type: ignore[arg-type]
    if result.adjustment is not None:
        new, old = result.adjustment.plan, the_plan.step_time_s
        starts = [s.first_unit for s in new.stages]
        fits = "" if new.feasible else ", over a device's memory"
        change = (new.step_time_s / old - 1) * 100 if old > 0 else 0.0
        err_console.print(
            f"note: {result.adjustment.reason}; the closest plan it can run starts its stages "
            f"at units {starts}: predicted step {new.step_time_s * 1e3:.4g} ms vs "
            f"{old * 1e3:.4g} ms planned ({change:+.1f}%{fits})",
            highlight=False,
            soft_wrap=True,
        )
    for note in result.notes:
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if output is None:
        sys.stdout.write(result.text)
    else:
        write_text(output, result.text)
        console.print(f"{to} -> {output}")


# --------------------------------------------------------------------------------------------
# calibrate (pipeplan.cli_runtime)
# --------------------------------------------------------------------------------------------

app.command()(calibrate)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, turning PipeplanErrors into one line.

    Usage errors (click's: a bad option value, a missing argument) and errors pipeplan raises
    print one line, ``error: ...``, and exit 2.  ``--debug`` anywhere on the line, or ``PIPEPLAN_DEBUG=1``,
    also prints the error's traceback, with the user's exception it came from.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("PIPEPLAN_DEBUG", "") not in ("", "0")
    DEBUG[0] = debug
    args = [a for a in args if a != "--debug"]
    try:
        rc = app(args=args, standalone_mode=False)
    except USAGE_ERROR as exc:
        from pipeplan.report.terminal import err_console

        err_console.print(f"[bold red]error:[/] {usage_line(exc)}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Abort:
        from pipeplan.report.terminal import err_console

        err_console.print("interrupted")
        sys.exit(130)
    except PipeplanError as exc:
        from pipeplan.report.terminal import err_console

        if debug:
            err_console.print(
                "".join(traceback.format_exception(exc)), highlight=False, soft_wrap=True
            )
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        from pipeplan.report.terminal import err_console

        err_console.print("interrupted")
        sys.exit(130)
    if isinstance(rc, int) and rc:
        sys.exit(rc)


if __name__ == "__main__":
    main()
