"""A catalogue entry as text: what `torchscope explain CODE` prints, in Markdown as
`ruff rule` prints its rules, and the one-line listing of every code."""

from __future__ import annotations

from collections.abc import Sequence

from torchscope.findings import Entry, Severity

__all__ = ["entry_markdown", "listing"]

_FRAMEWORKS = {"plain": "In a plain loop", "lightning": "With Lightning",
               "hf": "With the Hugging Face Trainer"}


def _levels(entry: Entry) -> str:
    return ", ".join(s.label for s in sorted(entry.levels, key=lambda s: -int(s)))


def entry_markdown(entry: Entry) -> str:
    """The whole entry: title, subject and severity policy, meaning, criterion, literature,
    fix (per framework where they differ), the symptoms it explains and an example."""
    parts = [f"# {entry.code}: {entry.title}", "",
             f"Subject: {entry.subject.value}. Severity: {_levels(entry)} "
             f"({entry.severity.rstrip('.')}).", "", "## What it means", "", entry.meaning, "",
             "## How torchscope decides", "", entry.criterion]
    if entry.literature:
        parts += ["", "## Literature", "", entry.literature]
    parts += ["", "## Fix", "", entry.fix or "Nothing to fix: this finding informs."]
    for key, text in entry.fixes.items():
        parts += ["", f"{_FRAMEWORKS.get(key, key)}: {text}"]
    if entry.explains:
        parts += ["", "## Explains", "",
                  "Ranks before the findings it causes: "
                  + ", ".join(f"`{c}`" for c in entry.explains) + "."]
    if entry.example:
        parts += ["", "## Example", "", f"    {entry.example}"]
    return "\n".join(parts) + "\n"


def listing(entries: Sequence[Entry]) -> list[str]:
    """One line per entry: code, subject, highest severity, title (aligned)."""
    width = max((len(e.code) for e in entries), default=0)
    return [f"{e.code:<{width}}  {e.subject.value:<11}  "
            f"{max(e.levels, default=Severity.INFO).label:<7}  {e.title}" for e in entries]
