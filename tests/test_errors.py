"""The error tree and how an exception is named in one line."""

from __future__ import annotations

from torchscope.errors import ModelError, TorchscopeError, describe


def test_describe_names_the_type_and_the_first_line() -> None:
    assert describe(ValueError("bad shape\nmore detail")) == "ValueError: bad shape"
    assert describe(RuntimeError()) == "RuntimeError"
    err = ModelError("the model raised.", fix="pass inputs that fit.")
    assert describe(err) == err.one_line() == "the model raised. Fix: pass inputs that fit."
    assert isinstance(err, TorchscopeError)
