"""The gradient-flow tests run on both norm paths: eager `vector_norm` and the fused kernel."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from torchscope import _kernels


@pytest.fixture(params=["eager", "fused"])
def norm_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """`eager`: every activation-gradient norm by `vector_norm`. `fused`: by the fused kernel,
    ready before the test starts (built once per machine); skipped where it cannot be built."""
    if request.param == "eager":
        with _kernels.disabled():
            yield "eager"
        return
    status = _kernels.prepare("norm", wait=None)
    if status.state != "ready":
        pytest.skip(f"no fused kernel here: {status.reason}")
    yield "fused"
