"""Gradient flow: per-call gradient norms from tensor hooks, their history, and diagnosis.

One step (a `Step`, or a model with its inputs and loss):

    flow = gradient_flow(model, x, loss_fn="cross_entropy", target=y)
    flow.modules          # per call, backward order: grad_output / grad_input norms
    flow.params           # per parameter: .grad norm, or why there is none
    flow.total_norm       # what clip_grad_norm_ returns
    flow.layer_grads()    # per module: gradient RMS, relative gradient ‖g‖/‖w‖, update ratio
    flow.step             # the step that ran: loss (and its value), optimizer, AMP
    flow.findings()       # vanishing / exploding / dead / NaN findings (`diagnose`)

Vanishing and exploding are judged on scale-free measures across depth (`depth_profile`);
docs/diagnosis.md gives every criterion and where it comes from.

A training loop (samples on optimizer steps, keeps norms only):

    with watch_gradients(model, every=10, optimizer=opt, scaler=scaler) as watch:
        ...
    watch.history, watch.last, watch.findings()

Unlike `register_full_backward_hook`, this works with in-place ops after a module, reused
modules, frozen parameters and modules the loss does not reach, and leaves every gradient
bitwise unchanged.

On a DDP or FSDP2 model `flow.ranks` (`RankGrads`) holds every rank's per-parameter norms:
under DDP before and after the all-reduce, under FSDP2 the shard norms whose squares sum to
the global norm that `flow.params` report; `flow.findings()` adds ranks whose synchronised
gradients differ (`grads.ranks_diverge`) and skewed local gradients (`grads.rank_skew`).
A DDP watch joins them for its last sample when its block ends.
"""

from torchscope.grads.analyze import GradThresholds, depth_profile, diagnose, layer_norms
from torchscope.grads.flow import GradWatch, gradient_flow, watch_gradients
from torchscope.grads.records import (
    BrokenUpdate,
    GradFlow,
    GradHistory,
    LayerGrads,
    ModuleGradRecord,
    ParamGradRecord,
    RankGrads,
    TensorGrad,
)

__all__ = [
    "BrokenUpdate",
    "GradFlow",
    "GradHistory",
    "GradThresholds",
    "GradWatch",
    "LayerGrads",
    "ModuleGradRecord",
    "ParamGradRecord",
    "RankGrads",
    "TensorGrad",
    "depth_profile",
    "diagnose",
    "gradient_flow",
    "layer_norms",
    "watch_gradients",
]
