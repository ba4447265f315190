"""torchscope.compile (in progress)."""
