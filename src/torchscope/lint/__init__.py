"""torchscope.lint: find the lesson's traps in PyTorch source code, before it runs.

Static analysis with `ast` (nothing is imported or executed). Each rule (TS001 hook
registered in a loop, TS002 discarded hook handle, ... TS007 checkpoint without
`use_reentrant=`; TS008 and TS009, the distributed ones, live in `fsdp_hooks` and
`rank_norms`; TS010, a model called after `eval()` with gradients on, in `eval_grad`;
TS011, a loss accumulated across a loop with its autograd history, in `loss_history`;
TS012, a training loop that never zeroes its gradients, TS016, gradients zeroed between
`backward()` and `step()`, and TS017, gradients clipped after `step()`, in `zero_grad`;
TS013, a training loop that leaves its model in eval mode, in `eval_mode`; TS014 and TS015, softmax
probabilities given to a loss and gradients clipped before unscaling, in `loss_inputs`) is
described, with why it is a trap and the fix, in `torchscope.lint.RULES`.

A loop only counts when it re-registers or recompiles the *same* object: `for m in
model.modules(): m.register_forward_hook(fn)` hooks each module once and is not flagged, and
neither is regional compilation (`for block in model.children(): block.compile()`). Calls
are followed through the file's own functions: a function that hooks or compiles its
argument, called from a training loop with the same model every step, is flagged there.

Each finding carries a severity: a warning or an error where the code falls into the trap,
an info note where the pattern is only worth knowing (a hook handle discarded once at
setup); info notes do not fail the run.

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
