"""Run the doctor's sections on one model through one shared `Step`: collect, never let one
section sink the rest, and give the model back exactly as it was."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

import torch
from torch import nn

from torchscope._process import quiet_kineto, seeded
from torchscope.doctor.section import DoctorOptions, Section
from torchscope.doctor.sections import registered_sections
from torchscope.errors import TorchscopeError, describe
from torchscope.findings import Analyzed
from torchscope.hooks.session import check_not_scripted
from torchscope.report.document import Report, SectionOutcome, TargetInfo, machine_facts
from torchscope.step import Step, StepInfo

__all__ = ["DoctorEvent", "DoctorReport", "doctor_step", "run_doctor"]


@dataclass(frozen=True)
class DoctorReport(Report):
    """What one `run_doctor` produced: the report document of `torchscope.report.document`,
    filled by the doctor. `findings()` gives every section's findings, most severe first;
    `outcome(name).record` is the capability's own record of that section."""


@dataclass(frozen=True)
class DoctorEvent:
    """Progress: a section starts (`outcome` None) or finishes."""

    section: str
    title: str
    phase: Literal["start", "done"]
    index: int
    total: int
    outcome: SectionOutcome | None = None


def _run_one(section: Section[Any], step: Step, options: DoctorOptions) -> SectionOutcome:
    base: dict[str, Any] = {"name": section.name, "title": section.title,
                            "capability": section.capability, "renderer": section}
    if section.name in options.skip:
        return SectionOutcome(status="skipped", note="skipped by --skip", **base)
    if options.fast and section.slow:
        return SectionOutcome(status="skipped", note="skipped by --fast", **base)
    if (why := section.skip_reason(options)) is not None:
        return SectionOutcome(status="skipped", note=why, **base)
    t0 = time.perf_counter()
    try:
        # Seeded the same way before every section, on the unchanged model: each section's
        # first step is the same computation (dropout masks and seeded targets included).
        with seeded(options.seed), step.preserved():
            record = section.run(step, options)
        findings = tuple(record.findings()) if isinstance(record, Analyzed) else ()
        metrics = section.metrics(record)
        data = section.to_json(record)
    except Exception as exc:  # one section's failure must not lose the others' results
        return SectionOutcome(status="failed", note=describe(exc), error=exc,
                              seconds=time.perf_counter() - t0, **base)
    return SectionOutcome(status="ok", seconds=time.perf_counter() - t0, record=record,
                          data=data, findings=findings, metrics=metrics, **base)


def doctor_step(model: nn.Module | Step, inputs: Any, options: DoctorOptions) -> Step:
    """The training step every section of the doctor measures: `model` itself where it is a
    `Step`, else the model on `inputs` with the options' loss and autocast, and plain SGD."""
    if isinstance(model, Step):
        given = ("loss_fn", options.loss_fn) if options.loss_fn != "auto" else \
            ("autocast", options.autocast) if options.autocast is not None else None
        if given is not None:
            raise TorchscopeError(f"options.{given[0]}={given[1]!r} was given with a Step.",
                                  fix="set it on the Step: " + (
                                      "Step(model, x, loss_fn=...)." if given[0] == "loss_fn"
                                      else f"Step(model, x).with_autocast({given[1]!r})."))
        return Step.of(model, inputs)
    # Plain SGD over the trainable parameters: the optimizer phase is timed and its state
    # counted, without momentum buffers that would make later steps differ from the first.
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-3) if params else None
    return Step(model, inputs, loss_fn=options.loss_fn, optimizer=optimizer,
                seed=options.seed).with_autocast(options.autocast)


def run_doctor(
    model: nn.Module | Step,
    inputs: Any = None,
    *,
    options: DoctorOptions | None = None,
    sections: Sequence[Section[Any]] | None = None,
    name: str | None = None,
    on_event: Callable[[DoctorEvent], None] | None = None,
) -> DoctorReport:
    """Examine a model with every registered section, all on one training step.

    The doctor builds one `Step` (the loss of `options.loss_fn`, targets seeded with
    `options.seed`, plain SGD with lr 1e-3 over the trainable parameters), or takes the one
    given, and every section measures that step through its capability's public function.
    The model is given back exactly as it was after each section (`torchscope.step.preserved`:
    parameters, buffers, `.grad`, `requires_grad`, training flags, the optimizer's state).
    Each section runs with torch's generators seeded from `options.seed`; the caller's
    generator states, the environment and the compiler's caches are left as they were.

    Args:
        model: the model, already on `options.device`; or a ready `Step` (AMP, accumulation,
            your own loss, target or optimizer), in which case `inputs` and `options.loss_fn`
            stay unset.
        inputs: a tensor, tuple, dict or `ModelInputs`, on the same device.
        options: what to run; defaults to `DoctorOptions()`.
        sections: the sections to run; default: the registered ones.
        name: the target's name for the report.
        on_event: called when each section starts and finishes (progress display).

    Returns:
        The report; a section that failed says so in its outcome, which keeps the exception.

    Raises:
        ModelError: the model cannot run on these inputs at all (checked once, first).
        TorchscopeError: the step cannot be built (a `Step` given with inputs or with
            `options.loss_fn`, an unknown loss).
    """
    options = options or DoctorOptions()
    # Every section would fail on it the same way: one error, before any work.
    check_not_scripted(model.model if isinstance(model, Step) else model)
    step = doctor_step(model, inputs, options)
    chosen = list(sections) if sections is not None else registered_sections()
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    outcomes = []
    with quiet_kineto():
        # One plain forward first: bad inputs are the user's error, not five failed sections.
        with step.preserved(), torch.no_grad():
            step.forward()
        for i, section in enumerate(chosen):
            if on_event is not None:
                on_event(DoctorEvent(section.name, section.title, "start", i, len(chosen)))
            outcome = _run_one(section, step, options)
            outcomes.append(outcome)
            if on_event is not None:
                on_event(DoctorEvent(section.name, section.title, "done", i, len(chosen),
                                     outcome))
    infos = [o.record.step for o in outcomes
             if o.status == "ok" and isinstance(getattr(o.record, "step", None), StepInfo)]
    params = list(step.model.parameters())
    target = TargetInfo(
        name or type(step.model).__name__, type(step.model).__name__,
        sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad),
        step.inputs.describe(), options.device)
    return DoctorReport(target, options.to_json(), tuple(outcomes),
                        machine_facts(options.device), created, time.perf_counter() - t0,
                        infos[0] if infos else step.info(None))
