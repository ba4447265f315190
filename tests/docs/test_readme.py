"""The README's Python example runs as written and prints what its comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
@pytest.mark.xdist_group("compile")
def test_readme_python_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    out = io.StringIO()
    namespace: dict[str, object] = {"__name__": "readme"}
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], str(README), "exec"), namespace)
    printed = out.getvalue().splitlines()
    assert printed[0] == "(32, 8, 30, 30)"
    assert printed[1] == "['fc', 'conv2', 'conv1']"
    assert printed[2] == "input does not require grad"
    assert printed[3].startswith("loss: cross-entropy vs given targets = ")
    assert printed[3].endswith(" · optimizer: SGD")
    assert "True" in printed
    assert "[]" in printed
    assert "10" in printed
    assert "73728" in printed
