"""torchscope.lint (in progress)."""
