"""Fixtures shared by the compile tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Reset Dynamo's caches around a test, so no compiled graph leaks between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
