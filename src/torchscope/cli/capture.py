"""`torchscope capture`: record every selected module's output for one forward."""

from __future__ import annotations

import typer

from torchscope.cli._common import (
    AutocastOpt,
    DebugOpt,
    DepthOpt,
    DeviceOpt,
    InputOpt,
    InputsFnOpt,
    JsonOpt,
    SelectOpt,
    TargetArg,
    at_least,
    autocast_name,
    check_output,
    console,
    device_of,
    guarded,
    load,
    save_json,
)


def register(app: typer.Typer) -> None:
    """Add `capture` to `app`."""
    app.command("capture")(capture)


def capture(
    target: TargetArg = None,
    input: InputOpt = None,
    inputs: InputsFnOpt = None,
    select: SelectOpt = None,
    depth: DepthOpt = None,
    autocast: AutocastOpt = None,
    device: DeviceOpt = "auto",
    json_path: JsonOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Capture activations: shape, dtype and statistics of every module output."""
    with guarded(debug):
        check_output(json_path, "--json")
        from torchscope.capture import capture_activations, trace_nonfinite
        from torchscope.report.capture import activation_table, nonfinite_lines
        from torchscope.step import Step

        precision = autocast_name(autocast)
        at_least("--depth", depth, 0, "selects no module")
        dev = device_of(device)
        loaded, model_inputs = load(target, input, inputs)
        step = Step(loaded.model.to(dev), model_inputs.to(dev)).with_autocast(precision)
        cap = capture_activations(step, select=select, depth=depth)
        records = cap.records
        console.print(activation_table(records, title=f"Activations of {loaded.name}"))
        trace = trace_nonfinite(records)
        for line in nonfinite_lines(trace):
            console.print(f"[red]{line}[/]")
        if json_path:
            save_json(json_path, {"target": loaded.name, "records": records, "nonfinite": trace})
