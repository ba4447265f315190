"""The catalogue's entries of the rank-aware codes: those that distributed/, doctor/ranks.py
and grads/ranks.py emit."""

from __future__ import annotations

from torchscope.findings import Entry

ENTRIES: tuple[Entry, ...] = ()
