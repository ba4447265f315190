"""The catalogue's `profiling.*` entries: what `torchscope.profiling` finds in a profile of
training steps (`ProfileResult.findings()`) and, over every rank's profile, the straggler
(`Ranked[ProfileResult].findings()`)."""

from __future__ import annotations

from torchscope.catalogue._base import INFO, INFO_WARNING, WARNING
from torchscope.findings import Entry, Subject

# Where the profiled steps' phase times are facts: `profiling.backward_ratio` and
# `profiling.optimizer_share` share this clause.
_TRUSTED = (
    "Only where the profiled steps were measured no slower than plain ones within a narrow "
    "interval: the interval of the ratio of their median step times (profiled over plain, "
    "torchscope._timing.compare, order-statistic intervals of the medians) lies at or below "
    "1.25 and does not lie wholly above 1. Otherwise the phase times carry the profiler's "
    "own cost (a few µs per op, most of it on a backward of many small ops; one preempted "
    "step weighs in full over a few), and no finding is made: the section's phase table "
    "still shows them.")

ENTRIES: tuple[Entry, ...] = (
    Entry(
        code="profiling.top_op",
        title="The costliest op",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info: where the step's time goes, not a fault.",
        meaning="The op with the most self time over the profiled steps: the first place to "
                "look for a cheaper step. Matrix products and convolutions on top are the "
                "model's arithmetic; copies (to, contiguous, clone) on top are data movement "
                "the step could avoid.",
        criterion="torch.profiler's key_averages over the profiled steps, sorted by self "
                  "device time where kernels ran on a GPU, else self CPU time; autograd's "
                  "node ranges, FSDP's ranges, DataLoader and optimizer ranges and "
                  "collectives are left out (they are phases or waits, not ops).",
        fix="for matrix products and convolutions: mixed precision (torch.autocast), a "
            "larger batch per step or torch.compile; for copies: move .to()/.contiguous() "
            "out of the step.",
        example="aten::addmm takes 41% of self CPU time (10 calls, 0.21 ms per step).",
    ),
    Entry(
        code="profiling.host_sync",
        title="The step synchronises host and device",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="warning: on an accelerator each synchronisation stalls the host until the "
                 "device has caught up.",
        meaning="The step reads device tensors to Python (.item(), .cpu(), print, "
                "bool(t)) or waits for the device outright. Each read makes the host wait "
                "for every queued kernel, so the host stops running ahead of the device and "
                "the device idles while the next step's kernels are launched.",
        criterion="On an accelerator only: reads of device tensors (aten::_local_scalar_dense "
                  "with a device copy under it) and the runtime's own waits "
                  "(cudaDeviceSynchronize, cudaStreamSynchronize, ...) in the profiled "
                  "steps, less torchscope's own synchronisation at each step boundary, the "
                  "profiler's at its end, Adam's reads of its host-side step counters and "
                  "a GradScaler's inf check (profiling.scaler_sync).",
        fix="drop .item()/.cpu()/print of tensors from the step, or do it every N steps.",
        example="the step synchronises host and device 3 time(s) per step "
                "(aten::_local_scalar_dense, aten::item).",
    ),
    Entry(
        code="profiling.host_read",
        title="The step reads tensor values to Python",
        subject=Subject.LOOP,
        levels=INFO,
        severity="info: on CPU a read waits for nothing; the same line would synchronise "
                 "host and device on a GPU.",
        meaning="The step reads tensor values to Python (.item(), bool(t)). On CPU the value "
                "is already in host memory; moved to a GPU, each such read of a device "
                "tensor makes the host wait for the device (profiling.host_sync).",
        criterion="On CPU: calls of aten::_local_scalar_dense in the profiled steps, outside "
                  "DataLoader ranges, less Adam's reads of its host-side step counters and a "
                  "GradScaler's inf check.",
        fix="on a GPU, read tensors every N steps rather than at each one.",
        example="the step reads tensor values to Python 1 time(s) per step "
                "(aten::_local_scalar_dense, aten::item); on CPU that waits for nothing, on a "
                "GPU each read of a device tensor would synchronise host and device.",
    ),
    Entry(
        code="profiling.scaler_sync",
        title="The GradScaler synchronises host and device",
        subject=Subject.LOOP,
        levels=INFO,
        severity="info: one sync a step, which the loop's own code did not write.",
        meaning="GradScaler.step reads its inf check (found_inf) to the host to decide "
                "whether to step, a host-device synchronisation at every step of a "
                "non-fused optimizer. It costs little when steps are long.",
        criterion="On an accelerator: the reads of the GradScaler's found_inf tensor among "
                  "the profiled steps' host reads.",
        fix="an optimizer built with fused=True (Adam, AdamW, SGD) takes the check on the "
            "device, and GradScaler.step then reads nothing.",
        example="the GradScaler synchronises host and device 1 time(s) per step: "
                "GradScaler.step reads its inf check (found_inf) to decide whether to step.",
    ),
    Entry(
        code="profiling.input_wait",
        title="The loop waits for its input",
        subject=Subject.DATA,
        levels=INFO_WARNING,
        severity="warning above 20% of the profiled steps' wall time (input_wait_high); info "
                 "above a quarter of that (5%); nothing below.",
        meaning="The loop spends part of each step getting the next batch from its "
                "DataLoader: the model idles while its input is made, in the main process or "
                "by workers that do not keep up.",
        criterion="The time inside the DataLoader's __next__ ranges over the profiled "
                  "steps' total wall time (ProfileThresholds.input_wait_high = 0.2).",
        fix="load in worker processes, which prepare the next batches while the model "
            "computes: DataLoader(..., num_workers=N, persistent_workers=True), with "
            "pin_memory=True for a GPU; where workers already load, raise num_workers or "
            "prefetch_factor and make __getitem__ and the transforms cheaper.",
        fixes={"lightning": "return DataLoader(..., num_workers=N, persistent_workers=True) "
                            "from the LightningDataModule's train_dataloader.",
               "hf": "TrainingArguments(dataloader_num_workers=N, "
                     "dataloader_persistent_workers=True, dataloader_pin_memory=True)."},
        example="the loop spends 38% of its steps getting the next batch (1.2 ms per step, "
                "loading it in the main process).",
    ),
    Entry(
        code="profiling.backward_ratio",
        title="Backward time against forward time",
        subject=Subject.LOOP,
        levels=INFO_WARNING,
        severity="warning where backward takes more than 3.5× the forward and the phase "
                 "times are trusted; info where they are trusted and the ratio is usual; no "
                 "finding where they are not.",
        meaning="A backward usually costs about twice the forward (a gradient for the "
                "input and one for the weights of each layer). Much more means something "
                "extra runs in backward: activation checkpointing recomputing forwards, "
                "backward hooks, or retain_graph and a second backward.",
        criterion="The labelled backward phase's CPU time over the forward's, less the "
                  "communication backward waited for under DDP/FSDP2, above "
                  "ProfileThresholds.backward_ratio_high = 3.5. Phases derived from the "
                  "model's call and autograd's nodes (a loop that labels none) are not "
                  "judged: their forward leaves out a loss computed outside the model, their "
                  "backward does not. " + _TRUSTED,
        fix="look for activation checkpointing, backward hooks or retain_graph in the "
            "step; the module table shows where backward time goes.",
        example="backward takes 5.00× the forward time — more than the usual ~2×.",
    ),
    Entry(
        code="profiling.optimizer_share",
        title="The optimizer takes a large share of the step",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="warning above 25% of the labelled step where the phase times are trusted; "
                 "no finding where they are not.",
        meaning="The optimizer phase takes a large share of the step: a per-parameter "
                "(for-loop) optimizer over many small tensors, or a batch too small for the "
                "model's parameters.",
        criterion="The optimizer phase's CPU time over the sum of the labelled phases, above "
                  "ProfileThresholds.optimizer_share_high = 0.25. " + _TRUSTED,
        fix="use foreach=True or fused=True in the optimizer, or a larger batch per step.",
        fixes={"hf": "TrainingArguments(optim=\"adamw_torch_fused\"), or a larger "
                     "per_device_train_batch_size."},
        example="the optimizer takes 41% of the step.",
    ),
    Entry(
        code="profiling.top_module",
        title="The costliest module",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info: where the model's time goes, not a fault.",
        meaning="The module whose own forward and backward time (its timed children "
                "excluded) is the largest share of the time spent in modules: where to "
                "look first to make the model cheaper.",
        criterion="Per-module forward ranges and the backward attributed to each module "
                  "through autograd's sequence numbers, summed over the profiled steps.",
        example="fc1 (Linear) is the costliest module: 0.12 ms forward + 0.21 ms backward "
                "per step (52% of module time).",
    ),
    Entry(
        code="profiling.overhead",
        title="Steps ran slower under the profiler",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="info: a caveat about torchscope's measurement, never a fault of the model.",
        meaning="The profiled steps ran measurably slower than plain ones: torch.profiler "
                "and the per-module ranges cost time per op. Absolute times in the profile "
                "are inflated; shares between ops hold better. The step time a report's "
                "metrics give (profile.bare_step_ms) is the plain one.",
        criterion="The ratio of the profiled steps' median wall time to the plain steps' "
                  "(baseline_steps), with its interval (torchscope._timing.compare); a "
                  "finding where the interval lies wholly above 1 and the median above "
                  "ProfileThresholds.overhead_high = 1.5.",
        fix="time fewer modules (select=/depth=) or turn by_module off for absolute times.",
        example="steps ran 2.00× (1.95–2.04) slower under the profiler; absolute times are "
                "inflated, shares between ops hold better.",
    ),
    Entry(
        code="profiling.no_phases",
        title="The step labelled no phase",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="info: without phases the profile cannot split the step.",
        meaning="The step function labelled no forward, backward or optimizer range, and "
                "the forward could not be read from the model's own ranges: the profile "
                "has no phase split (or only what torch's own ranges give), and the checks "
                "on phases are not made.",
        criterion="No labelled phase in the profiled steps, or only phases derived from "
                  "torch's ranges without the model's root range.",
        fix="wrap the step's parts in torchscope.profiling.phase('forward') etc., or pass "
            "the model (and no select= that leaves its root out).",
        example="the step labelled no forward/backward/optimizer phase.",
    ),
    Entry(
        code="profiling.compiled_eager",
        title="A per-module profile ran the compiled model eagerly",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="info: a caveat about what the profile measured.",
        meaning="The model has torch.compile'd parts, and the per-module profile ran them "
                "eagerly (its hooks fire only in eager code): the op and module times are "
                "the eager model's, not the compiled one's.",
        criterion="A compiled module (an OptimizedModule or a compiled forward) among the "
                  "model's modules while the profile's per-module hooks were on.",
        fix="to profile the compiled code itself (its kernels and phases, no per-module "
            "times, which need hooks), pass by_module=False.",
        example="the model's compiled parts (<root>) ran eagerly while the per-module "
                "profile was open: ...",
    ),
    Entry(
        code="profiling.comm",
        title="Communication per step",
        subject=Subject.LOOP,
        levels=INFO,
        severity="info: the step waits for communication less than 30% of its time.",
        meaning="How long the collectives of DDP (all-reduce) or FSDP2 (all-gather, "
                "reduce-scatter) take per step, how much of it overlaps computation, and "
                "how long the step waits for it.",
        criterion="Collective ops in the profiled steps, and the part of their time not "
                  "covered by computation (exposed), over the profiled steps' mean wall "
                  "time, at or below ProfileThresholds.comm_exposed_high = 0.3.",
        example="communication takes 1.2 ms per step, 80% of it hidden behind compute; the "
                "step waits 0.24 ms of its 5.1 ms mean for it (all_reduce 2× 1.2 ms).",
    ),
    Entry(
        code="profiling.comm_exposed",
        title="The step waits for communication",
        subject=Subject.LOOP,
        levels=WARNING,
        severity="warning: the step waits for communication more than 30% of its time.",
        meaning="A large share of each step waits for collectives that computation does "
                "not hide: a rank slower than the others (the rest wait for it), too little "
                "compute per step, or many small collectives.",
        criterion="Exposed communication (collective time not covered by computation) over "
                  "the profiled steps' mean wall time above "
                  "ProfileThresholds.comm_exposed_high = 0.3.",
        fix="if one rank is slower the others wait for it (profiling.straggler names it); "
            "otherwise give each step more compute (a larger batch, gradient accumulation "
            "under no_sync) or fewer, larger collectives (DDP bucket_cap_mb).",
        fixes={"lightning": "DDPStrategy(bucket_cap_mb=...), or a larger batch with "
                            "accumulate_grad_batches.",
               "hf": "TrainingArguments(ddp_bucket_cap_mb=..., "
                     "gradient_accumulation_steps=...)."},
        example="the step waits 2.1 ms of its 4.0 ms mean (52%) for communication (2.5 ms "
                "per step, 16% of it hidden behind compute; all_reduce 1× 2.5 ms).",
    ),
    Entry(
        code="profiling.straggler",
        title="One rank is slower than the others",
        subject=Subject.LOOP,
        levels=INFO_WARNING,
        severity="warning where the gap is beyond the noise with confidence (or at least 2× "
                 "in every step); info ('may be') over too few steps to tell a small gap "
                 "from noise; nothing where the interval reaches 1.",
        meaning="Collectives make every rank wait for the slowest, so step times come out "
                "alike; what differs is each rank's own work (step time less the "
                "communication it waited for). One rank doing more holds every other rank "
                "back at each collective.",
        criterion="The rank whose mean own work exceeds the median of the others' by "
                  "ProfileThresholds.straggler_ratio = 1.3, where the interval of its "
                  "per-step own work over the median other rank's "
                  "(torchscope._timing.compare) lies above 1; a warning where that "
                  "interval's coverage is at least 0.85 or its low end at least 2.",
        fix="balance the ranks: the same batch size and sequence lengths on every rank "
            "(DistributedSampler), no extra work on one rank inside the step (logging, "
            "evaluation, checkpointing on rank 0), the same device and CPU threads per "
            "rank.",
        example="rank 1 is a straggler: its own work takes 2.10× the other ranks' (8.4 ms "
                "vs 4.0 ms per step); the others wait for it in communication (up to 4.3 ms "
                "per step).",
        # The others' exposed communication is their wait for it.
        explains=("profiling.comm_exposed",),
    ),
)
