"""`torch.utils.checkpoint` seen from inside a hook: a forward that runs inside backward (a
recomputation, and of which kind), a module forward run inside a reentrant checkpoint's
first forward, and a saved tensor that is a checkpoint's input.

A hook cannot ask torch which of these it is in; the autograd node running now and the
Python stack say. The stack walks are bounded and run only on paths that are rare in a
healthy step (a module run with gradients disabled inside a forward with them, a tensor
saved from `torch.utils.checkpoint`'s own file).
"""

from __future__ import annotations

import functools
import sys
from types import FrameType
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["checkpoint_saving", "checkpointed_module", "in_backward", "in_reentrant_forward"]

_FILE = torch.utils.checkpoint.__file__
_APPLY = torch.autograd.Function.apply.__func__.__code__  # type: ignore[attr-defined]
_MAX_FRAMES = 64  # frames looked through for a reentrant checkpoint's forward
_MAX_CHECKPOINT_FRAMES = 8  # torch's own frames between its input saving and `checkpoint`


def in_backward() -> Literal["no", "replay", "reentrant"]:
    """Where a forward that runs now stands: `no` outside backward; inside it, a
    checkpoint's recomputation. Non-reentrant checkpointing (`use_reentrant=False`)
    recomputes only to refill saved tensors, a `replay`: backward runs the first forward's
    graph. Reentrant checkpointing (torch's default when `use_reentrant` is not given) ran
    the first forward under no_grad, and its node (`CheckpointFunctionBackward`)
    backpropagates through the graph that the recomputation builds, in a nested backward:
    that `reentrant` forward is the one with gradients. So is a forward inside another
    custom Function's backward, outside `torch.utils.checkpoint`'s code."""
    node = torch._C._current_autograd_node()
    if node is None:
        return "no"
    if type(node).__name__ == "CheckpointFunctionBackward":
        return "reentrant"
    if isinstance(node, torch.autograd.function.BackwardCFunction) and not _in_checkpoint():
        # Another custom Function's backward that runs modules with gradients: it
        # recomputes its forward, which ran without them, and backpropagates through that
        # (transformers' Reformer's reversible layers), as a reentrant checkpoint does.
        return "reentrant"
    return "replay"


def _in_checkpoint() -> bool:
    """Whether the caller runs inside `torch.utils.checkpoint`'s code: there, a forward in
    backward is a non-reentrant checkpoint's replay, whichever node unpacks the tensor."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return False
        if frame.f_code.co_filename == _FILE:
            return True
        frame = frame.f_back
    return False


def in_reentrant_forward() -> bool:
    """Whether the caller runs inside the first forward of a reentrant checkpoint (its one
    `forward` in torch's file, `CheckpointFunction.forward`, which runs under no_grad)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename == _FILE:
            return True
        frame = frame.f_back
    return False


def checkpoint_saving() -> tuple[bool, Any]:
    """Called from a saved-tensor pack hook: whether the tensor packed now is an input that
    `torch.utils.checkpoint` keeps, and the function it checkpoints (None where not found).

    Both kinds save their inputs through the ambient saved-tensor hooks: the non-reentrant
    one from its own file, the reentrant one through `Function.apply` called from it. Any
    other save comes from an op, whose Python caller is the model's code.
    """
    frame: FrameType | None = sys._getframe(2)  # the pack hook's caller
    if frame is not None and frame.f_code is _APPLY:
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename != _FILE:
        return False, None
    for _ in range(_MAX_CHECKPOINT_FRAMES):
        if frame is None or frame.f_code.co_filename != _FILE:
            break
        if frame.f_code.co_name == "checkpoint":
            return True, frame.f_locals.get("function")
        frame = frame.f_back
    return True, None


def checkpointed_module(fn: Any) -> nn.Module | None:
    """The module a checkpointed function runs: the module itself, one of its bound methods
    (`block.forward`), either inside `functools.partial`, a partial of a plain function
    with the module first (transformers' layers: `partial(forward, self, **kwargs)`), or a
    method of a wrapper that names the module as `.module` (`torchscope.memory.apply`'s)."""
    for _ in range(8):
        if isinstance(fn, nn.Module):
            return fn
        if isinstance(fn, functools.partial):
            inner = fn.func
            if not isinstance(inner, (nn.Module, functools.partial)) and \
                    getattr(inner, "__self__", None) is None and fn.args and \
                    isinstance(fn.args[0], nn.Module):
                return fn.args[0]
            fn = inner
            continue
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, nn.Module):
            return owner
        wrapped = getattr(owner, "module", None)
        return wrapped if isinstance(wrapped, nn.Module) else None
    return None
