"""torchscope.grads (in progress)."""
