"""`torchscope compile`: is torch.compile worth it? One row per mode."""

from __future__ import annotations

from typing import Annotated

import typer

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
)
from torchscope.cli._progress import progress
from torchscope.errors import CompileError

_DYNAMIC = {"auto": None, "on": True, "true": True, "off": False, "false": False}


def register(app: typer.Typer) -> None:
    """Add `compile` to `app`."""
    app.command("compile")(compile_command)


def compile_command(
    target: TargetArg = None,
    input: InputOpt = None,
    inputs: InputsFnOpt = None,
    modes: ModesOpt = "default,reduce-overhead,max-autotune",
    measure: Annotated[str, typer.Option(
        "--measure", help="forward (inference under no_grad, eval mode) or step (the "
        "training step's forward, loss and backward, train mode).")] = "forward",
    loss: LossOpt = "auto",
    autocast: AutocastOpt = None,
    iters: Annotated[int, typer.Option(help="Timed calls of eager and of compiled.")] = 30,
    warmup: Annotated[int, typer.Option(help="Untimed calls of each before timing.")] = 3,
    timeout: Annotated[float, typer.Option(help="Seconds allowed per mode.")] = 600.0,
    batch_sizes: Annotated[str | None, typer.Option(
        "--batch-sizes", help="After timing, call the compiled model with these batch sizes "
        "(e.g. 16,8) to show shape recompiles and their guards.")] = None,
    dynamic: Annotated[str, typer.Option(
        help="torch.compile(dynamic=...): auto (torch's default), on, off.")] = "auto",
    device: DeviceOpt = "auto",
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Measure torch.compile per mode: compile cost, speedup, break-even calls, graph breaks,
    recompiles and numerical drift. Each mode runs in a child process with a timeout."""
    with guarded(debug):
        check_output(json_path, "--json")
        from torchscope.compile import compile_report
        from torchscope.compile.records import MEASURES
        from torchscope.report.compile import (
            compile_table,
            graph_break_table,
            recompile_table,
            shape_call_lines,
        )
        from torchscope.step import LOSSES, Step

        what = choice("--measure", measure, MEASURES)
        loss_fn = choice("--loss", loss, LOSSES)
        precision = autocast_name(autocast)
        dyn = _DYNAMIC[choice("--dynamic", dynamic.lower(), tuple(_DYNAMIC))]
        at_least("--iters", iters, 1, "times no call")
        at_least("--warmup", warmup, 0, "is below zero")
        if not timeout > 0:  # NaN included
            fail(f"--timeout {timeout:g} leaves no time to compile. Fix: pass --timeout 600 "
                 "(seconds per mode) or another positive value.")
        mode_list = split_commas(modes)
        if not mode_list:
            raise CompileError(f"--modes {modes!r} lists nothing.", fix="pass e.g. --modes a,b.")
        try:
            sizes = tuple(int(t) for t in split_commas(batch_sizes))
        except ValueError:
            raise CompileError(f"--batch-sizes {batch_sizes!r} is not a list of integers.",
                               fix="pass e.g. --batch-sizes 16,8.") from None
        dev = device_of(device)
        loaded, model_inputs = load(target, input, inputs)
        loaded.model.to(dev)
        model_inputs = model_inputs.to(dev)

        step = Step(loaded.model, model_inputs, loss_fn=loss_fn).with_autocast(precision)
        with progress("compile", quiet=quiet) as steps:

            def say(line: str, limit_s: float | None) -> None:
                # "MODE: measuring in a child process (timeout N s)": the mode is in the label.
                steps.note(line.partition(": ")[2] or line, limit_s=limit_s)

            report = compile_report(
                step, measure=what, modes=mode_list,
                iters=iters, warmup=warmup, timeout_s=timeout, batch_sizes=sizes,
                dynamic=dyn, name=loaded.name, factory=loaded.name, progress=say,
                on_mode=lambda mode, k, n: steps(f"mode {mode}", k, n))
        if report.step is not None:
            console.print(report.step.describe(), highlight=False, markup=False)
        console.print(compile_table(report))
        if report.graph_breaks:
            console.print(graph_break_table(report.graph_breaks))
        for m in report.modes:
            if m.recompiles:
                console.print(recompile_table(m.recompiles, m.recompile_limit,
                                              title=f"Recompiles in mode {m.mode}"))
            for line in shape_call_lines(m):
                console.print(line, highlight=False, markup=False)
        for note in report.notes:
            console.print(f"note: {note}", highlight=False, markup=False)
        findings = report.findings()
        if findings:
            from torchscope.report.findings import findings_table

            console.print(findings_table(findings))
        if json_path:
            save_json(json_path, {"target": loaded.name, "report": report, "findings": findings})
