"""torchscope.profiling (in progress)."""
