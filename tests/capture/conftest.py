"""The capture tests run on both reduction paths: eager ops and the fused kernel."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from torchscope import _kernels


@pytest.fixture(params=["eager", "fused"])
def stats_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """`eager`: every statistic by eager ops. `fused`: the fused kernel, ready before the test
    starts (built once per machine, so the first run may wait for it); skipped where it cannot
    be built (no C++ compiler)."""
    if request.param == "eager":
        with _kernels.disabled():
            yield "eager"
        return
    status = _kernels.prepare("stats", wait=None)
    if status.state != "ready":
        pytest.skip(f"no fused kernel here: {status.reason}")
    yield "fused"
