"""`import torchscope` (and the monitor, and the integrations package) never imports
pytorch-lightning or transformers, and the watches for a training loop import no renderer
and no compiler: checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FRAMEWORKS = ("pytorch_lightning", "lightning", "transformers", "accelerate")
# What only reports, the doctor and torch.compile need: seconds to import (matplotlib and
# torch._dynamo took 8 s between them on the 2-core test machine, more than torch).
HEAVY = ("matplotlib", "rich", "typer", "torch._dynamo", "torchscope.doctor",
         "torchscope.report", "torchscope.compile")


def _loaded(code: str, modules: tuple[str, ...] = FRAMEWORKS) -> list[str]:
    probe = code + (f"\nimport json, sys\nprint(json.dumps([m for m in {modules!r} "
                    "if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120)
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_torchscope_and_the_monitor_import_no_framework() -> None:
    assert _loaded("import torchscope\ntorchscope.monitor\nimport torchscope.monitoring\n"
                   "import torchscope.integrations\nimport torchscope.examples") == []


def test_the_watches_and_the_monitor_import_no_renderer_and_no_compiler() -> None:
    """A training script that opens a monitor or a watch imports none of them until it
    writes a report; writing one does."""
    watches = ("import torch\nimport torchscope\nimport torchscope.integrations\n"
               "for name in ('monitor', 'watch_gradients', 'watch_activations', "
               "'watch_memory', 'watch_time', 'Step', 'HookSession'):\n"
               "    getattr(torchscope, name)\n"
               "import torchscope.monitoring\n")
    assert _loaded(watches, HEAVY) == []
    loaded = _loaded(watches + "from torchscope.monitoring import write_run_report\n", HEAVY)
    assert {"matplotlib", "torchscope.doctor", "torchscope.report"} <= set(loaded)


@pytest.mark.parametrize(("module", "framework"), [
    ("torchscope.integrations.lightning", "pytorch_lightning"),
    ("torchscope.integrations.hf", "transformers")])
def test_each_integration_imports_its_framework(module: str, framework: str) -> None:
    pytest.importorskip(framework)
    assert framework in _loaded(f"import {module}")
