"""`Finding`: what every analyzer returns, and what every renderer ranks and prints.

A finding is made only from its code's `Entry` in the catalogue of findings
(`torchscope.catalogue`): `entry("grads.exploding").finding(severity, summary, evidence)`.
The entry declares the code once, with its subject, the severities it may carry, what it
means and how to fix it; the finding adds what was seen this time.

Every result type of every capability derives from `Analyzed`, so findings are read the same
way everywhere: `result.findings()` (or `result.findings(thresholds)`). The analysis itself
stays a pure function in its capability's `analyze` module, registered for its record type
with `@analyzer(RecordType)`; the record never imports its analyzer, so records stay below
analysis in the import graph.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torchscope.errors import TorchscopeError

__all__ = ["Analyzed", "Entry", "Finding", "Severity", "Subject", "analyzer", "declared",
           "rank",
           "ranked"]


class Severity(enum.IntEnum):
    """How much a finding matters; higher sorts first."""

    INFO = 0
    WARNING = 1
    ERROR = 2

    @property
    def label(self) -> str:
        """Lower-case name: `info`, `warning`, `error`."""
        return self.name.lower()


class Subject(str, enum.Enum):
    """What a finding is about: the user's model, loop or data, or a caveat of its own.

    The first three are about the user's work and rank first; `environment` (this machine,
    compiler or device) and `measurement` (torchscope's own measurement: profiler overhead,
    noise, a sample too small) follow. A measurement caveat is never more than info.
    """

    MODEL = "model"
    LOOP = "loop"
    DATA = "data"
    ENVIRONMENT = "environment"
    MEASUREMENT = "measurement"


# Report order of the subjects: the user's model, loop and data first, caveats last.
_SUBJECT_ORDER = {Subject.MODEL: 0, Subject.LOOP: 0, Subject.DATA: 0,
                  Subject.ENVIRONMENT: 1, Subject.MEASUREMENT: 2}


@dataclass(frozen=True)
class Finding:
    """One conclusion of an analyzer, with its evidence and a suggested fix.

    Made by `Entry.finding`, never directly: the code must be declared in the catalogue.

    Attributes:
        code: stable identifier, `area.what` (e.g. `grads.vanishing`, `memory.checkpoint_plan`).
        severity: how much it matters.
        summary: one plain sentence, e.g. "conv1 (ReLU): 7 of 8 channels (88%) are zero for every
            sample and position".
        evidence: the numbers behind it, by name (unformatted).
        fix: what to do about it; empty when nothing needs doing.
        module: the module it concerns, when there is one.
        subject: what it is about (from its catalogue entry).
    """

    code: str
    severity: Severity
    summary: str
    evidence: Mapping[str, float | int | str | bool | None] = field(default_factory=dict)
    fix: str = ""
    module: str | None = None
    subject: Subject = Subject.MODEL

    @property
    def entry(self) -> Entry:
        """The catalogue entry that declares this finding's code."""
        return declared(self.code)


@dataclass(frozen=True)
class Entry:
    """One code of the catalogue of findings: declared once, read everywhere.

    Attributes:
        code: stable identifier, `area.what`.
        title: a few words, e.g. "Exploding gradients".
        subject: what it is about.
        levels: the severities a finding of this code may carry.
        severity: the severity policy in words: when it is an error, a warning or info.
        meaning: what it means and why it matters.
        criterion: how torchscope decides, with its thresholds and, where there is one, the
            literature behind it.
        fix: the default fix; a finding may carry a more specific one. Empty where there is
            nothing to fix.
        fixes: the fix per framework where it differs (`"lightning"`, `"hf"`, `"plain"`).
        literature: references, where the criterion has them.
        example: a summary as a report prints it.
        explains: codes of the symptoms this finding is a cause of; the cause ranks first.
    """

    code: str
    title: str
    subject: Subject
    levels: frozenset[Severity]
    severity: str
    meaning: str
    criterion: str
    fix: str = ""
    fixes: Mapping[str, str] = field(default_factory=dict)
    literature: str = ""
    example: str = ""
    explains: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.levels:
            raise TorchscopeError(f"catalogue entry {self.code!r} allows no severity.",
                                  fix="give it at least one of Severity's levels.")
        if self.subject is Subject.MEASUREMENT and self.levels != {Severity.INFO}:
            raise TorchscopeError(
                f"catalogue entry {self.code!r} is a measurement caveat at "
                f"{sorted(s.label for s in self.levels)}; a caveat about torchscope's own "
                "measurement is never a warning about the user's model.",
                fix="declare it with levels={Severity.INFO}, or give it another subject.")

    def fix_for(self, framework: str | None = None) -> str:
        """The fix for `framework` (`"lightning"`, `"hf"`, `"plain"`), else the default."""
        if framework is not None and framework in self.fixes:
            return self.fixes[framework]
        return self.fix

    def finding(self, severity: Severity, summary: str,
                evidence: Mapping[str, float | int | str | bool | None] | None = None, *,
                fix: str | None = None, module: str | None = None,
                framework: str | None = None) -> Finding:
        """A finding of this code.

        Args:
            severity: one of the entry's `levels`.
            summary: what was seen, in one sentence.
            evidence: the numbers behind it, by name.
            fix: a fix specific to what was seen; None takes the entry's
                (`fix_for(framework)`).
            module: the module it concerns.
            framework: the framework the run uses, for the entry's default fix.
        """
        if severity not in self.levels:
            raise TorchscopeError(
                f"{self.code} was emitted as {severity.label}; its catalogue entry allows "
                f"{', '.join(s.label for s in sorted(self.levels))}.",
                fix="emit one of the declared levels, or change the entry's policy.")
        _emitted(self.code)
        return Finding(self.code, severity, summary, dict(evidence or {}),
                       self.fix_for(framework) if fix is None else fix, module, self.subject)


