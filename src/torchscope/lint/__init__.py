"""torchscope.lint: find the lesson's traps in PyTorch source code, before it runs.

Static analysis with `ast` (nothing is imported or executed):

- TS001 hook-registered-in-loop: `register_*hook` in a loop body whose handle is neither
  removed in that body nor used as a context manager.
- TS002 discarded-hook-handle: the handle of `register_*hook` is thrown away.
- TS003 deprecated-backward-hook: `register_backward_hook` (use
  `register_full_backward_hook`).
- TS004 compile-in-loop: `torch.compile` / `model.compile()` on every iteration, directly or
  in a function this file calls from a loop.
- TS005 empty-cache-as-fix: `torch.cuda.empty_cache()` with nothing released before it, or
  inside an out-of-memory `except` handler.
- TS006 host-sync-in-hook: `.item()`, `.cpu()`, `.tolist()`, `print(tensor)` in a hook.
- TS007 checkpoint-without-use-reentrant: `checkpoint` / `checkpoint_sequential` without
  `use_reentrant=`.

A loop only counts when it re-registers on the *same* object: `for m in model.modules():
m.register_forward_hook(fn)` hooks each module once and is not flagged.

`# noqa: TS001` (or a bare `# noqa`) silences a line. `[tool.torchscope.lint]` in
pyproject.toml takes `select`, `ignore` and `exclude` (gitignore syntax); `.gitignore` files
are honoured when walking folders.

Example:
    >>> from torchscope.lint import lint_source
    >>> [v.code for v in lint_source("for x in data:\\n    m.compile()\\n")]
    ['TS004']
"""

from torchscope.lint import analyze as _analyze  # registers LintResult's analyzer
from torchscope.lint.config import LintConfig, find_config, load_config
from torchscope.lint.engine import lint_file, lint_paths, lint_source
from torchscope.lint.files import IgnoreRules, discover
from torchscope.lint.records import LintError, LintResult, LintViolation
from torchscope.lint.rules import RULES, LintUsageError, Rule, resolve_codes

del _analyze

__all__ = [
    "RULES",
    "IgnoreRules",
    "LintConfig",
    "LintError",
    "LintResult",
    "LintUsageError",
    "LintViolation",
    "Rule",
    "discover",
    "find_config",
    "lint_file",
    "lint_paths",
    "lint_source",
    "load_config",
    "resolve_codes",
]
