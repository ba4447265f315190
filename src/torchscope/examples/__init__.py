"""Runnable examples: `python -m torchscope.examples.<name>`.

- `train_monitor`: a 200-step training run of a built-in model on a synthetic task, watched
  by `torchscope.monitor`, ending in a run report.
"""