_DECLARED: dict[str, Entry] = {}
# Codes made into findings in this process. The test suite checks that every declared code
# is emitted by some test (tests/conftest.py); tests that run torchscope in child processes
# (the CLI, torchrun's ranks) report theirs through files in $TORCHSCOPE_CODES_DIR, which
# only the suite sets.
_EMITTED: set[str] = set()


def _emitted(code: str) -> None:
    if code in _EMITTED:
        return
    _EMITTED.add(code)
    folder = os.environ.get("TORCHSCOPE_CODES_DIR")
    if folder:
        with open(os.path.join(folder, f"codes-{os.getpid()}.log"), "a",
                  encoding="utf-8") as fh:
            fh.write(code + "\n")


def declare(*entries: Entry) -> None:
    """Add entries to the catalogue (`torchscope.catalogue` and `torchscope.lint` call this).

    Raises:
        TorchscopeError: a code declared twice with different content.
    """
    for e in entries:
        known = _DECLARED.get(e.code)
        if known is not None and known != e:
            raise TorchscopeError(f"finding code {e.code!r} is declared twice.",
                                  fix="declare each code once, in torchscope.catalogue.")
        _DECLARED[e.code] = e


def declared(code: str) -> Entry:
    """The catalogue entry of `code`.

    Raises:
        TorchscopeError: the code is not declared.
    """
    try:
        return _DECLARED[code]
    except KeyError:
        raise TorchscopeError(
            f"finding code {code!r} is not in the catalogue of findings.",
            fix="run `torchscope explain` for the codes; declare a new one in "
                "torchscope.catalogue.") from None


def rank(findings: Iterable[Finding]) -> list[Finding]:
    """Report order: the user's model, loop and data before caveats (environment, then
    measurement); within them, the most severe first, and a cause before its symptoms.

    A cause (an entry that `explains` a present code) ranks at the severity of the worst
    symptom it explains, and ahead of them; otherwise the order is stable.
    """
    return ranked(findings, lambda f: f)


_T = TypeVar("_T")


def ranked(items: Iterable[_T], finding: Callable[[_T], Finding]) -> list[_T]:
    """`items` in `rank`'s order of their findings (e.g. `(section, finding)` pairs)."""
    items = list(items)
    present: dict[str, Severity] = {}
    for item in items:
        f = finding(item)
        present[f.code] = max(present.get(f.code, Severity.INFO), f.severity)
    explained: set[str] = set()
    effective: dict[str, Severity] = {}
    for code, level in present.items():
        e = _DECLARED.get(code)
        symptoms = [c for c in (e.explains if e else ()) if c in present and c != code]
        explained.update(symptoms)
        effective[code] = max([level, *(present[c] for c in symptoms)])

    def key(item: _T) -> tuple[int, int, int]:
        f = finding(item)
        sev = max(f.severity, effective.get(f.code, f.severity))
        return (_SUBJECT_ORDER[f.subject], -int(sev), int(f.code in explained))

    return sorted(items, key=key)


Analyzer = Callable[..., list[Finding]]
_A = TypeVar("_A", bound=Analyzer)
_ANALYZERS: dict[type, Analyzer] = {}


def analyzer(record_type: type) -> Callable[[_A], _A]:
    """Register `fn(record, thresholds=None) -> list[Finding]` as the analyzer of a type.

    Subclasses of `record_type` use it too, unless they register their own.
    """

    def register(fn: _A) -> _A:
        _ANALYZERS[record_type] = fn
        return fn

    return register


class Analyzed:
    """Base of every result type: `findings()` runs the capability's registered analyzer."""

    __slots__ = ()

    def findings(self, thresholds: Any = None) -> list[Finding]:
        """What the capability's analyzer concludes from this result (pure, repeatable).

        Args:
            thresholds: the capability's thresholds object (e.g. `GradThresholds`); None
                uses its defaults.
        """
        for cls in type(self).__mro__:
            fn = _ANALYZERS.get(cls)
            if fn is not None:
                return fn(self, thresholds)
        raise TorchscopeError(
            f"no analyzer is registered for {type(self).__name__}.",
            fix="import the capability's package (e.g. torchscope.grads) before asking for "
            "findings.")
