"""The catalogue of findings: every finding code declared once, with what it means.

Each entry gives the code and a title, its subject (`model`, `loop`, `data`, `environment`,
`measurement`), the severities it may carry and the policy that picks one, what it means and
why it matters, the criterion (with its literature), and the fix, per framework where they
differ. Analyzers make findings only from entries:

    _EXPLODING = entry("grads.exploding")
    ...
    out.append(_EXPLODING.finding(Severity.WARNING, summary, evidence, module=name))

`torchscope explain CODE` prints an entry; the docs' page of findings is generated from the
same entries. The static linter's rules (`torchscope.lint.RULES`) are declared here too when
`torchscope.lint` is imported, as `lint.TS001` and so on.

Entries live in one module per area (`_activations`, `_grads`, ...), so that each reads as
one table.
"""

from __future__ import annotations

from torchscope.catalogue import (
    _activations,
    _compile,
    _distributed,
    _grads,
    _lab,
    _memory,
    _profiling,
    _run,
)
from torchscope.findings import _DECLARED, Entry, declare, declared

__all__ = ["Entry", "entries", "entry"]

declare(*_activations.ENTRIES, *_grads.ENTRIES, *_memory.ENTRIES, *_profiling.ENTRIES,
        *_compile.ENTRIES, *_run.ENTRIES, *_distributed.ENTRIES, *_lab.ENTRIES)


def entry(code: str) -> Entry:
    """The entry of `code`.

    Raises:
        TorchscopeError: `code` is not declared.
    """
    return declared(code)


def entries() -> list[Entry]:
    """Every declared entry, by code (the lint rules too once `torchscope.lint` is imported)."""
    return [_DECLARED[c] for c in sorted(_DECLARED)]
