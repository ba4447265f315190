"""Module selection by glob, type, class, predicate and depth."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from torchscope.errors import SelectionError
from torchscope.hooks import select_modules
from torchscope.models import ResNetMini, TinyCNN


def names(pairs: list[tuple[str, nn.Module]]) -> list[str]:
    return [n for n, _ in pairs]


def test_default_is_leaves_in_order() -> None:
    assert names(select_modules(TinyCNN())) == ["conv1", "relu", "conv2", "pool", "fc"]


def test_glob_type_name_class_and_predicate() -> None:
    model = ResNetMini(blocks=3)
    assert names(select_modules(model, "blocks.*.conv")) == [
        "blocks.0.conv",
        "blocks.1.conv",
        "blocks.2.conv",
    ]
    assert len(select_modules(model, "Conv2d")) == 4
    assert len(select_modules(model, nn.BatchNorm2d)) == 4
    assert names(select_modules(model, lambda n, m: n.endswith("relu"))) == [
        "blocks.0.relu",
        "blocks.1.relu",
        "blocks.2.relu",
    ]
    assert names(select_modules(model, "fc,stem.0")) == ["stem.0", "fc"]
    assert len(select_modules(model, "blocks.**")) == 3 + 3 * 3  # blocks and their children
    assert names(select_modules(model, "blocks.[01]")) == ["blocks.0", "blocks.1"]


def test_depth() -> None:
    model = ResNetMini(blocks=2)
    assert names(select_modules(model, depth=1)) == ["stem", "blocks", "pool", "fc"]
    assert "blocks.0" in names(select_modules(model, depth=2))
    with pytest.raises(SelectionError, match=r"depth=-1 selects no module.*Fix: pass depth=1"):
        select_modules(model, depth=-1)


def test_no_match_lists_close_matches() -> None:
    with pytest.raises(SelectionError) as info:
        select_modules(TinyCNN(), "conv3")
    assert "conv1" in str(info.value) and "conv2" in str(info.value)
    with pytest.raises(SelectionError, match="LSTM"):
        select_modules(TinyCNN(), nn.LSTM)


def test_predicate_or_empty_list_matching_nothing_is_an_error() -> None:
    with pytest.raises(SelectionError, match="predicate"):
        select_modules(TinyCNN(), lambda n, m: False)
    with pytest.raises(SelectionError, match="empty list"):
        select_modules(TinyCNN(), [])


def test_torchscript_submodules_are_left_out_of_every_selection(
        scripted_part: Callable[[], nn.Module]) -> None:
    """A ScriptModule refuses hooks (`register_forward_hook` raises): neither it nor what
    is inside it can be selected, and an eager module whose children are all scripted is
    the leaf."""
    from torchscope.hooks.select import hookable_modules

    model = nn.Sequential(scripted_part(), nn.Linear(8, 2), nn.Sequential(scripted_part()))
    names = [n for n, _ in model.named_modules()]
    assert "0.fc" in names  # torch lists the scripted module's insides
    assert [n for n, _ in hookable_modules(model)] == ["", "1", "2"]
    assert [n for n, _ in select_modules(model)] == ["1", "2"]
    assert [n for n, _ in select_modules(model, "*")] == ["1", "2"]


def test_a_parametrized_module_is_the_leaf_not_its_parametrizations() -> None:
    """weight_norm and spectral_norm (torch.nn.utils.parametrizations) hang modules under
    the layer that compute its weight: the layer is the leaf, and they are left out of the
    default selection (a glob or type still reaches them)."""
    from torch.nn.utils import parametrizations

    from torchscope.hooks.select import own_parameters, parametrization_owners

    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 16)), nn.ReLU(),
                          parametrizations.spectral_norm(nn.Linear(16, 4)))
    assert "0.parametrizations.weight.0" in [n for n, _ in model.named_modules()]
    assert names(select_modules(model)) == ["0", "1", "2"]
    assert names(select_modules(model, depth=2)) == ["0", "1", "2"]
    assert names(select_modules(model, "_SpectralNorm")) == ["2.parametrizations.weight.0"]
    owners = parametrization_owners(model)
    assert owners["0.parametrizations.weight"] == "0"
    assert owners["2.parametrizations.weight.0"] == "2"
    assert "1" not in owners and "0" not in owners
    assert [n for n, _ in own_parameters(model[0])] == [
        "bias", "parametrizations.weight.original0", "parametrizations.weight.original1"]
    assert [n for n, _ in own_parameters(model[1])] == []


def test_the_default_adds_modules_that_compute_with_parameters_of_their_own() -> None:
    """nn.MultiheadAttention projects and attends with its own weights and reads out_proj's
    weight without calling it; a layer with a learned scale around a child does the same.
    Leaves alone left both out, so their outputs were never seen."""
    from torchscope.hooks.select import holds_parameters

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.inner = nn.Linear(4, 4)

    class Root(nn.Module):  # the root's own parameters never select it
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(4))
            self.attn = nn.MultiheadAttention(4, 2)
            self.block = nn.Sequential(Scaled(), nn.ReLU())

    model = Root()
    assert names(select_modules(model)) == [
        "attn", "attn.out_proj", "block.0", "block.0.inner", "block.1"]
    assert holds_parameters(model.attn) and not holds_parameters(model.block)
    assert names(select_modules(model, depth=1)) == ["attn", "block"]
    # The modules that compute a parametrized weight stay out; the layer is picked once.
    from torch.nn.utils import parametrizations
    wn = nn.Sequential(nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 4))))
    assert names(select_modules(wn)) == ["0.0"]
