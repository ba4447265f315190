"""torchscope.integrations (in progress)."""
