"""`torchscope grads`: per-layer gradient norms for one or more training steps."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from torchscope.cli._common import (
    AutocastOpt,
    DebugOpt,
    DepthOpt,
    DeviceOpt,
    InputOpt,
    InputsFnOpt,
    JsonOpt,
    LossOpt,
    QuietOpt,
    SelectOpt,
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
    """Add `grads` to `app`."""
    app.command("grads")(grads)


def grads(
    target: TargetArg = None,
    input: InputOpt = None,
    inputs: InputsFnOpt = None,
    loss: LossOpt = "auto",
    autocast: AutocastOpt = None,
    steps: Annotated[int, typer.Option(
        "--steps", help="Training steps (SGD) to run; each one is sampled.")] = 1,
    lr: Annotated[float, typer.Option("--lr", help="SGD learning rate for --steps > 1.")] = 0.01,
    select: SelectOpt = None,
    depth: DepthOpt = None,
    device: DeviceOpt = "auto",
    plot: Annotated[str | None, typer.Option(
        "--plot", help="Write the gradient-flow plot here (.png or .svg); with --steps > 1 "
        "also a layers × steps heatmap next to it.")] = None,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Gradient flow: the norm of the gradient reaching and leaving every layer."""
    with guarded(debug):
        check_output(json_path, "--json")
        check_output(plot, "--plot", suffixes=(".png", ".svg"))
        if plot and steps > 1:  # the heatmap written next to it
            p = Path(plot)
            check_output(str(p.with_name(f"{p.stem}-heatmap{p.suffix}")), "--plot's heatmap",
                         suffixes=(".png", ".svg"))

        from torchscope.errors import TorchscopeError
        from torchscope.grads import watch_gradients
        from torchscope.report.findings import finding_lines
        from torchscope.report.grads import grad_table, history_table
        from torchscope.step import LOSSES, Step

        loss_fn = choice("--loss", loss, LOSSES)
        precision = autocast_name(autocast)
        at_least("--steps", steps, 1, "runs nothing")
        at_least("--depth", depth, 0, "selects no module")
        check_lr(lr)

        dev = device_of(device)
        loaded, model_inputs = load(target, input, inputs)
        model = loaded.model.to(dev).train()
        model_inputs = model_inputs.to(dev)
        opt = trainable_sgd(model, lr, loaded.name)
        step = Step(model, model_inputs, loss_fn=loss_fn, optimizer=opt).with_autocast(
            precision)
        with watch_gradients(model, every=1, optimizer=opt, scaler=step.scaler, select=select,
                             depth=depth) as watch, progress("grads", quiet=quiet) as shown:
            shown("step", 1, steps)
            first = step.run()
            for k in range(2, steps + 1):
                shown("step", k, steps)
                step.run()
        info = step.info(first)
        flow = watch.last
        if flow is None:
            raise TorchscopeError("no step was sampled.", fix="rerun with --debug.")
        console.print(info.describe())
        console.print(grad_table(flow, title=f"Gradient flow of {loaded.name}, step "
                                 f"{flow.index} (backward order)"))
        history = watch.history
        if steps > 1:
            console.print(history_table(history))
        found = watch.findings()
        for line in finding_lines(found):
            console.print(line)
        if not found:
            console.print("no gradient problem found.")
        if plot:
            from torchscope.report.plots_grads import (
                plot_grad_heatmap,
                plot_gradient_flow,
                save_figure,
            )

            with writing("--plot", plot):
                written = [save_figure(plot_gradient_flow(flow), plot)]
                if steps > 1:
                    p = Path(plot)
                    written.append(save_figure(plot_grad_heatmap(history),
                                               p.with_name(f"{p.stem}-heatmap{p.suffix}")))
            console.print("wrote " + ", ".join(str(w) for w in written))
        if json_path:
            save_json(json_path, {"target": loaded.name, "step": info, "steps": steps,
                                  "flow": flow, "history": history, "findings": found})
