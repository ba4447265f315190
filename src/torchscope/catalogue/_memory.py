"""The catalogue's `memory.*` entries: what `torchscope.memory` finds in one training step's
saved activations and totals (`MemoryReport.findings()`), in its checkpoint plans
(`PlanReport`), in the live tensors (`LiveTensors`) and across a memory watch
(`MemoryHistory`, `MemoryWatch`). The ranks' `memory.sharding` and `memory.ddp_buckets` are
declared with the distributed entries."""

from __future__ import annotations

from torchscope.catalogue._base import INFO, INFO_WARNING, WARNING
from torchscope.findings import Entry, Subject

# A plan's caveat is a warning only where the user asked for checkpointing: a plan the
# doctor makes unasked, for a model whose memory is no concern, is a note.
_ASKED = ("warning where checkpointing was asked for (analyze_memory(checkpoint=...), "
          "torchscope memory --checkpoint, a budget, plan_checkpointing); info where the plan "
          "was only proposed (the doctor plans one for every model, unasked).")

ENTRIES: tuple[Entry, ...] = (
    Entry(
        code="memory.saved_by_type",
        title="Which module type holds the saved activations",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info: where the step's activation memory goes, not a fault.",
        meaning="The module type whose outputs (and inputs) autograd keeps for backward the "
                "most, with its share of all saved activations. It tells what checkpointing "
                "or a cheaper layer would give back.",
        criterion="Saved tensors are counted once per storage (views share one) in the "
                  "forward of one training step through autograd's saved-tensor hooks, and "
                  "summed per module type; parameters and buffers count as model state, not "
                  "activations.",
        example="ReLU outputs hold 57% of saved activations (14.0 MiB of 24.4 MiB).",
    ),
    Entry(
        code="memory.largest_saver",
        title="One module keeps a large share of the saved activations",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info.",
        meaning="A single module keeps a quarter or more of what the step saves for backward: "
                "the block around it is the one checkpointing would give the most back from.",
        criterion="More than two modules saved something, and the largest alone keeps at "
                  "least 25% of the saved bytes (and is not already the whole of its type's "
                  "share, which memory.saved_by_type names).",
        fix="checkpoint the block containing it, or lower its batch or sequence size.",
        example="encoder.3 (Block) alone keeps 31% of saved activations (4.0 MiB).",
    ),
    Entry(
        code="memory.activations_dominate",
        title="Saved activations exceed the model's state",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info: common for convolutional networks and long sequences; a "
                 "fact to plan memory by.",
        meaning="The step keeps more bytes of activations for backward than parameters, "
                "gradients and optimizer state together, so the batch or sequence size, not "
                "the model's size, sets its memory. Checkpointing trades recompute for it.",
        criterion="Saved-activation bytes of one step above parameters + gradients + "
                  "optimizer state (measured, or estimated before the optimizer's first "
                  "step).",
        fix="checkpoint parts of forward with torch.utils.checkpoint.checkpoint(fn, x, "
            "use_reentrant=False) (torchscope memory --checkpoint auto plans it), or lower "
            "the batch or sequence size.",
        example="saved activations (24.4 MiB) exceed parameters, gradients and optimizer "
                "state together (188.1 KiB).",
    ),
    Entry(
        code="memory.optimizer_state",
        title="Optimizer state is a multiple of the parameters",
        subject=Subject.LOOP,
        levels=INFO,
        severity="always info: Adam keeps two moments per parameter by design.",
        meaning="The optimizer keeps 1.5× the parameters' bytes or more (Adam and AdamW "
                "keep 2×). On a large model it is the largest part of the step's memory.",
        criterion="Optimizer state bytes (measured from its state, or estimated from its "
                  "type before its first step) at least 1.5× the parameter bytes.",
        fix="a sharded optimizer (ZeroRedundancyOptimizer, FSDP) or an 8-bit one lowers it.",
        example="optimizer state is 2.0× the parameters (1.5 MiB, measured).",
    ),
    Entry(
        code="memory.estimate_vs_measured",
        title="The counted memory against the measured peak",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="always info: how the count and the measurement compare.",
        meaning="What the step keeps by count (saved activations, outputs, gradients) beside "
                "the peak it measurably allocated. Transient buffers (unsaved intermediates, "
                "kernel workspaces) raise the measurement; backward freeing activations "
                "while it writes gradients lowers it.",
        criterion="On CUDA torch.cuda.max_memory_allocated after reset_peak_memory_stats; "
                  "on the CPU torch.profiler's memory events summed in time order. Only "
                  "what the step allocated above what was live when it began.",
        example="the step keeps 24.5 MiB by count (saved activations, outputs, gradients); "
                "its measured peak is 36.1 MiB (1.47×).",
    ),
    Entry(
        code="memory.compiled_eager",
        title="Saved activations of a compiled model were counted eagerly",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="info: the count is the eager model's, a caveat of the measurement.",
        meaning="The model has torch.compile'd parts, and they ran eagerly while torchscope "
                "counted what autograd saves: hooks fire only in eager code. The bytes are "
                "what the eager model saves; the compiled graph keeps what its partitioner "
                "chose (often less, recomputing cheap ops in backward).",
        criterion="compiled_parts(model) is not empty when the count ran (torch.compile "
                  "wrappers, module.compile(), or a compiled forward set on the instance).",
        fix="compare the compiled step's own peak (torch.cuda.max_memory_allocated around "
            "it, no torchscope hooks open) with the eager one.",
        example="the model's compiled parts (<root>) ran eagerly while the saved-activation "
                "count was open: ...",
    ),
    Entry(
        code="memory.unseen_forward",
        title="The memory watch saw no forward",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="warning: an empty record would read as a healthy one; the loop calls a "
                 "module the watch was not given.",
        meaning="The memory watch was open and no forward of the model with gradients on ran "
                "through its hooks, so nothing was sampled. The usual cause is a "
                "torch.compile wrapper made before the watch opened, which never runs hooks "
                "added later, or a select= naming modules that do not run.",
        criterion="No sampled forward when the watch's findings were asked for.",
        fix="give torchscope the module that the loop calls (a compiled module then runs "
            "eagerly while watched); check that select names modules that run.",
        example="no forward of the model with gradients on ran through the memory watch's "
                "hooks while it was open: nothing was sampled.",
    ),
    Entry(
        code="memory.no_plan",
        title="No checkpoint plan could be made",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info: the analysis says why and goes on.",
        meaning="Checkpointing was planned, but the model has no sequence of repeated blocks "
                "to checkpoint (or none of its blocks holds trainable work), so there is no "
                "plan to offer.",
        criterion="default_blocks found no outermost list of repeated blocks (or blocks= "
                  "matched blocks that all hold no parameter that requires grad and take no "
                  "input that needs grad).",
        fix="checkpoint parts of forward yourself with torch.utils.checkpoint.checkpoint(fn, "
            "x, use_reentrant=False), or name the blocks (blocks=...).",
        example="no checkpoint plan: the model has no sequence of repeated blocks.",
    ),
    Entry(
        code="memory.blocks_excluded",
        title="Blocks left out of checkpoint planning",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info.",
        meaning="Some blocks are not offered for checkpointing: checkpointing a block without "
                "trainable work saves nothing and keeps its input, and a block the step never "
                "ran cannot be measured.",
        criterion="A block with no parameter that requires grad and no input that needs "
                  "grad, or one that no forward of the step called.",
        example="2 block(s) left out of checkpoint planning (layers.0, layers.1): no "
                "trainable work.",
    ),
    Entry(
        code="memory.plan_note",
        title="How the checkpoint plans were made",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="always info: a note on the planning itself.",
        meaning="A condition under which the plans were made and measured, e.g. that model "
                "caches (use_cache) were turned off, as checkpointing requires.",
        criterion="Written by the planner where it changed how the model ran.",
        example="planned and verified with use_cache=False: ...",
    ),
    Entry(
        code="memory.plan_keeps_more",
        title="A checkpoint plan keeps more than none",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info: the plan is simply not offered.",
        meaning="Checkpointing these blocks keeps no fewer saved bytes than checkpointing "
                "nothing (each checkpoint keeps its input, and the blocks save little "
                "inside), so the plan is not offered.",
        criterion="Predicted or measured saved bytes of the plan at or above those of no "
                  "checkpointing.",
        example="all: checkpointing all 4 blocks is not offered: it keeps 1.2 MiB, no less "
                "than none.",
    ),
    Entry(
        code="memory.checkpoint_failed",
        title="A checkpoint plan failed its verification",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity=_ASKED,
        meaning="Applied, the plan changed the step's result: the loss, a gradient, or a "
                "returned tensor differed from the step without checkpointing beyond "
                "tolerance, so it is not offered. Blocks that change state in forward "
                "(caches, counters, random draws outside torch's generators) recompute "
                "something else.",
        criterion="Two identically seeded steps, with and without the plan: the loss and "
                  "every gradient compared with torch.equal, then within tolerance; any "
                  "missing or extra gradient, or a returned tensor that ends differently, "
                  "fails it.",
        fix="leave out the blocks that change state in forward (blocks=...), or make their "
            "forward recompute exactly what it computed.",
        example="sqrt: checkpointing blocks 0–3 of 8 failed its verification, so it is not "
                "offered: gradient of fc.weight differs by 0.3.",
    ),
    Entry(
        code="memory.checkpoint_plan",
        title="A verified checkpoint plan",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info: an offer, which the user may take or leave.",
        meaning="What checkpointing these blocks gives back in saved activations, what it "
                "costs in step time, that its gradients were verified, and what it did to the "
                "measured peak. Where the peak did not fall (it comes later, in backward), "
                "the plan lowers it by nothing and is not recommended.",
        criterion="Saved bytes counted with the plan applied; step time as the ratio of "
                  "median step times with and without it, timed interleaved, with its "
                  "order-statistic interval (torchscope._timing.compare): a ratio whose "
                  "interval includes 1 is no measurable cost, never a negative one. The "
                  "plan is chosen as the least recompute within a budget of saved bytes "
                  "(by default what √L segments keep).",
        literature="Chen et al. 2016, Training Deep Nets with Sublinear Memory Cost "
                   "(arXiv:1604.06174).",
        fix="torchscope.memory.apply(model, blocks=...) installs the plan (the finding names "
            "the call).",
        example="budget: checkpointing all 3 blocks in 2 segments saves 12.0 MiB of saved "
                "activations (49%) at no measurable cost in step time (0.66–2.06×), "
                "gradients verified identical; measured peak 36.1 MiB → 24.1 MiB.",
    ),
    Entry(
        code="memory.not_bitwise",
        title="Checkpointed gradients are not bitwise equal",
        subject=Subject.ENVIRONMENT,
        levels=INFO_WARNING,
        severity=_ASKED,
        meaning="With the plan, gradients are within tolerance of those without it but not "
                "bitwise equal: nondeterministic kernels (atomic adds on GPU) or a different "
                "order of reductions in the recompute.",
        criterion="torch.equal fails for some gradient while every difference is within "
                  "tolerance.",
        fix="torch.use_deterministic_algorithms(True) makes runs comparable bitwise.",
        example="sqrt: gradients are within tolerance but not bitwise equal (max diff "
                "2.4e-07).",
    ),
    Entry(
        code="memory.buffers_recomputed",
        title="Checkpointing updates buffers twice",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity=_ASKED,
        meaning="Recomputation runs a checkpointed block's forward again in backward, and a "
                "module that updates buffers in forward (BatchNorm's running mean and "
                "variance, a step counter) updates them twice: training statistics drift "
                "from those of the step without checkpointing, while gradients stay the "
                "same.",
        criterion="After two identically seeded steps with and without the plan, some "
                  "buffer differs (torch.equal).",
        fix="keep BatchNorm outside checkpointed blocks, or accept the double update "
            "(momentum then counts each step twice).",
        example="budget: buffers (e.g. BatchNorm running stats) end differently with "
                "checkpointing: recomputation runs their forward, and its update, again.",
    ),
    Entry(
        code="memory.empty_cache",
        title="empty_cache() cannot free what is still referenced",
        subject=Subject.LOOP,
        levels=INFO_WARNING,
        severity="warning when more stays allocated by live tensors than empty_cache() "
                 "released; info otherwise.",
        meaning="torch.cuda.empty_cache() returns cached, unused blocks to the device; it "
                "cannot free tensors that something still references. Memory that stays "
                "allocated after it is held by live tensors.",
        criterion="CUDA reserved bytes before and after empty_cache(), against the bytes "
                  "still allocated after it.",
        fix="del the tensors (and anything referring to them) first, then empty_cache().",
        example="empty_cache() released 0 B of cached memory; 512.0 MiB stays allocated by "
                "12 live tensor storages.",
    ),
    Entry(
        code="memory.largest_live",
        title="The largest live tensor and what holds it",
        subject=Subject.LOOP,
        levels=INFO,
        severity="always info.",
        meaning="The largest tensor still alive, with the Python object that refers to it: "
                "the first place to look when memory does not come back.",
        criterion="Every tensor the garbage collector tracks, by storage (views counted "
                  "once), largest first; referrers from gc.get_referrers.",
        example="the largest live tensor (1024, 1024) float32 (4.0 MiB) is held by local "
                "'cache' in train().",
    ),
    Entry(
        code="memory.saved_growth",
        title="Saved activations grew across the watch",
        subject=Subject.DATA,
        levels=INFO,
        severity="always info: longer inputs or more of the model running explain it.",
        meaning="A later sampled forward saved 1.5× or more of the first one's bytes: the "
                "inputs grew (batch or sequence length), or more of the model ran.",
        criterion="The newest sample's saved bytes at least 1.5× the oldest's.",
        example="saved activations grew from 1.0 MiB (forward 0) to 4.0 MiB (forward 9).",
    ),
    Entry(
        code="memory.peak_growth",
        title="The peak per step grew",
        subject=Subject.LOOP,
        levels=INFO_WARNING,
        severity="warning when the peak grew 1.5× while saved activations did not "
                 "(something keeps tensors across steps); info when saved activations grew "
                 "too.",
        meaning="The CUDA peak allocated per step grew across the watch. Without more saved "
                "activations, memory is being kept across steps: a loss kept with its graph, "
                "outputs collected while they require grad.",
        criterion="The newest sampled step's CUDA peak at least 1.5× the oldest's.",
        fix="keep no graph across steps: log loss.item() or loss.detach(), not loss; do not "
            "collect outputs that require grad.",
        example="the peak allocated per step grew from 1.0 GiB (forward 0) to 2.1 GiB "
                "(forward 40) while saved activations did not: something keeps tensors "
                "across steps.",
    ),
)

