"""Integrations with other tools. Import the submodule you need; each imports its tool only
then (`import torchscope` imports none of them):

- `torchscope.integrations.lightning`: `TorchscopeCallback`, the run monitor in a PyTorch
  Lightning `Trainer` (`pip install torchscope[lightning]`).
- `torchscope.integrations.hf`: `TorchscopeTrainerCallback`, the run monitor in a Hugging
  Face `Trainer` (`pip install torchscope[hf]`).
- `torchscope.integrations.tensorboard`: gradient-flow norms to TensorBoard.
"""
