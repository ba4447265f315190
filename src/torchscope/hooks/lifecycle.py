"""The open/close contract every hook-owning collector shares, as a context manager."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeVar

__all__ = ["HookedContext"]

_C = TypeVar("_C", bound="HookedContext")  # typing.Self needs Python 3.11


class HookedContext(ABC):
    """A collector that registers hooks in `open()` and removes them in `close()`.

    As a context manager: an `open()` that fails halfway still removes the hooks it had
    added, and `close()` learns whether the block is unwinding an exception, so it never
    replaces that exception with one of its own.
    """

    @abstractmethod
    def open(self) -> None:
        """Register the hooks."""

    @abstractmethod
    def close(self, *, failed: bool = False) -> None:
        """Remove the hooks; `failed` says an exception is unwinding."""

    def __enter__(self: _C) -> _C:
        try:
            self.open()
        except BaseException:
            self.close(failed=True)  # hooks registered before the failure come off too
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(failed=exc[0] is not None)
