"""The `torchscope` pytest plugin (entry point): the fixture and the marker fail leaky tests."""

from __future__ import annotations

import pytest

pytest_plugins = ("pytester",)

_INNER = '''
import pytest
import torch
from torch import nn

# Models that outlive a test (a cache, a module-scoped fixture) carry leaked hooks into the
# next tests; a model that dies with its test takes its hooks with it.
CACHE = []


@pytest.fixture(scope="module")
def shared():
    model = nn.Linear(2, 2)
    CACHE.append(model)
    return model


@pytest.fixture(scope="module", autouse=True)
def _forget_leaks_at_the_end():
    # The suite running this file checks for leaks as well: undo ours once we are checked.
    yield
    for model in CACHE:
        for sub in model.modules():
            sub._forward_hooks.clear()
            sub._backward_hooks.clear()
            sub._forward_pre_hooks.clear()


@pytest.mark.torchscope_no_hook_leak
def test_marker_leak():
    model = nn.Sequential(nn.Linear(2, 2))
    CACHE.append(model)
    model[0].register_forward_hook(lambda m, i, o: None)  # noqa: TS002


@pytest.mark.torchscope_no_hook_leak
def test_marker_clean():
    model = nn.Sequential(nn.Linear(2, 2))
    CACHE.append(model)
    with model[0].register_forward_hook(lambda m, i, o: None):
        model(torch.zeros(1, 2))


def test_fixture_leak(torchscope_hook_leaks, shared):
    torchscope_hook_leaks.track(shared)
    shared.register_full_backward_hook(lambda m, gi, go: None)  # noqa: TS002


def test_fixture_clean(torchscope_hook_leaks):
    model = nn.Linear(2, 2)
    CACHE.append(model)
    h = model.register_forward_pre_hook(lambda m, a: None)
    h.remove()


def test_unchecked_leak_passes():
    model = nn.Linear(2, 2)
    CACHE.append(model)
    model.register_forward_hook(lambda m, i, o: None)  # noqa: TS002
'''


def test_plugin_fails_leaky_tests_and_passes_clean_ones(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=_INNER)
    # No -p: the plugin must come from its pytest11 entry point.
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--strict-markers", "-rE")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    # A leak found when the fixture tears down is reported as an error of that test.
    result.assert_outcomes(passed=5, errors=2)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_marker_leak*",
        "test left hooks behind: Sequential:0 forward×1",
        "*ERROR at teardown of test_fixture_leak*",
        "test left hooks behind: Linear: backward×1",
    ])
    errored = [line for line in result.outlines if line.startswith("ERROR ")]
    assert len(errored) == 2
    assert not any("clean" in line or "unchecked" in line for line in errored)


def test_plugin_passes_a_clean_file(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=_INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-k", "clean or unchecked")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=3)
