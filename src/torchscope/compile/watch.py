"""Watch Dynamo compile: every frame compile, every recompile and the guard that failed.

Uses torch's compile callbacks (`torch._dynamo.callback_handler`), the per-code
guard-failure texts Dynamo keeps (`torch._dynamo.guards.guard_failures`, filled before a
recompile starts) and the warning torch logs when a frame hits the recompile limit.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch
import torch._dynamo.guards
from torch import nn

from torchscope.compile._isolate import private_origin
from torchscope.compile.records import Recompile
from torchscope.errors import CompileError
from torchscope.hooks.compiled import CompileCounter

__all__ = ["RecompileWatcher", "recompile_limit", "watch_recompiles"]

_COMPILE_ID = re.compile(r"(\d+)/(\d+)")
_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ')
_LIMIT_LOGGER = "torch._dynamo.convert_frame"


def recompile_limit() -> int:
    """torch's per-frame recompile limit: `config.recompile_limit`, or the older
    `config.cache_size_limit`, whichever this torch has."""
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


def _guard_failures() -> dict[CodeType, list[str]]:
    """Dynamo's `{code: [guard failure text, ...]}`; empty when this torch has none."""
    failures = getattr(torch._dynamo.guards, "guard_failures", None)
    return failures if isinstance(failures, dict) else {}


def parse_guard(text: str) -> tuple[str, str | None]:
    """The failing guard of one failure text, and the user `file:line` it came from.

    A text reads `0/1: len(G['lst']) == 1  # <source>  # f.py:17 in <lambda>` followed by a
    `User stack trace:`; size guards read `0/0: tensor 'x' size mismatch at index 0. ...`.
    """
    first = re.sub(r"^\s*\d+/\d+:\s*", "", text.split("\n", 1)[0])
    guard = first.split("  #", 1)[0].split(" # ", 1)[0].strip()
    frames = _USER_FRAME.findall(text)
    source = f"{frames[-1][0]}:{frames[-1][1]}" if frames else None
    return guard or first.strip(), source


class _LimitHandler(logging.Handler):
    """Notes torch's `torch._dynamo hit config.recompile_limit` warnings in `hits`, as
    `"function (file:line): last reason"`."""

    def __init__(self, hits: list[str]) -> None:
        super().__init__(level=logging.WARNING)
        self._hits = hits

    def emit(self, record: logging.LogRecord) -> None:
        if not (isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config.")):
            return
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 4:
            self._hits.append(f"{args[2]}: {parse_guard(str(args[3]))[0]}")
        else:
            self._hits.append(record.getMessage().split("\n", 1)[0])


class RecompileWatcher(CompileCounter):
    """Record every Dynamo frame compile while open; recompiles carry their failing guard.

    Use it as a context manager around compiled calls. `torch._dynamo.reset()` clears
    torch's callbacks: call `reinstall()` after a reset inside the block.

    Attributes:
        compiles: frame compiles seen (first compiles and recompiles).
        recompiles: every recompile, in order.
        limit_hits: `"function (file:line): last reason"` per frame that hit the limit.
    """

    def __init__(self, on_recompile: Callable[[Recompile], None] | None = None) -> None:
        if isinstance(on_recompile, nn.Module):
            # A model is callable too: called from inside Dynamo's compile callback, a
            # compiled one re-enters the compiler and the process hangs.
            raise CompileError(
                f"watch_recompiles() got the model {type(on_recompile).__name__} as "
                "on_recompile: it watches every compiled frame in the process and takes no "
                "model.",
                fix="use `with torchscope.watch_recompiles() as w:` around the calls, or pass "
                "on_recompile=a function of one Recompile (that runs no compiled code).")
        super().__init__()
        self.recompiles: list[Recompile] = []
        self.limit_hits: list[str] = []
        self._on_recompile = on_recompile
        self._seen: dict[CodeType, int] = {}
        self._handler = _LimitHandler(self.limit_hits)
        self._pending: list[Recompile] = []

    def __enter__(self) -> RecompileWatcher:
        self.install()
        return self

    def install(self) -> None:
        """Start watching (idempotent)."""
        if self._installed:
            return
        self._seen = {code: len(texts) for code, texts in list(_guard_failures().items())}
        super().install()
        logging.getLogger(_LIMIT_LOGGER).addHandler(self._handler)

    def uninstall(self) -> None:
        """Stop watching; records stay readable."""
        if not self._installed:
            return
        super().uninstall()
        logging.getLogger(_LIMIT_LOGGER).removeHandler(self._handler)

    @property
    def limit_hit(self) -> bool:
        """Whether any frame hit the recompile limit while watched."""
        return bool(self.limit_hits)

    def _new_failures(self) -> tuple[CodeType | None, list[str]]:
        """Guard failures added since the last look, and their code object."""
        found: CodeType | None = None
        new: list[str] = []
        for code, texts in list(_guard_failures().items()):
            before = self._seen.get(code, 0)
            if before > len(texts):  # torch._dynamo.reset() cleared it
                before = 0
            if len(texts) > before:
                found = code
                new = list(texts[before:])
            self._seen[code] = len(texts)
        return found, new

    def _on_start(self, args: Any) -> None:
        super()._on_start(args)
        # The user's callback runs outside the lock: it may warn, log or raise.
        while self._pending:
            rec = self._pending.pop(0)
            if self._on_recompile is not None:
                self._on_recompile(rec)

    def _on_compile(self, args: Any) -> None:
        compile_id = str(getattr(args, "compile_id", ""))
        code, texts = self._new_failures()
        m = _COMPILE_ID.search(compile_id)
        if m is None or int(m.group(2)) == 0:
            return
        guard, source = parse_guard(texts[0]) if texts else ("unknown guard failure", None)
        function, file, line = ("?", "?", 0) if code is None else private_origin(code) or (
            code.co_name, code.co_filename, code.co_firstlineno)
        rec = Recompile(f"{m.group(1)}/{m.group(2)}", function, file, line, guard,
                        tuple(texts), source)
        self.recompiles.append(rec)
        self._pending.append(rec)


def watch_recompiles(
    on_recompile: Callable[[Recompile], None] | None = None,
) -> RecompileWatcher:
    """A `RecompileWatcher` to use as a context manager.

    It watches every compiled frame in the process (Dynamo's compile callbacks), so it
    takes no model.

    Args:
        on_recompile: called with each `Recompile` as Dynamo starts its next compile. It
            runs inside Dynamo's callback: it must not run compiled code (that would
            re-enter the compiler and hang).

    Raises:
        CompileError: `on_recompile` is a model (an `nn.Module`).

    Examples:
        >>> with torchscope.compile.watch_recompiles() as w:
        ...     for bs in (32, 16, 8):
        ...         compiled(torch.randn(bs, 3, 32, 32))
        >>> [r.guard for r in w.recompiles]
        ["tensor 'x' size mismatch at index 0. expected 32, actual 16", ...]
    """
    return RecompileWatcher(on_recompile)
