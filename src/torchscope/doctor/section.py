"""The `Section` contract: one part of the doctor report, from measurement to HTML.

A section runs one capability's public function on the doctor's shared `Step` and returns
that capability's own record (`run`); the record's findings are its capability's analyzer's
(`record.findings()`). The section picks the headline numbers `torchscope diff` compares
(`metrics`), writes the record's report.json `data` (`to_json`) and draws it (`plots`,
`html`, through the renderers of `torchscope.report`). The runner calls these in that order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from torchscope.report.document import Metric
from torchscope.step import LossName

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from torchscope.step import Step

__all__ = ["DoctorOptions", "Section"]

R = TypeVar("R")


@dataclass(frozen=True)
class DoctorOptions:
    """What the user asked the doctor for.

    Attributes:
        fast: trade depth for time: compile is skipped, profiling runs fewer steps (3, and
            3 plain ones for the step time), and memory plans no checkpointing.
        skip: section names not to run.
        loss_fn: the loss of the doctor's training step (`auto`, `cross_entropy`, `mse` or
            `sum`, as `torchscope.step` defines them); leave it `auto` when giving a `Step`.
        steps: profiled training steps (`fast` lowers it to 3).
        compile_modes: the torch.compile modes to measure.
        compile_iters: timed calls per compile mode.
        device: the device the model and inputs were moved to.
        seed: every section runs with torch's generators seeded with it, and the step's
            synthesized targets are drawn from it.
        autocast: run the step's forward and loss under `torch.autocast` in `bf16` or
            `fp16` (with a GradScaler; see `Step.with_autocast`); None runs the model's own
            precision. Leave it None when giving a `Step`.
        sources: Python files to lint for the classic training traps (`torchscope lint`'s
            rules): the CLI gives the file the model and its inputs come from.
    """

    fast: bool = False
    skip: frozenset[str] = frozenset()
    loss_fn: LossName = "auto"
    steps: int = 5
    compile_modes: tuple[str, ...] = ("default",)
    compile_iters: int = 20
    device: str = "cpu"
    seed: int = 0
    autocast: str | None = None
    sources: tuple[str, ...] = ()

    @property
    def profile_steps(self) -> int:
        """Profiled steps after `fast` is applied."""
        return min(self.steps, 3) if self.fast else self.steps

    def to_json(self) -> dict[str, Any]:
        """The `options` object of report.json."""
        return {"fast": self.fast, "skip": sorted(self.skip), "loss": self.loss_fn,
                "steps": self.steps, "compile_modes": list(self.compile_modes),
                "compile_iters": self.compile_iters, "device": self.device, "seed": self.seed,
                "sources": list(self.sources)}


class Section(ABC, Generic[R]):
    """One part of the doctor: subclasses set `name`, `title` and `capability`.

    Attributes:
        name: stable identifier, used by `--skip` and as the key in report.json.
        title: heading in the HTML report and the terminal.
        capability: the dotted name of the public function the section calls, for readers.
        slow: whether `--fast` skips it.
    """

    name: str = ""
    title: str = ""
    capability: str = ""
    slow: bool = False

    @abstractmethod
    def run(self, step: Step, options: DoctorOptions) -> R:
        """Measure with the capability's public function on `step`; return its record.

        The runner gives the model back exactly as it was afterwards and seeds torch's
        generators before, so every section's first step is the same computation. Never
        catch an error to run the model again with other settings: a capability says in
        its record what it could not do (the memory analysis, a checkpoint plan that
        failed).
        """

    def skip_reason(self, options: DoctorOptions) -> str | None:
        """Why the section has nothing to do with these options (its report says so); None
        to run it."""
        return None

    @abstractmethod
    def to_json(self, record: R) -> dict[str, Any]:
        """JSON-ready `data` object for report.json (see report.schema.json)."""

    def metrics(self, record: R) -> dict[str, Metric]:
        """Headline numbers for `torchscope diff`, keyed `"<section>.<what>"`."""
        return {}

    def plots(self, record: R) -> Mapping[str, Figure]:
        """Figures to embed in the HTML report, by plot id."""
        return {}

    def html(self, record: R, plots: Mapping[str, str]) -> str:
        """An HTML fragment (tables) for this section; `plots` maps plot id to inline SVG."""
        return ""
