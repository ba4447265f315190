"""mkdocs hooks (mkdocs.yml `hooks:`): the pages generated at build time.

- `findings.md`: one entry per code of the catalogue of findings (`torchscope.catalogue`,
  the lint rules included), each under the HTML anchor of its code, dots kept:
  `findings.html#grads.exploding`. The report links a code to that anchor.
- `api.md`: the API reference of every public name in `torchscope.__all__`, rendered by
  mkdocstrings from the docstrings where the name is defined.

Each page holds a marker line that the hook replaces; the rest of the page is written by hand.
`findings_markdown()` and `api_markdown()` are plain functions, so tests can call them.
"""

from __future__ import annotations

from typing import Any

FINDINGS_MARK = "<!-- findings: generated from the catalogue -->"
API_MARK = "<!-- api: generated from torchscope.__all__ -->"

# The areas in the order a reader meets them; codes of an unlisted area come last.
_AREAS = {
    "activations": "Activations",
    "grads": "Gradients",
    "memory": "Memory",
    "profiling": "Time",
    "compile": "torch.compile",
    "run": "Training runs",
    "distributed": "Distributed",
    "ranks": "Ranks",
    "lab": "Lab",
    "lint": "Lint rules",
}


_FRAMEWORKS = {"plain": "A plain loop", "lightning": "PyTorch Lightning",
               "hf": "Hugging Face Trainer"}


def _entries() -> list[Any]:
    import torchscope.lint  # noqa: F401  (declares the lint rules as lint.TS0xx entries)
    from torchscope import catalogue

    return list(catalogue.entries())


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _entry_markdown(entry: Any, known: set[str]) -> list[str]:
    levels = ", ".join(s.label for s in sorted(entry.levels))
    lines = [
        f"### {entry.code} {{#{entry.code}}}",
        "",
        f"**{_one_line(entry.title)}** · subject: `{entry.subject.value}` · "
        f"severity: {levels}",
        "",
        _one_line(entry.meaning),
        "",
        f"**When:** {_one_line(entry.criterion)}",
        "",
    ]
    if entry.severity:
        lines += [f"**Severity:** {_one_line(entry.severity)}", ""]
    if entry.literature:
        lines += [f"**Literature:** {_one_line(entry.literature)}", ""]
    lines += [f"**Fix:** {_one_line(entry.fix) if entry.fix else 'nothing to fix.'}", ""]
    for framework, fix in sorted(entry.fixes.items()):
        lines += [f"- *{_FRAMEWORKS.get(framework, framework)}:* {_one_line(fix)}"]
    if entry.fixes:
        lines.append("")
    if entry.example:
        lines += ["**Example:**", "", "```text", _one_line(entry.example), "```", ""]
    if entry.explains:
        links = ", ".join(f"[`{c}`](#{c})" if c in known else f"`{c}`"
                          for c in entry.explains)
        lines += [f"**Explains:** {links} (this cause is ranked before them).", ""]
    return lines


def findings_markdown() -> str:
    """Every declared code, grouped by area, each with its meaning, criterion, literature,
    fix and example, under the anchor `#<code>`."""
    entries = _entries()
    known = {e.code for e in entries}
    areas: dict[str, list[Any]] = {}
    for e in entries:
        areas.setdefault(e.code.split(".", 1)[0], []).append(e)
    order = [a for a in _AREAS if a in areas] + sorted(a for a in areas if a not in _AREAS)
    out = [f"{len(entries)} codes in {len(order)} areas: "
           + ", ".join(f"[{_AREAS.get(a, a)}](#area-{a})" for a in order) + ".", ""]
    for area in order:
        out += [f"## {_AREAS.get(area, area)} {{#area-{area}}}", ""]
        out += ["| code | title | subject | severity |", "| --- | --- | --- | --- |"]
        for e in areas[area]:
            levels = ", ".join(s.label for s in sorted(e.levels))
            out.append(f"| [`{e.code}`](#{e.code}) | {_one_line(e.title)} | "
                       f"{e.subject.value} | {levels} |")
        out.append("")
        for e in areas[area]:
            out += _entry_markdown(e, known)
    return "\n".join(out)


def api_markdown() -> str:
    """A mkdocstrings block per public name, at the module that defines it."""
    import torchscope

    return "\n\n".join(f"::: {torchscope._API[name]}.{name}" for name in torchscope.__all__)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the generated parts of the Findings page and the API reference."""
    if FINDINGS_MARK in markdown:
        markdown = markdown.replace(FINDINGS_MARK, findings_markdown())
    if API_MARK in markdown:
        markdown = markdown.replace(API_MARK, api_markdown())
    return markdown
