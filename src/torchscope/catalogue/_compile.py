"""The catalogue's `compile.*` entries."""

from __future__ import annotations

from torchscope.findings import Entry

ENTRIES: tuple[Entry, ...] = ()
