"""`torchscope profile`: top ops, the forward/backward/optimizer split and time per module."""

from __future__ import annotations

from pathlib import Path
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
    QuietOpt,
    TargetArg,
    at_least,
    autocast_name,
    check_lr,
    check_output,
    choice,
    console,
    device_of,
    guarded,
    load,
    save_json,
    trainable_sgd,
    writing,
)
from torchscope.cli._progress import progress


def register(app: typer.Typer) -> None:
    """Add `profile` to `app`."""
    app.command("profile")(profile)


def profile(
    target: TargetArg = None,
    input: InputOpt = None,
    inputs: InputsFnOpt = None,
    loss: LossOpt = "auto",
    autocast: AutocastOpt = None,
    steps: Annotated[int, typer.Option(help="Profiled (active) steps.")] = 5,
    wait: Annotated[int, typer.Option(help="Schedule steps skipped first.")] = 1,
    warmup: Annotated[int, typer.Option(help="Schedule steps profiled but discarded.")] = 1,
    sort: Annotated[str, typer.Option(
        help="Op order: self_cpu, total, self_cuda, cuda_total or calls.")] = "self_cpu",
    by: Annotated[str, typer.Option(help="Table: op or module.")] = "op",
    limit: Annotated[int, typer.Option(help="Rows of the op or module table.")] = 15,
    group_by_shape: Annotated[bool, typer.Option(
        "--group-by-shape", help="One op row per input shape.")] = False,
    select: Annotated[str | None, typer.Option(
        "--select", "-s", help="Time only these modules (glob or type name).")] = None,
    depth: Annotated[int | None, typer.Option(help="Time modules this deep or shallower.")
                     ] = None,
    device: DeviceOpt = "auto",
    lr: Annotated[float, typer.Option(help="SGD learning rate of the profiled steps.")] = 0.01,
    trace: Annotated[str | None, typer.Option(
        help="Write a Chrome/Perfetto trace (.json or .json.gz).")] = None,
    trace_steps: Annotated[int, typer.Option(help="Profiled steps kept in the trace.")] = 3,
    text: Annotated[str | None, typer.Option(help="Also write the tables as text here.")
                    ] = None,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Profile training steps: top ops, phase split and time per module (SGD; the loss is
    --loss, by default cross-entropy on seeded targets for logits)."""
    with guarded(debug):
        for path, option in ((trace, "--trace"), (text, "--text"), (json_path, "--json")):
            check_output(path, option)

        from torchscope.profiling import SORT_KEYS, ProfilingError, profile_steps
        from torchscope.report.profiling import profile_text, summary_renderables
        from torchscope.step import LOSSES, Step

        if trace and not trace.lower().endswith((".json", ".json.gz")):
            # torch writes a Chrome trace as JSON (gzipped for .gz) whatever the name.
            raise ProfilingError(f"--trace {trace!r} must end in .json or .json.gz.",
                                 fix="write e.g. --trace trace.json.")

        loss_fn = choice("--loss", loss, LOSSES)
        precision = autocast_name(autocast)
        choice("--sort", sort, SORT_KEYS)
        choice("--by", by, ("op", "module"))
        at_least("--steps", steps, 1, "profiles no step")
        at_least("--wait", wait, 0, "is below zero")
        at_least("--warmup", warmup, 0, "is below zero")
        at_least("--limit", limit, 1, "shows no row")
        at_least("--depth", depth, 0, "selects no module")
        at_least("--trace-steps", trace_steps, 1, "keeps no step in the trace")
        if by == "op" and (select is not None or depth is not None):
            # They choose the modules timed one by one: by op nothing would read them.
            raise ProfilingError(
                f"{'--select' if select is not None else '--depth'} chooses modules to time "
                "one by one, but --by op shows ops.", fix="add --by module.")
        check_lr(lr)
        dev = device_of(device)
        loaded, model_inputs = load(target, input, inputs)
        model = loaded.model.to(dev).train()
        model_inputs = model_inputs.to(dev)
        step = Step(model, model_inputs, loss_fn=loss_fn,
                    optimizer=trainable_sgd(model, lr, loaded.name)).with_autocast(precision)
        # The trace is written by the profiler, at the end of its run.
        with writing("--trace", trace), progress("profile", quiet=quiet) as shown:
            result = profile_steps(
                step, steps=steps, wait=wait, warmup=warmup,
                by_module=by == "module" or json_path is not None or text is not None,
                select=select, depth=depth, group_by_input_shape=group_by_shape,
                trace=trace, trace_steps=trace_steps, on_step=shown,
            )
        findings = result.findings()
        for part in summary_renderables(result, findings, sort=sort, by=by, limit=limit):
            console.print(part)
        for note in result.notes:
            console.print(f"[dim]note: {note}[/]")
        if trace:
            console.print(f"wrote trace {trace} (last {min(trace_steps, steps)} profiled steps; "
                          "open it in https://ui.perfetto.dev or chrome://tracing)")
        if text:
            with writing("--text", text):
                Path(text).parent.mkdir(parents=True, exist_ok=True)
                Path(text).write_text(profile_text(result, findings, sort=sort, by=by,
                                                   limit=limit))
            console.print(f"wrote {text}")
        if json_path:
            save_json(json_path, {"target": loaded.name, "inputs": model_inputs.describe(),
                                  "result": result, "findings": findings})
