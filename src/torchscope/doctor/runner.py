"""Run the doctor's sections on one model: collect, analyze, never let one section sink the rest."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

import torch
from torch import nn

from torchscope.doctor._env import quiet_kineto, seeded
from torchscope.doctor.section import (
    CapabilityMissingError,
    DoctorOptions,
    Metric,
    Section,
    SectionOutcome,
)
from torchscope.errors import TorchscopeError
from torchscope.findings import Finding, Severity
from torchscope.models.target import ModelInputs, call_model

__all__ = ["DoctorEvent", "DoctorReport", "TargetInfo", "run_doctor"]


@dataclass(frozen=True)
class TargetInfo:
    """What was examined.

    Attributes:
        name: the TARGET as given (`tiny-cnn`, `factory.py:build`) or the class name.
        model_class: the model's class.
        parameters, trainable: parameter counts.
        inputs: the input shapes, as `ModelInputs.describe()` gives them.
        device: where the model ran.
    """

    name: str
    model_class: str
    parameters: int
    trainable: int
    inputs: str
    device: str


@dataclass(frozen=True)
class DoctorReport:
    """Everything one doctor run produced; renderers read only this.

    Attributes:
        target: what was examined.
        options: what was asked.
        outcomes: one per section, in run order.
        environment: torch/python/platform facts for the report.
        created: ISO-8601 UTC time the run started.
        seconds: wall time of the whole run.
    """

    target: TargetInfo
    options: DoctorOptions
    outcomes: tuple[SectionOutcome, ...]
    environment: dict[str, str | int | bool]
    created: str
    seconds: float

    def outcome(self, name: str) -> SectionOutcome:
        """The outcome of the section called `name`.

        Raises:
            KeyError: no such section ran.
        """
        for o in self.outcomes:
            if o.name == name:
                return o
        raise KeyError(name)

    @property
    def findings(self) -> list[tuple[str, Finding]]:
        """(section, finding) pairs, most severe first, stable in run order within a severity."""
        pairs = [(o.name, f) for o in self.outcomes for f in o.findings]
        return sorted(pairs, key=lambda p: -int(p[1].severity))

    @property
    def metrics(self) -> dict[str, Metric]:
        """Every section's headline numbers."""
        return {k: v for o in self.outcomes for k, v in o.metrics.items()}

    def count(self, severity: Severity) -> int:
        """How many findings have this severity."""
        return sum(1 for _, f in self.findings if f.severity == severity)


@dataclass(frozen=True)
class DoctorEvent:
    """Progress: a section starts (`outcome` None) or finishes."""

    section: str
    title: str
    phase: Literal["start", "done"]
    index: int
    total: int
    outcome: SectionOutcome | None = field(default=None)


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Give the model back exactly as it was: values, grads, requires_grad, training flags.

    Sections run optimizer steps and backward passes; the user's model must not notice.
    This costs one copy of the parameters, buffers and existing gradients for the duration
    of a section. Gradients are copied too: a backward accumulates into an existing `.grad`
    in place, so restoring the tensor object alone would hand back changed values.
    """
    with torch.no_grad():
        tensors = model.state_dict(keep_vars=True)
        saved = {k: v.detach().clone() for k, v in tensors.items()}
        grads = [(p, p.grad, None if p.grad is None else p.grad.detach().clone())
                 for p in model.parameters()]
    requires = [(p, p.requires_grad) for p in model.parameters()]
    flags = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        with torch.no_grad():
            for k, v in model.state_dict(keep_vars=True).items():
                if k in saved and v.shape == saved[k].shape:
                    v.copy_(saved[k])
            for p, g, values in grads:
                if g is not None and values is not None:
                    g.copy_(values)
                p.grad = g
        for p, r in requires:
            p.requires_grad_(r)
        for m, f in flags:
            m.training = f


def _environment(device: str) -> dict[str, str | int | bool]:
    env: dict[str, str | int | bool] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "device": device,
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count() or 1,
        "cuda": torch.cuda.is_available(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def _one(section: Section[Any], model: nn.Module, inputs: ModelInputs,
         options: DoctorOptions) -> SectionOutcome:
    base: dict[str, Any] = {"name": section.name, "title": section.title, "section": section}
    if section.name in options.skip:
        return SectionOutcome(status="skipped", note="skipped by --skip", **base)
    if options.fast and section.slow:
        return SectionOutcome(status="skipped", note="skipped by --fast", **base)
    t0 = time.perf_counter()
    try:
        with seeded(options.seed), _preserved(model):
            result = section.run(model, inputs, options)
        findings = tuple(section.analyze(result))
        metrics = section.metrics(result)
    except CapabilityMissingError as exc:
        return SectionOutcome(status="unavailable", note=f"not available: {exc}",
                              seconds=time.perf_counter() - t0, **base)
    except TorchscopeError as exc:
        return SectionOutcome(status="failed", note=exc.one_line(),
                              seconds=time.perf_counter() - t0, **base)
    except Exception as exc:  # one section's bug must not lose the others' results
        first = (str(exc).strip().splitlines() or [""])[0]
        return SectionOutcome(status="failed", note=f"{type(exc).__name__}: {first}",
                              seconds=time.perf_counter() - t0, **base)
    return SectionOutcome(status="ok", seconds=time.perf_counter() - t0, result=result,
                          findings=findings, metrics=metrics, **base)


def run_doctor(
    model: nn.Module,
    inputs: Any,
    *,
    options: DoctorOptions | None = None,
    sections: Sequence[Section[Any]] | None = None,
    name: str | None = None,
    on_event: Callable[[DoctorEvent], None] | None = None,
) -> DoctorReport:
    """Examine `model` on `inputs` with every registered section.

    The model is left exactly as it was (parameters, buffers, `.grad`, `requires_grad`,
    training flags), even though sections run backward and optimizer steps. Each section
    runs with torch's RNGs seeded from `options.seed`; the caller's RNG states are restored.

    Args:
        model: the model, already on `options.device`.
        inputs: a tensor, tuple, dict or `ModelInputs`, on the same device.
        options: what to run; defaults to `DoctorOptions()`.
        sections: the sections to run; default: the registered ones.
        name: the target's name for the report.
        on_event: called when each section starts and finishes (progress display).

    Returns:
        The report; a section that failed or is unavailable says so in its outcome.

    Raises:
        ModelError: the model cannot run on these inputs at all (checked once, first).
    """
    from torchscope.doctor.sections import registered_sections

    quiet_kineto()
    options = options or DoctorOptions()
    model_inputs = ModelInputs.of(inputs)
    chosen = list(sections) if sections is not None else registered_sections()
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    # One plain forward first: bad inputs are the user's error, not five failed sections.
    with _preserved(model), torch.no_grad():
        call_model(model, model_inputs)
    outcomes = []
    for i, section in enumerate(chosen):
        if on_event is not None:
            on_event(DoctorEvent(section.name, section.title, "start", i, len(chosen)))
        outcome = _one(section, model, model_inputs, options)
        outcomes.append(outcome)
        if on_event is not None:
            on_event(DoctorEvent(section.name, section.title, "done", i, len(chosen), outcome))
    params = list(model.parameters())
    target = TargetInfo(
        name or type(model).__name__, type(model).__name__,
        sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad),
        model_inputs.describe(), options.device)
    return DoctorReport(target, options, tuple(outcomes), _environment(options.device), created,
                        time.perf_counter() - t0)

