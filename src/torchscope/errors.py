"""The exception tree. Every error torchscope raises on purpose derives from `TorchscopeError`.

Messages follow one shape: what was observed, what was expected, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "BudgetError",
    "CompileError",
    "InputSpecError",
    "ModelError",
    "SelectionError",
    "TargetError",
    "TorchscopeError",
    "VerificationError",
    "describe",
]


class TorchscopeError(Exception):
    """Base of every error torchscope raises on purpose.

    Attributes:
        fix: a one-line suggestion of what to do, or an empty string.
    """

    def __init__(self, message: str, *, fix: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def one_line(self) -> str:
        """The message and the fix on one line, as the CLI prints them."""
        text = " ".join(self.message.split())
        if self.fix:
            text = f"{text} Fix: {' '.join(self.fix.split())}"
        return text

    def __str__(self) -> str:
        return self.one_line()


def describe(exc: BaseException) -> str:
    """An exception in one line: its own `one_line()` for a `TorchscopeError`, else
    `TypeName: first line of its message` (for wrapping an error the user's code raised)."""
    if isinstance(exc, TorchscopeError):
        return exc.one_line()
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class TargetError(TorchscopeError):
    """A TARGET (built-in name, `file.py:factory`, `pkg.mod:factory`) could not be loaded."""


class InputSpecError(TorchscopeError):
    """An input SPEC such as `32x3x32x32` or `int64[0,1000):4x128` is malformed."""


class ModelError(TorchscopeError):
    """The user's model raised, or its inputs do not fit it."""


class SelectionError(TorchscopeError):
    """A module selection matched nothing."""


class BudgetError(TorchscopeError):
    """A memory budget cannot be met, or a capture went over its byte budget."""


class VerificationError(TorchscopeError):
    """Gradients or outputs differed where torchscope promised they would not."""


class CompileError(TorchscopeError):
    """torch.compile could not be measured (no C++ compiler, a crash, a timeout)."""
