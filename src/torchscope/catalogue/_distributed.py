"""The catalogue's entries of the rank-aware codes: those that distributed/, doctor/ranks.py
and grads/ranks.py emit (the straggler and communication codes are `profiling.*`, declared
with the profile's entries)."""

from __future__ import annotations

from torchscope.catalogue._base import ERROR, INFO
from torchscope.findings import Entry, Subject

ENTRIES: tuple[Entry, ...] = (
    Entry(
        code="grads.ranks_diverge",
        title="The replicas' gradients or weights differ between ranks",
        subject=Subject.LOOP,
        levels=ERROR,
        severity="always an error: each rank then steps its own copy of the weights, and "
                 "the replicas drift apart without any error from torch.",
        meaning="Data-parallel training keeps one copy of the weights per rank and relies on "
                "every rank applying the same averaged gradient. Where the synchronised "
                "gradients differ between ranks, or the weights of the DDP replicas already "
                "do, the ranks train different models; the loss rank 0 logs is no longer "
                "that of the model the others hold, and a checkpoint saved on rank 0 is one "
                "replica among several.",
        criterion="Every sampled step, each rank's per-parameter norm and element sum of "
                  ".grad as backward ends (DDP: after the all-reduce; FSDP2: parameters "
                  "held whole outside every fully_shard) are exchanged; a parameter whose "
                  "values differ between ranks by more than 1e-6 (relative), or that has a "
                  "gradient on some ranks only, is diverged. Under DDP each rank's weight "
                  "norms, in the same exchange and read before a watched loop's update, "
                  "must agree within 1e-6 (relative; the replicas are bitwise equal, but "
                  "two ranks may read norms with kernels that differ at float32's "
                  "rounding): a "
                  "gradient changed on one rank after the all-reduce shows at the next "
                  "sampled step, once the optimizer has stepped on it. A watch that joins "
                  "the ranks at its end (DDP) also compares each parameter's norm and "
                  "position-weighted sum as the watch ended, after the last update: a change "
                  "at the last step shows, and so does one that keeps the norm (a "
                  "zero-initialised weight stepped by -u on one rank and +u on another).",
        fix="make every parameter that requires grad take part in every step's loss on "
            "every rank (or pass find_unused_parameters=True to DDP); set requires_grad "
            "before wrapping; change .grad (scale, clip, zero) the same way on every rank.",
        example="the weights differ between the DDP replicas for 1 parameter(s), first "
                "head.weight (weight norm rank 0: 1.03812, rank 1: 1.03807) though their "
                "synchronised gradients agree: ...",
    ),
    Entry(
        code="grads.rank_skew",
        title="One rank's local gradient is far larger than another's",
        subject=Subject.DATA,
        levels=INFO,
        severity="always info: the averaged gradient is still correct, only noisier.",
        meaning="Under DDP each rank computes a gradient from its own rows before the "
                "all-reduce averages them. Local gradients of very different sizes usually "
                "mean the ranks see differently distributed data (an unshuffled sampler, "
                "sorted shards, different batch sizes), which makes the averaged gradient "
                "noisy.",
        criterion="DDP only: the largest over the smallest per-rank total norm of the local "
                  "gradients (read as each accumulates, before the all-reduce) at or above "
                  "SKEW_RATIO = 4.",
        fix="shuffle with DistributedSampler(shuffle=True) and give every rank the same "
            "batch size; per-rank norms this far apart make averaged gradients noisy.",
        fixes={"lightning": "let the Trainer add its DistributedSampler "
                            "(use_distributed_sampler=True) and keep shuffle=True."},
        example="rank 1's local gradient is 5.2× rank 0's before the all-reduce: the ranks "
                "see differently distributed data",
    ),
    Entry(
        code="memory.sharding",
        title="What FSDP2's sharding saves per rank",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info: a fact about the run's memory, not a fault.",
        meaning="FSDP2 keeps a shard of each parameter, gradient and optimizer state per "
                "rank instead of a whole copy: the saving against DDP, which holds the "
                "whole model state on every rank, grows with the number of ranks.",
        criterion="Bytes of the parameters, gradients and optimizer state rank 0 holds "
                  "(local shards of DTensors) against the same state held whole, as under "
                  "DDP (torchscope.memory.rank_bytes).",
        example="FSDP2 holds 1.2 MiB of model state per rank (parameters, gradients) against "
                "2.4 MiB under DDP: 2.00× less",
    ),
    Entry(
        code="memory.ddp_buckets",
        title="DDP's gradient buckets are a second copy of the gradients",
        subject=Subject.MODEL,
        levels=INFO,
        severity="always info: DDP's default, worth knowing when memory is tight.",
        meaning="Unless gradient_as_bucket_view=True, DDP all-reduces gradients in flat "
                "buckets of its own and copies them back: the buckets hold as many bytes as "
                "the gradients, on every rank.",
        criterion="Bytes of the DDP reducer's buckets on rank 0, when there are any.",
        fix="DistributedDataParallel(..., gradient_as_bucket_view=True) makes the "
            "gradients views of the buckets; FSDP2 (fully_shard) also shards the state.",
        fixes={"lightning": "DDPStrategy(gradient_as_bucket_view=True)."},
        example="DDP keeps 848 B of gradient buckets per rank, a second copy of the "
                "gradients (2.5 KiB of model state per rank in all)",
    ),
    Entry(
        code="ranks.uneven_split",
        title="The batch splits unevenly over the ranks",
        subject=Subject.DATA,
        levels=INFO,
        severity="always info: training still works, with rows weighted unequally.",
        meaning="DDP and FSDP2 average the ranks' gradients, and each rank's loss is the "
                "mean over its own rows. When the ranks hold different numbers of rows, a "
                "row on a rank with fewer rows weighs more in the step than one on a rank "
                "with more: the step is not the mean over the batch that one process would "
                "take.",
        criterion="The ranks' rows of the example batch (rows r, r + N, ..., as "
                  "DistributedSampler hands them out) differ in number; each row on rank r "
                  "weighs 1 / (N × rows of rank r) against 1 / rows on one process.",
        fix="make the batch a multiple of the number of ranks (DistributedSampler pads the "
            "dataset; drop_last=True on the DataLoader drops a short last batch).",
        example="the batch of 7 rows splits 3/2/2 over 3 ranks: each of rank 0's rows "
                "weighs 1/9 of the step, each of rank 1's and rank 2's 1/6, where one "
                "process weighs every row 1/7",
    ),
)
