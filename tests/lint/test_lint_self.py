"""torchscope's own source tree lints clean."""

from __future__ import annotations

from pathlib import Path

import torchscope
from torchscope.lint import lint_paths


def test_own_source_tree_is_clean() -> None:
    src = Path(torchscope.__file__).parent
    result = lint_paths([src], config=False)
    assert result.files >= 40
    assert not result.errors
    assert not result.violations, "\n".join(
        f"{v.path}:{v.line}:{v.col}: {v.code} {v.message}" for v in result.violations)
