"""`iter_tensors`: every tensor of a nested output, named by how it is reached."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from torchscope.hooks import iter_tensors


@dataclasses.dataclass
class _Pair:
    a: torch.Tensor
    b: object


class _State:
    """A plain object holding tensors, as a KV cache does."""

    def __init__(self, t: torch.Tensor) -> None:
        self.layers = [{"keys": t}]
        self.model = nn.Linear(2, 2)  # modules are not entered
        self.me = self  # a cycle


def test_paths_read_like_the_access() -> None:
    t = torch.zeros(2)
    tree = (t, {"x": [t, None]}, _Pair(t, "text"))
    got = [(p, x is t) for p, x in iter_tensors(tree, "out")]
    assert got == [("out[0]", True), ("out[1]['x'][0]", True), ("out[2].a", True)]


def test_objects_are_entered_only_on_request_each_once_and_modules_never() -> None:
    t = torch.ones(3)
    state = _State(t)
    assert list(iter_tensors({"cache": state})) == []
    got = list(iter_tensors({"cache": state, "again": state}, objects=True))
    assert [(p, x is t) for p, x in got] == [("['cache'].layers[0]['keys']", True)]
