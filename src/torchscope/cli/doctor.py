"""`torchscope doctor`, `torchscope diff` and `torchscope lab`."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from torchscope.cli._common import (
    AutocastOpt,
    DebugOpt,
    DeviceOpt,
    InputOpt,
    InputsFnOpt,
    JsonOpt,
    LossOpt,
    ModesOpt,
    QuietOpt,
    TargetArg,
    VerboseOpt,
    at_least,
    autocast_name,
    check_output,
    choice,
    console,
    device_of,
    fail,
    guarded,
    load,
    save_json,
    split_commas,
    writing,
)
from torchscope.cli._progress import progress

if TYPE_CHECKING:
    from torch import nn

    from torchscope.doctor import DoctorOptions, DoctorReport
    from torchscope.doctor.distributed import DistributedJob
    from torchscope.findings import Severity
    from torchscope.models.target import ModelInputs


def register(app: typer.Typer) -> None:
    """Add `doctor`, `diff` and `lab` to `app`."""
    app.command("doctor")(doctor)
    app.command("diff")(diff)
    app.command("lab")(lab)


def doctor(
    target: TargetArg = None,
    input: InputOpt = None,
    inputs: InputsFnOpt = None,
    skip: Annotated[str | None, typer.Option(
        "--skip", help="Sections not to run, comma-separated: activations, gradients, memory, "
        "profile, compile, lint (the target's source file, for training traps).")] = None,
    fast: Annotated[bool, typer.Option(
        "--fast", help="Skip torch.compile (seconds of cold compile per mode) and profile 3 "
        "steps instead of --steps: seconds instead of tens of seconds.")] = False,
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for report.html and "
                                     "report.json.")] = "torchscope-report",
    loss: LossOpt = "auto",
    autocast: AutocastOpt = None,
    steps: Annotated[int, typer.Option(help="Profiled training steps.")] = 5,
    modes: ModesOpt = "default",
    compile_modes: Annotated[str | None, typer.Option(
        "--compile-modes", hidden=True, help="Deprecated spelling of --modes.")] = None,
    device: DeviceOpt = "auto",
    fail_on: Annotated[str | None, typer.Option(
        "--fail-on", help="Exit 1 when a finding is at least this severe: error or warning "
        "(or when a section failed).")
    ] = None,
    nproc: Annotated[int | None, typer.Option(
        "--nproc", help="Run on this many ranks on this machine, each on its own rows of "
        "the batch, joined into one report with a row per rank; a rank that fails ends the "
        "run, named in one line.")
    ] = None,
    strategy: Annotated[str | None, typer.Option(
        "--strategy", help="With --nproc or under torchrun: ddp (DistributedDataParallel) or "
        "fsdp2 (fully_shard).", show_default="ddp")] = None,
    backend: Annotated[str | None, typer.Option(
        "--backend", help="With --nproc or under torchrun: gloo (CPU) or nccl (one GPU per "
        "rank).", show_default="nccl when torch sees a GPU, else gloo")] = None,
    verbose: VerboseOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Examine a model end to end and write report.html + report.json with ranked findings."""
    with guarded(debug):
        check_output(out, "--out", folder=True)
        from torchscope.compile import known_modes
        from torchscope.doctor import DoctorOptions, section_names
        from torchscope.findings import Severity
        from torchscope.models.target import source_files
        from torchscope.report.html import write_report
        from torchscope.step import LOSSES

        skipped = split_commas(skip)
        unknown = [s for s in skipped if s not in section_names()]
        if unknown:
            fail(f"--skip names unknown section(s) {', '.join(unknown)}. Fix: choose from "
                 f"{', '.join(section_names())}.")
        loss_fn = choice("--loss", loss, LOSSES)
        precision = autocast_name(autocast)
        floor = None if fail_on is None else \
            Severity[choice("--fail-on", fail_on, ("error", "warning")).upper()]
        at_least("--steps", steps, 1, "profiles nothing")
        # --compile-modes: the doctor's old spelling, kept hidden so old scripts still run.
        if compile_modes is not None and modes != "default":
            fail("--modes and --compile-modes name the same thing. Fix: pass --modes alone.")
        modes_option, given = ("--modes", modes) if compile_modes is None else \
            ("--compile-modes", compile_modes)
        mode_list = tuple(split_commas(given))
        if not mode_list:
            fail(f"{modes_option} {given!r} lists no mode. Fix: pass e.g. --modes default.")
        unknown_modes = [m for m in mode_list if m not in known_modes()]
        if unknown_modes:
            fail(f"{modes_option} names unknown mode(s) {', '.join(unknown_modes)}. Fix: "
                 f"choose from {', '.join(known_modes())}.")
        ranked = _distributed(nproc, strategy, backend, device)
        if ranked is not None:
            from torchscope.doctor.distributed import DistributedJob, launch

            options = DoctorOptions(fast=fast, skip=frozenset(skipped), loss_fn=loss_fn,
                                    steps=steps, compile_modes=mode_list, autocast=precision,
                                    sources=source_files(target, inputs))
            job = DistributedJob(target, tuple(input or ()), inputs, ranked[0], ranked[1],
                                 options, out)
            if nproc is not None:
                with progress("doctor", quiet=quiet) as shown:  # the sections run on the ranks
                    shown(f"{nproc} ranks ({ranked[0]}, {ranked[1]})", 1)
                    report = launch(job, nproc)
                _print_report(report, out, floor, debug, verbose)
                return
            _as_torchrun_rank(job, out, floor, debug, verbose)
        dev = device_of(device)
        loaded, model_inputs = load(target, input, inputs)
        model = loaded.model.to(dev)
        options = DoctorOptions(fast=fast, skip=frozenset(skipped), loss_fn=loss_fn, steps=steps,
                                compile_modes=mode_list, device=dev, autocast=precision,
                                sources=source_files(target, inputs))
        report = _run_with_progress(model, model_inputs.to(dev), options, loaded.name, quiet)
        with writing("--out", out):
            write_report(report, out)
        _print_report(report, out, floor, debug, verbose)


