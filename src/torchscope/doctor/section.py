"""The `Section` contract: one part of the doctor report, from measurement to HTML.

A section runs one capability on the model (`run` → a frozen result record), draws its
conclusions (`analyze` → `Finding`s), exposes headline numbers for `torchscope diff`
(`metrics`), serialises itself (`to_json`) and renders itself (`html`, `plots`). The runner
calls these in that order and never looks inside a result.

Sections whose capability lives in another subpackage import it lazily inside `run`; when the
import fails the runner marks the section *unavailable* with the reason and carries on.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from torch import nn

from torchscope.findings import Finding
from torchscope.models.target import ModelInputs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "Better",
    "CapabilityMissingError",
    "DoctorOptions",
    "Metric",
    "Section",
    "SectionOutcome",
    "Status",
    "load_capability",
    "optional_capability",
]

R = TypeVar("R")
Status = Literal["ok", "skipped", "unavailable", "failed"]
Better = Literal["lower", "higher"]


@dataclass(frozen=True)
class DoctorOptions:
    """What the user asked the doctor for.

    Attributes:
        fast: trade depth for time (see `docs/report-schema.md` and `torchscope doctor --help`):
            compile is skipped and profiling runs fewer steps.
        skip: section names not to run.
        loss: how to turn the model's output into a scalar loss: `auto`, `cross_entropy`,
            `mse` or `sum` (passed to the capabilities that run backward).
        steps: profiled training steps (`fast` lowers it to 3).
        compile_modes: the torch.compile modes to measure.
        compile_iters: timed calls per compile mode.
        device: the device the model and inputs were moved to.
        seed: seed for every random draw the doctor makes (targets, labels).
    """

    fast: bool = False
    skip: frozenset[str] = frozenset()
    loss: str = "auto"
    steps: int = 5
    compile_modes: tuple[str, ...] = ("default",)
    compile_iters: int = 20
    device: str = "cpu"
    seed: int = 0

    @property
    def profile_steps(self) -> int:
        """Profiled steps after `fast` is applied."""
        return min(self.steps, 3) if self.fast else self.steps


@dataclass(frozen=True)
class Metric:
    """A headline number that `torchscope diff` compares between two reports.

    Attributes:
        value: the measured number (None when it could not be measured).
        better: whether a `lower` or `higher` value is an improvement.
        unit: `ratio`, `bytes`, `ms`, `count` or `x` (a speedup factor); for display.
        label: what it measures, in a few words.
    """

    value: float | None
    better: Better
    unit: str
    label: str


class CapabilityMissingError(Exception):
    """A section's capability cannot be imported yet; the message says which name failed."""


def load_capability(dotted: str) -> Any:
    """Import `package.module.name` lazily and return `name`.

    Raises:
        CapabilityMissingError: the module cannot be imported or lacks the name.
    """
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise CapabilityMissingError(f"this install has no {dotted}") from exc


def optional_capability(dotted: str) -> Any:
    """Like `load_capability`, but None when the name is missing."""
    try:
        return load_capability(dotted)
    except CapabilityMissingError:
        return None


class Section(ABC, Generic[R]):
    """One part of the doctor: subclasses set `name`, `title` and `capability`.

    Attributes:
        name: stable identifier, used by `--skip` and as the key in report.json.
        title: heading in the HTML report and the terminal.
        capability: the dotted name of the function the section needs, for messages.
        slow: whether `--fast` skips it.
    """

    name: str = ""
    title: str = ""
    capability: str = ""
    slow: bool = False

    @abstractmethod
    def run(self, model: nn.Module, inputs: ModelInputs, options: DoctorOptions) -> R:
        """Measure; return a frozen record. Raise `CapabilityMissingError` when not installed."""

    @abstractmethod
    def analyze(self, result: R) -> list[Finding]:
        """Pure: conclusions drawn from the record."""

    @abstractmethod
    def to_json(self, result: R) -> dict[str, Any]:
        """JSON-ready `data` object for report.json (see report.schema.json)."""

    def metrics(self, result: R) -> dict[str, Metric]:
        """Headline numbers for `torchscope diff`, keyed `"<section>.<what>"`."""
        return {}

    def plots(self, result: R) -> dict[str, Figure]:
        """Figures to embed in the HTML report, by plot id."""
        return {}

    def html(self, result: R, plots: Mapping[str, str]) -> str:
        """An HTML fragment (tables) for this section; `plots` maps plot id to inline SVG."""
        return ""


@dataclass(frozen=True)
class SectionOutcome:
    """What running one section produced.

    Attributes:
        name, title: the section's.
        status: `ok`, `skipped` (by `--skip`/`--fast`), `unavailable` (capability missing)
            or `failed` (it raised).
        note: why it was skipped, unavailable or failed; empty when ok.
        seconds: wall time of `run` and `analyze`.
        result: the section's record when ok.
        findings: its findings, tagged with the section in `code`.
        metrics: its headline numbers.
        section: the section object, which renders `result`.
    """

    name: str
    title: str
    status: Status
    note: str = ""
    seconds: float = 0.0
    result: Any = None
    findings: tuple[Finding, ...] = ()
    metrics: Mapping[str, Metric] = field(default_factory=dict)
    section: Section[Any] | None = field(default=None, compare=False, repr=False)
