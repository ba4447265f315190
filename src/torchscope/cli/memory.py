"""`torchscope memory`: what one training step keeps, and checkpointing planned and verified."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, cast

import typer

from torchscope.cli._common import (
    AutocastOpt,
    DebugOpt,
    DepthOpt,
    DeviceOpt,
    InputOpt,
    InputsFnOpt,
    JsonOpt,
    QuietOpt,
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
    writing,
)
from torchscope.cli._progress import progress

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchscope.memory import CheckpointChoice

_CHOICES = ("none", "all", "sqrt", "auto")
_OPTIMIZERS = ("none", "sgd", "momentum", "adam", "adamw")


def register(app: typer.Typer) -> None:
    """Add `memory` to `app`."""
    app.command("memory")(memory)


def memory(
    target: TargetArg = None,
    input: InputOpt = None,
    inputs: InputsFnOpt = None,
    checkpoint: Annotated[str, typer.Option(
        "--checkpoint", "-c",
        help="Plan gradient checkpointing: none, all (every block), sqrt (√L segments, "
        "Chen et al. 2016) or auto (least recompute within --budget). The chosen plan is "
        "applied, verified against a normal step, and removed again.")] = "none",
    budget: Annotated[str | None, typer.Option(
        "--budget", "-b", help="Saved-activation budget for auto, e.g. 64KB or 2GB "
        "(1024-based). Implies --checkpoint auto.")] = None,
    blocks: Annotated[str | None, typer.Option(
        "--blocks", help="Blocks to checkpoint: a container name (transformer.h), globs or "
        "type names, comma-separated.", show_default="the model's list of repeated blocks")
    ] = None,
    loss: Annotated[str, typer.Option(
        "--loss", help="The step's loss: auto (the model's .loss, else cross-entropy on "
        "logits or mse, against seeded targets), cross_entropy, mse or sum (saves nothing: "
        "only the model's own tensors are counted).")] = "auto",
    autocast: AutocastOpt = None,
    optimizer: Annotated[str, typer.Option(
        help="Count this optimizer's state too: none, sgd, momentum, adam, adamw.")] = "none",
    select: SelectOpt = None,
    depth: DepthOpt = None,
    device: DeviceOpt = "auto",
    eval_mode: Annotated[bool, typer.Option(
        "--eval", help="Analyse in eval mode; without it, train mode (dropout active).")
    ] = False,
    repeats: Annotated[int, typer.Option(
        help="Timed steps per plan at least (more until the median is known; compared with "
        "steps without checkpointing).")] = 5,
    live: Annotated[bool, typer.Option(
        "--live", help="Also list the largest live tensors and what holds them.")] = False,
    json_path: JsonOpt = None,
    plot: Annotated[str | None, typer.Option(
        "--plot", help="Save a PNG/SVG: saved bytes per module, plans' memory vs recompute.")
    ] = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Memory of one training step: saved activations per module, totals, measured peak, and
    gradient checkpointing plans (verified: gradients identical with and without)."""
    with guarded(debug):
        check_output(json_path, "--json")
        check_output(plot, "--plot", suffixes=(".png", ".svg"))
        import torch

        from torchscope.errors import TorchscopeError
        from torchscope.memory import analyze_memory, live_tensors, parse_bytes
        from torchscope.report.memory import (
            blocks_table,
            live_table,
            plans_table,
            saved_table,
            totals_table,
            verification_table,
        )
        from torchscope.step import LOSSES, Step

        if checkpoint not in _CHOICES:
            raise TorchscopeError(f"--checkpoint {checkpoint!r} is not a plan.",
                                  fix=f"use one of {', '.join(_CHOICES)}.")
        if loss not in LOSSES:
            raise TorchscopeError(f"--loss {loss!r} is not a known loss.",
                                  fix=f"use one of {', '.join(LOSSES)}.")
        if optimizer not in _OPTIMIZERS:
            raise TorchscopeError(f"--optimizer {optimizer!r} is not supported.",
                                  fix=f"use one of {', '.join(_OPTIMIZERS)}.")
        at_least("--repeats", repeats, 1, "measures nothing")
        at_least("--depth", depth, 0, "selects no module")
        precision = autocast_name(autocast)
        limit = parse_bytes(budget) if budget is not None else None
        if limit is not None and checkpoint in ("all", "sqrt"):
            raise TorchscopeError(
                f"--budget {budget} was given with --checkpoint {checkpoint}, a plan that "
                "takes no budget.", fix="drop --checkpoint (--budget implies auto), or drop "
                "--budget.")
        dev = device_of(device)
        loaded, model_inputs = load(target, input, inputs)
        model = loaded.model.to(dev)
        model_inputs = model_inputs.to(dev)
        if checkpoint != "none" or limit is not None:
            _check_blocks(model, blocks)  # nothing to checkpoint: one line, before any work
        model.train(not eval_mode)
        opt = _make_optimizer(optimizer, model)
        step = Step(model, model_inputs, loss_fn=loss, optimizer=opt).with_autocast(precision)
        with progress("memory", quiet=quiet) as shown:  # a spinner and the time spent
            shown("saved activations, the measured step and any checkpoint plan", 1)
            report = analyze_memory(step, checkpoint=cast("CheckpointChoice", checkpoint),
                                    budget=limit, blocks=blocks, repeats=repeats,
                                    select=select, depth=depth, name=loaded.name)
        mode = "eval" if eval_mode else "train"
        console.print(saved_table(report.saved,
                                  title=f"Saved activations of {loaded.name} ({mode} mode, "
                                  f"inputs {model_inputs.describe()})"))
        console.print(report.step.describe())
        console.print(totals_table(report.totals, report.measured))
        if report.plans is not None:
            console.print(blocks_table(report.plans))
            console.print(plans_table(report.plans, report.chosen))
            if report.verification is not None:
                console.print(verification_table(
                    report.verification, title=f"Verification of plan {report.chosen}"))
        findings = report.findings()
        live_report = None
        if live:
            del opt, step
            live_report = live_tensors(15)
            console.print(live_table(live_report))
            findings += live_report.findings()
        from torchscope.report.findings import finding_lines

        for line in finding_lines(findings):
            console.print(line)
        if plot:
            from torchscope.report.plots_memory import plot_memory

            with writing("--plot", plot):
                plot_memory(report.saved, report.plans, plot)
            console.print(f"wrote {plot}")
        if json_path:
            save_json(json_path, {"target": loaded.name, "report": report, "findings": findings,
                                  "live": live_report, "torch": torch.__version__})


def _check_blocks(model: nn.Module, blocks: str | None) -> None:
    """`resolve_blocks`, with the advice for a model without blocks of its own in the CLI's
    terms (`--blocks a,b`, not Python's `blocks=['a', 'b']`): asked of `default_blocks`
    before `resolve_blocks` would raise it, so no error is told apart by its words.

    Raises:
        SelectionError: nothing to checkpoint.
    """
    from torchscope.errors import SelectionError
    from torchscope.memory import resolve_blocks
    from torchscope.memory.checkpoint import default_blocks, no_blocks_message

    if blocks is None and default_blocks(model) is None:
        raise SelectionError(no_blocks_message(model), fix="name the blocks: --blocks "
                             "layer1,layer2, or a glob such as --blocks 'layers.*'.")
    resolve_blocks(model, blocks)


def _make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer | None:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if name == "none" or not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01)
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params)
    return torch.optim.AdamW(params)