def _as_torchrun_rank(job: DistributedJob, out: str, floor: Severity | None,
                      debug: bool, verbose: bool = False) -> None:
    """This process is one rank of a torchrun launch: run it; rank 0 prints the report.

    The rank then leaves with `os._exit`, skipping interpreter teardown: torch can abort a
    process there (a gloo worker thread releasing a finished collective while Python shuts
    down), which torchrun would report as a failed rank after the report was written.
    """
    from torchscope.doctor.distributed import run_rank

    code = 0
    report = run_rank(job)
    if report is not None:
        try:
            _print_report(report, out, floor, debug, verbose)
        except typer.Exit as exc:
            code = int(exc.exit_code or 0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _distributed(nproc: int | None, strategy: str | None, backend: str | None,
                 device: str) -> tuple[str, str] | None:
    """(strategy, backend) when the doctor runs on ranks (`--nproc`, or under torchrun);
    None for one process. Fails, before any work, on a request this machine cannot run."""
    import torch

    from torchscope.doctor.distributed import check_request, under_torchrun

    torchrun = under_torchrun()
    if nproc is None and not torchrun:
        if strategy is not None or backend is not None:
            fail("--strategy and --backend need --nproc N (or a torchrun launch). Fix: add "
                 "--nproc 2.")
        return None
    if nproc is not None and torchrun:
        fail("--nproc was given inside a torchrun launch, which already started the ranks. "
             "Fix: drop --nproc (torchrun's --nproc_per_node sets the ranks).")
    if device != "auto":
        fail(f"--device {device} cannot be combined with ranks: --backend decides (gloo: CPU, "
             "nccl: one GPU per rank). Fix: drop --device.")
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    ranks = nproc if nproc is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    check_request(ranks, strategy or "ddp", chosen)
    return strategy or "ddp", chosen


def _print_report(report: DoctorReport, out: str, floor: Severity | None, debug: bool,
                  verbose: bool = False) -> None:
    """The doctor's terminal output: the verdict first, then each finding's summary and fix,
    and where the report went; `verbose` adds the evidence, the sections table (shown anyway
    when a section failed), the step and the per-rank rows. Exit code 1 under `--fail-on`."""
    from torchscope.report.doctor import sections_table
    from torchscope.report.document import verdict, verdict_level
    from torchscope.report.findings import findings_table

    for o in report.outcomes:
        if debug and o.error is not None:  # reported in one line above; show where from
            # A rank's error arrives pickled, its traceback as text beside it.
            where = getattr(o.error, "rank_traceback", None) or \
                "".join(traceback.format_exception(o.error))
            sys.stderr.write(f"section {o.name} failed:\n{where}")
    failed = [o.name for o in report.outcomes if o.status == "failed"]
    # The verdict first: the one line to act on; report.json and the page lead with it too.
    style = {"failed": "bold red", "warning": "yellow",
             "healthy": "bold green"}[verdict_level(report)]
    console.print(f"[{style}]verdict:[/] {escape(verdict(report))}")
    findings = report.section_findings()
    if findings:
        console.print(findings_table(findings, title="Findings", verbose=verbose))
    if verbose or failed:
        console.print(sections_table(report))
    if verbose and report.step is not None:
        console.print(report.step.describe(), highlight=False, soft_wrap=True)
    if verbose:
        ranks = next((o for o in report.outcomes if o.name == "ranks" and o.status == "ok"),
                     None)
        if ranks is not None:
            from torchscope.doctor.ranks import RanksSection
            from torchscope.report.ranks import ranks_table

            for title, columns, rows in RanksSection().tables(ranks.record):
                console.print(ranks_table(columns, rows, title=title))
    console.print(f"wrote {Path(out) / 'report.html'} and {Path(out) / 'report.json'}")
    # A section that failed could not look: under --fail-on it fails the run too.
    if floor is not None and (failed or any(f.severity >= floor for f in report.findings())):
        raise typer.Exit(1)


def _run_with_progress(model: nn.Module, inputs: ModelInputs, options: DoctorOptions,
                       name: str, quiet: bool = False) -> DoctorReport:
    """Run the doctor, one line per finished section (none with `quiet`); on a terminal also
    the progress display: the section, k of N, its time and, for compile, its limit."""
    from torchscope.doctor import DoctorEvent, run_doctor
    from torchscope.doctor.sections import COMPILE_TIMEOUT_S

    with progress("doctor", quiet=quiet) as steps:

        def show(ev: DoctorEvent) -> None:
            o = ev.outcome
            if o is None:
                # Each compile mode runs in a child process with its own time limit.
                limit = COMPILE_TIMEOUT_S * len(options.compile_modes) \
                    if ev.section == "compile" and not options.fast else None
                steps(f"{ev.title} ({ev.section})", ev.index + 1, ev.total, limit_s=limit)
                return
            if not quiet:
                console.print(f"[{ev.index + 1}/{ev.total}] {o.title}: {o.status} "
                              f"({o.seconds:.1f} s){' - ' + o.note if o.note else ''}",
                              highlight=False, markup=False, soft_wrap=True)

        return run_doctor(model, inputs, options=options, name=name, on_event=show)


def diff(
    old: Annotated[str, typer.Argument(help="The earlier report.json (or its folder).")],
    new: Annotated[str, typer.Argument(help="The later report.json (or its folder).")],
    threshold: Annotated[list[str] | None, typer.Option(
        "--threshold", "-t", help="Allowed relative worsening: 0.1 for every metric, or "
        "NAME=FRAC for metrics starting with NAME (profile.bare_step_ms=25%). "
        "Repeatable.")] = None,
    json_path: JsonOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Compare two doctor reports; exit 1 when a metric regressed beyond its threshold."""
    with guarded(debug):
        check_output(json_path, "--json")
        from torchscope.report.diff import diff_documents, parse_thresholds
        from torchscope.report.doctor import diff_table
        from torchscope.report.document import load_document

        thresholds = parse_thresholds(threshold or [])
        result = diff_documents(load_document(old), load_document(new), thresholds,
                                old_name=old, new_name=new)
        console.print(diff_table(result))
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, markup=False)
        if json_path:
            save_json(json_path, result)
        if not any(c.status not in ("new", "gone") for c in result.changes):
            console.print("the two reports share no metric.")
        regressions = result.regressions
        if regressions:
            console.print(f"[bold red]{len(regressions)} regression(s):[/] "
                          + ", ".join(c.name for c in regressions))
            raise typer.Exit(1)
        console.print("no regression beyond the thresholds.")


def lab(
    skip: Annotated[str | None, typer.Option(
        "--skip", help="Parts not to run, comma-separated: forward, backward, profile, "
        "checkpoint, memory, compile.")] = None,
    fast: Annotated[bool, typer.Option(
        "--fast", help="Compile only in default mode, with fewer timed calls.")] = False,
    device: DeviceOpt = "auto",
    json_path: JsonOpt = None,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when a claim failed.")
                      ] = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check, on this machine, the claims of the tutorial torchscope started from (hooks,
    the profiler, checkpointing, torch.compile on a small CNN and MLP), part by part."""
    with guarded(debug):
        check_output(json_path, "--json")
        from torchscope.lab import MILESTONES, run_lab
        from torchscope.report.doctor import lab_tables

        dev = device_of(device)
        skipped = split_commas(skip)
        parts = [m for m in MILESTONES if m not in skipped]
        with progress("lab", quiet=quiet) as steps:
            result = run_lab(skip=skipped, fast=fast, device=dev, on_milestone=lambda name:
                             steps(name, parts.index(name) + 1, len(parts)))
        for table in lab_tables(result.milestones, result.claims):
            console.print(table)
        console.print(f"{result.held} held, {result.failed} failed, {result.unchecked} not "
                      f"checked here.")
        if json_path:
            save_json(json_path, {"milestones": result.milestones, "claims": result.claims})
        if strict and result.failed:
            raise typer.Exit(1)
