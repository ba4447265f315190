"""The doctor's section registry. Built-in sections each live in their own module."""

from __future__ import annotations

from typing import Any

from torchscope.doctor.section import Section
from torchscope.doctor.sections import activations, compile, gradients, memory, profile

__all__ = ["get_section", "register_section", "registered_sections", "section_names"]

_REGISTRY: list[Section[Any]] = [
    activations.SECTION, gradients.SECTION, memory.SECTION, profile.SECTION, compile.SECTION,
]


def register_section(section: Section[Any], *, before: str | None = None) -> None:
    """Add a section (or replace the one with the same name, keeping its place).

    Args:
        section: the section instance.
        before: run it before the section of this name; default at the end.

    Raises:
        KeyError: `before` names no registered section.
    """
    names = section_names()
    if section.name in names:
        _REGISTRY[names.index(section.name)] = section
    elif before is None:
        _REGISTRY.append(section)
    else:
        _REGISTRY.insert(_REGISTRY.index(get_section(before)), section)


def registered_sections() -> list[Section[Any]]:
    """The registered sections in run order (a copy)."""
    return list(_REGISTRY)


def section_names() -> list[str]:
    """Names of the registered sections in run order."""
    return [s.name for s in _REGISTRY]


def get_section(name: str) -> Section[Any]:
    """The registered section called `name`.

    Raises:
        KeyError: no such section.
    """
    for s in _REGISTRY:
        if s.name == name:
            return s
    raise KeyError(f"no section named {name!r}; registered: {', '.join(section_names())}")
