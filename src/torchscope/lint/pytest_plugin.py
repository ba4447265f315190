"""pytest plugin (entry point `torchscope`): fail tests that leave hooks on modules they built.

Use the `torchscope_hook_leaks` fixture, or mark a test with `@pytest.mark.torchscope_no_hook_leak`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from torchscope.hooks.leakcheck import HookLeakTracker


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "torchscope_no_hook_leak: fail if the test leaves hooks on a module it built"
    )


@pytest.fixture
def torchscope_hook_leaks() -> Iterator[HookLeakTracker]:
    """Track modules built during the test; fail it if any still carries a hook at the end."""
    with HookLeakTracker() as tracker:
        yield tracker
    leaks = tracker.leaks()
    if leaks:
        detail = ", ".join(f"{e.owner} {e.kind}×{e.count}" for e in leaks)
        pytest.fail(f"test left hooks behind: {detail}", pytrace=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("torchscope_no_hook_leak") is not None:
        fixturenames = getattr(item, "fixturenames", None)
        if fixturenames is not None and "torchscope_hook_leaks" not in fixturenames:
            fixturenames.append("torchscope_hook_leaks")
