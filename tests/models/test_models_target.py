"""Loading a `file.py:factory` target: what a wrong factory name is told."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchscope.errors import TorchscopeError
from torchscope.models.target import load_target


def test_a_missing_factory_lists_the_file_s_own_factories_before_its_imports(
        tmp_path: Path) -> None:
    """A transformers model file imports more classes than the hint shows: its own
    factories were left out of the list, which named only the imports."""
    path = tmp_path / "models.py"
    path.write_text(
        "from collections import Counter, OrderedDict, defaultdict, deque, namedtuple\n"
        "from torch.nn import GELU, Linear, ReLU, Sequential, SiLU, Tanh\n\n"
        "def small():\n    return Sequential(Linear(4, 4))\n\n"
        "def large():\n    return Sequential(Linear(4, 8), ReLU(), Linear(8, 4))\n")
    with pytest.raises(TorchscopeError) as info:
        load_target(f"{path}:xyz")
    fix = info.value.fix
    assert fix.startswith("callables there: small, large, ")


def test_a_model_that_raises_keeps_its_exception_as_the_cause() -> None:
    """An API caller gets a ModelError that names the module and the inputs, keeps the
    model's own exception as its cause, and whose fix is not only a command-line option."""
    from torchscope.errors import ModelError
    from torchscope.models import ModelInputs, call_model

    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    with pytest.raises(ModelError) as info:
        call_model(model, ModelInputs((torch.randn(3, 5),)))
    err = info.value
    assert isinstance(err.__cause__, RuntimeError)
    assert "0 (Linear)" in str(err) and "3x5" in str(err)
    assert err.fix is not None and "__cause__" in err.fix
