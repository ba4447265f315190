"""torchscope.memory (in progress)."""
