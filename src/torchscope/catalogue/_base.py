"""Shorthands for the catalogue's area modules: the severity levels an entry may carry."""

from __future__ import annotations

from torchscope.findings import Severity

INFO = frozenset({Severity.INFO})
WARNING = frozenset({Severity.WARNING})
ERROR = frozenset({Severity.ERROR})
INFO_WARNING = frozenset({Severity.INFO, Severity.WARNING})
WARNING_ERROR = frozenset({Severity.WARNING, Severity.ERROR})
ANY = frozenset(Severity)
