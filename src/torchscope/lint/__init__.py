"""torchscope.lint: find the lesson's traps in source code before it runs.

Static analysis with `ast`: hooks registered in loops or discarded (TS001, TS002), the
deprecated `register_backward_hook` (TS003), `torch.compile` per iteration (TS004),
`empty_cache()` as an out-of-memory fix (TS005), host syncs inside hooks (TS006) and
`checkpoint` without `use_reentrant=` (TS007).
"""

from torchscope.lint.config import LintConfig, find_config, load_config
from torchscope.lint.engine import lint_file, lint_paths, lint_source
from torchscope.lint.files import IgnoreRules, discover
from torchscope.lint.records import LintError, LintResult, LintViolation
from torchscope.lint.rules import RULES, LintUsageError, Rule, resolve_codes

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
