"""Built-in models, input SPECs and TARGET loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchscope.errors import InputSpecError
from torchscope.models import BUILTINS, ModelInputs, call_model, load_target, parse_spec


@pytest.mark.parametrize("name", list(BUILTINS))
def test_builtins_run_on_their_default_input(name: str) -> None:
    loaded = load_target(name)
    assert loaded.inputs is not None
    with torch.no_grad():
        out = call_model(loaded.model, loaded.inputs)
    assert out.shape[0] == BUILTINS[name].input_shape[0]


def test_deep_mlp_structure() -> None:
    model = load_target("deep-mlp").model
    assert len(model) == 8
    assert all(isinstance(b[0], torch.nn.Linear) and b[0].in_features == 64 for b in model)


def test_parse_spec_forms() -> None:
    s = parse_spec("32x3x32x32")
    assert s.shape == (32, 3, 32, 32) and s.dtype == torch.float32
    t = parse_spec("int64[0,1000):4x128").make()
    assert t.dtype == torch.int64 and t.shape == (4, 128)
    assert int(t.min()) >= 0 and int(t.max()) < 1000
    h = parse_spec("float16:2x3").make()
    assert h.dtype == torch.float16
    u = parse_spec("float32[-1,1):1000").make()
    assert float(u.min()) >= -1 and float(u.max()) < 1


@pytest.mark.parametrize("bad", ["", "x3", "3x", "3xx4", "int64[5,1):3", "foo:3", "0x3", "3x-2"])
def test_parse_spec_rejects(bad: str) -> None:
    with pytest.raises(InputSpecError):
        parse_spec(bad)


def test_model_inputs_of() -> None:
    x = torch.ones(2)
    assert ModelInputs.of(x).args == (x,)
    assert ModelInputs.of((x, x)).args == (x, x)
    assert dict(ModelInputs.of({"a": x}).kwargs) == {"a": x}


def test_load_target_is_reproducible_and_leaves_the_rng_alone(tmp_path: Path) -> None:
    factory = tmp_path / "factory.py"
    factory.write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(123)  # a factory that reseeds the global generator\n"
        "    return torch.nn.Linear(4, 2), torch.randn(3, 4)\n")
    torch.manual_seed(7)
    state = torch.get_rng_state()
    a = load_target("tiny-cnn")
    b = load_target("tiny-cnn")
    c = load_target(f"{factory}:build")
    assert torch.equal(torch.get_rng_state(), state)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert c.inputs is not None


def test_an_input_larger_than_the_machine_is_refused_before_allocating() -> None:
    # 4 TB of float32: Linux may grant it lazily and kill the process as it is filled, so
    # the spec is measured against the RAM first. The message gives the size asked for.
    spec = parse_spec("1000000x1000000")
    with pytest.raises(InputSpecError, match=r"input 1000000x1000000 \(float32\) needs 3.6 TiB"):
        spec.make()
    # A bool is drawn as int64: 8 bytes for each of its 1-byte elements count.
    with pytest.raises(InputSpecError, match=r"\(bool\) needs"):
        parse_spec(f"bool:{2 ** 40}").make()


def test_the_cli_says_an_input_is_too_large_in_one_line() -> None:
    from typer.testing import CliRunner

    from torchscope.cli import app

    result = CliRunner().invoke(app, ["capture", "mlp", "--input", "100000000x100000"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs 36.4 TiB" in lines[0] and "smaller" in lines[0], lines
