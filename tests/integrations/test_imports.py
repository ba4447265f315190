"""`import torchscope` (and the monitor, and the integrations package) never imports
pytorch-lightning or transformers: checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FRAMEWORKS = ("pytorch_lightning", "lightning", "transformers", "accelerate")


def _loaded(code: str) -> list[str]:
    probe = code + (f"\nimport json, sys\nprint(json.dumps([m for m in {FRAMEWORKS!r} "
                    "if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120)
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_torchscope_and_the_monitor_import_no_framework() -> None:
    assert _loaded("import torchscope\ntorchscope.monitor\nimport torchscope.monitoring\n"
                   "import torchscope.integrations\nimport torchscope.examples") == []


@pytest.mark.parametrize(("module", "framework"), [
    ("torchscope.integrations.lightning", "pytorch_lightning"),
    ("torchscope.integrations.hf", "transformers")])
def test_each_integration_imports_its_framework(module: str, framework: str) -> None:
    pytest.importorskip(framework)
    assert framework in _loaded(f"import {module}")
