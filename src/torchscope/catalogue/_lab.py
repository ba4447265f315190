"""The catalogue's `lab.*` entries."""

from __future__ import annotations

from torchscope.findings import Entry

ENTRIES: tuple[Entry, ...] = ()
