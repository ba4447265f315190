"""The doctor on several ranks: `torchscope doctor TARGET --nproc N --strategy ddp|fsdp2`.

`launch` starts N ranks with torch's own elastic launcher (what `torchrun` runs), on this
machine; `run_rank` is what each rank does, and what a rank started by a plain `torchrun ...
-m torchscope doctor` does too:

1. join the process group (from the launcher's environment), with a timeout on every
   collective;
2. build the TARGET, wrap it (`DistributedDataParallel`, or `fully_shard` on each repeated
   block, else each child, that holds parameters and ties none, and on the root), and take
   its own rows of the example batch (rows r, r + N, ..., as `DistributedSampler` hands
   them out);
3. run the doctor's sections on that step (compile is left out: its modes run in child
   processes outside the process group; the memory section plans no checkpointing);
4. send its records to rank 0 (one gather), which adds the "ranks" section and writes the
   report.

A rank that raises writes its one-line error where the launcher finds it; the launcher stops
every other rank (no orphans) and `launch` raises `DistributedError` naming the rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchscope._process import seeded
from torchscope.distributed.comm import (
    TIMEOUT_ENV,
    DistributedError,
    RankLostError,
    all_reduce_sum,
    comm_device,
)
from torchscope.distributed.ranked import gather, rank_list
from torchscope.distributed.world import world
from torchscope.doctor.ranks import RankRecords, RanksRecord, ranks_outcome
from torchscope.doctor.runner import DoctorReport, doctor_step, run_doctor
from torchscope.doctor.section import DoctorOptions, Section
from torchscope.doctor.sections import MemorySection, registered_sections
from torchscope.errors import describe
from torchscope.grads import GradFlow
from torchscope.hooks.tree import iter_tensors
from torchscope.memory import MemoryReport, analyze_memory, rank_bytes
from torchscope.memory.checkpoint import default_blocks
from torchscope.models.target import ModelInputs, load_inputs, load_target
from torchscope.profiling import ProfileResult
from torchscope.report.document import SectionOutcome
from torchscope.report.html import write_report

__all__ = [
    "BACKENDS",
    "DistributedJob",
    "check_request",
    "launch",
    "rank_inputs",
    "run_rank",
    "under_torchrun",
    "unused_anywhere",
    "wrap_model",
]

BACKENDS: tuple[str, ...] = ("gloo", "nccl")
PARALLEL: tuple[str, ...] = ("ddp", "fsdp2")
#: Sections a distributed doctor leaves out, and why (the report's note).
LEFT_OUT = {"compile": "not run on ranks: each compile mode runs in a child process outside "
                       "the process group"}


@dataclass(frozen=True)
class DistributedJob:
    """What every rank runs (sent to each rank process).

    Attributes:
        target: the TARGET (None: tiny-cnn).
        specs: `--input` SPECs.
        inputs_fn: `--inputs file.py:fn`.
        strategy: `ddp` or `fsdp2`.
        backend: `gloo` or `nccl`.
        options: the doctor's options (the device is set per rank).
        out: the folder rank 0 writes report.html and report.json to; None writes nothing.
        timeout_s: every collective's timeout, torch's own (DDP, FSDP2) and torchscope's.
    """

    target: str | None
    specs: tuple[str, ...]
    inputs_fn: str | None
    strategy: str
    backend: str
    options: DoctorOptions
    out: str | None = None
    timeout_s: float = 120.0


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any elastic launcher): its rank is set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def check_request(nproc: int, strategy: str, backend: str) -> None:
    """Refuse, before any work, what cannot run on this machine.

    Raises:
        DistributedError: fewer than 1 rank, an unknown strategy or backend, NCCL without a
            GPU, or more NCCL ranks than GPUs.
    """
    if nproc < 1:
        raise DistributedError(f"--nproc {nproc} starts no rank.", fix="pass --nproc 2 or more.")
    if strategy not in PARALLEL:
        raise DistributedError(f"--strategy {strategy!r} is not one of {', '.join(PARALLEL)}.",
                               fix="pass --strategy ddp or --strategy fsdp2.")
    if backend not in BACKENDS:
        raise DistributedError(f"--backend {backend!r} is not one of {', '.join(BACKENDS)}.",
                               fix="pass --backend gloo (CPU) or nccl (one GPU per rank).")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise DistributedError("--backend nccl needs CUDA GPUs, and torch sees none.",
                                   fix="use --backend gloo to run the ranks on the CPU.")
        if nproc > gpus:
            raise DistributedError(
                f"--nproc {nproc} asks for {nproc} NCCL ranks, but NCCL needs a GPU per rank "
                f"and torch sees {gpus}.",
                fix=f"pass --nproc {gpus} or fewer, or --backend gloo.")


def rank_inputs(inputs: ModelInputs, rank: int, world_size: int) -> ModelInputs:
    """This rank's rows of the example batch: rows `rank`, `rank + world_size`, ... of every
    tensor whose first dimension is the batch's (the first tensor's); others stay whole.

    Raises:
        DistributedError: the batch has fewer rows than there are ranks.
    """
    tensors = [t for _, t in iter_tensors((inputs.args, dict(inputs.kwargs))) if t.dim() > 0]
    if not tensors:
        return inputs
    n = tensors[0].shape[0]
    if n < world_size:
        raise DistributedError(
            f"the example batch has {n} row(s), fewer than the {world_size} ranks that share "
            "it.", fix=f"pass --input with a batch of at least {world_size} rows.")

    def part(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
            return v[rank::world_size]
        return v

    return ModelInputs(tuple(part(a) for a in inputs.args),
                       {k: part(v) for k, v in inputs.kwargs.items()})


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one before the root, as its recipe shards each
    transformer layer: the model's repeated blocks (those activation checkpointing picks),
    else its children. Only those holding parameters, and none that shares a parameter with
    the rest of the model: a tied weight (GPT-2's `lm_head` is `wte`) must stay in one
    group, so it stays in the root's."""
    blocks = default_blocks(model)
    named = dict(model.named_modules())
    units = [named[n] for n in blocks.names] if blocks is not None else list(model.children())
    chosen = []
    for unit in units:
        own = {id(p) for p in unit.parameters()}
        inside = {id(m) for m in unit.modules()}
        elsewhere = {id(p) for m in model.modules() if id(m) not in inside
                     for p in m.parameters(recurse=False)}
        if own and not own & elsewhere:
            chosen.append(unit)
    return chosen


def wrap_model(model: nn.Module, strategy: str, device: torch.device, *,
               find_unused: bool = False) -> nn.Module:
    """The model as the strategy trains it: `DistributedDataParallel(model)` (with
    `find_unused_parameters=find_unused`), or the model with `fully_shard` applied to each
    of `shard_units(model)` and then to the root (a one-dimensional mesh over every
    rank)."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids,
                                       find_unused_parameters=find_unused)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world().world_size,))
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unused_anywhere(model: nn.Module, inputs: ModelInputs, options: DoctorOptions) -> bool:
    """Whether a parameter that requires grad gets no gradient in the doctor's step on some
    rank. DDP must then look for them every step (`find_unused_parameters=True`): without
    it its reducer waits for their gradients and raises at the next step ("Expected to
    have finished reduction in the prior iteration"), so every section after the first
    failed. One step of the model on this rank's rows, before it is wrapped, the model
    given back as it was; one all_reduce of the count, on every rank. A step that raises
    counts none here: the sections run it again, and each says how it failed."""
    missing = 0
    try:
        step = doctor_step(model, inputs, options)
        with seeded(options.seed), step.preserved(clear_grads=True):
            step.forward_backward()
            missing = sum(p.requires_grad and p.grad is None for p in model.parameters())
    except Exception:  # the sections run the step again and report how it failed
        missing = 0
    return bool(all_reduce_sum(torch.tensor([float(missing)], device=comm_device()),
                               what="the doctor's unused-parameter count").item())


class _RankMemorySection(MemorySection):
    """The memory section on a rank: the step's memory without a checkpoint plan (planning
    rewrites the model's forward, which DDP's and FSDP2's hooks wrap)."""

    def run(self, step: Any, options: DoctorOptions) -> MemoryReport:
        return analyze_memory(step, checkpoint="none", repeats=1)


def _sections(options: DoctorOptions) -> list[Section[Any]]:
    out: list[Section[Any]] = []
    for s in registered_sections():
        if s.name in LEFT_OUT:
            continue
        out.append(_RankMemorySection() if s.name == "memory" else s)
    return out


def _record(report: DoctorReport, name: str, kind: type) -> Any:
    try:
        o = report.outcome(name)
    except KeyError:
        return None
    return o.record if o.status == "ok" and isinstance(o.record, kind) else None


def run_rank(job: DistributedJob) -> DoctorReport | None:
    """Run the doctor on this rank and join every rank's records on rank 0 (see the module
    docstring). Joins the process group from the launcher's environment unless one exists.

    Returns:
        On rank 0 the report with its "ranks" section (written to `job.out` when set); None
        on every other rank.

    Raises:
        DistributedError: the batch cannot be shared out, or a collective timed out.
        TorchscopeError: the TARGET or its inputs cannot be loaded, or the model raised.
    """
    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        dist.init_process_group(job.backend, timeout=timedelta(seconds=job.timeout_s))
        created = True
    try:
        w = world()
        if job.backend == "nccl":
            device = torch.device("cuda", w.local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            # Ranks share the machine's cores, as torchrun's OMP_NUM_THREADS=1 intends.
            local = int(os.environ.get("LOCAL_WORLD_SIZE", w.world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
        loaded = load_target(job.target)
        inputs = rank_inputs(load_inputs(loaded, job.specs, job.inputs_fn), w.rank,
                             w.world_size).to(device)
        model = loaded.model.to(device)
        options = replace(job.options, device=str(device))
        unused = job.strategy == "ddp" and unused_anywhere(model, inputs, options)
        wrapped = wrap_model(model, job.strategy, device, find_unused=unused)
        t0 = time.perf_counter()
        report = run_doctor(wrapped, inputs, options=options, sections=_sections(options),
                            name=loaded.name)
        mine = RankRecords(
            rank=w.rank, profile=_record(report, "profile", ProfileResult),
            grads=_record(report, "gradients", GradFlow),
            memory=_record(report, "memory", MemoryReport), bytes=rank_bytes(wrapped),
            loss=None if report.step is None else report.step.loss_value,
            findings=tuple(f for o in report.outcomes for f in o.findings))
        joined = gather(mine)
        if joined is None:
            return None
        record = RanksRecord(w.world_size, job.strategy, str(w.backend), joined.results)
        env = {**report.environment, "world_size": w.world_size, "strategy": job.strategy,
               "backend": str(w.backend)}
        if job.strategy == "ddp":
            env["find_unused_parameters"] = unused
        left_out = tuple(SectionOutcome(name=s.name, title=s.title, status="skipped",
                                        note=LEFT_OUT[s.name], capability=s.capability,
                                        renderer=s)
                         for s in registered_sections() if s.name in LEFT_OUT)
        full = replace(report, outcomes=(*report.outcomes, *left_out,
                                         ranks_outcome(record, time.perf_counter() - t0)),
                       environment=env,
                       target=replace(report.target, model_class=type(model).__name__))
        if job.out is not None:
            write_report(full, job.out)
        return full
    finally:
        if created:
            # Let gloo's worker threads finish releasing the last collectives (they need
            # the GIL for that) before the group is torn down.
            time.sleep(0.05)
            dist.destroy_process_group()


_RESULT = "report.pkl"


def _rank_entry(job: DistributedJob, errors: str) -> None:
    """What each launched rank runs: `run_rank`, its one-line error saved for the launcher
    when it raises. Rank 0 saves its report (pickled) next to the errors folder.

    The report travels by file, not as the launcher's return value: torch can abort a
    process at interpreter exit (a gloo worker thread releasing a finished collective while
    Python shuts down), which the launcher would count as a failed rank even though every
    rank had finished its work.
    """
    os.environ[TIMEOUT_ENV] = str(job.timeout_s)
    rank = int(os.environ.get("RANK", "0"))
    try:
        report = run_rank(job)
    except BaseException as exc:
        Path(errors, f"rank{rank}.txt").write_text(
            f"{'lost' if _lost_peer(exc) else 'raised'}\t{describe(exc)}")
        Path(errors, f"rank{rank}.tb").write_text("".join(traceback.format_exception(exc)))
        raise
    if report is not None:
        done = Path(errors).parent / _RESULT
        tmp = done.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(_portable(report)))
        tmp.replace(done)  # whole or absent


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _portable(report: DoctorReport) -> DoctorReport:
    """The report as the launcher process receives it: a record that cannot be pickled
    (the activation capture keeps weak references) or an exception that cannot be is left
    out; rank 0 has written report.html and report.json from the whole report already."""
    outcomes = tuple(replace(o, record=o.record if _picklable(o.record) else None,
                             error=_with_traceback(o.error))
                     for o in report.outcomes)
    return replace(report, outcomes=outcomes)


class RankTracebackError(DistributedError):
    """Where a rank's exception came from, as text: the cause of the error the launcher
    raises for a rank that raised, so that `--debug` prints the rank's own traceback."""


def _with_traceback(error: BaseException | None) -> BaseException | None:
    """`error` ready to leave the rank, or None when it cannot be pickled. A traceback does
    not survive pickling: its text goes along as `error.rank_traceback` (the instance's
    own attributes do), which `--debug` prints."""
    if error is None or not _picklable(error):
        return None
    if error.__traceback__ is not None and not hasattr(error, "rank_traceback"):
        error.rank_traceback = "".join(traceback.format_exception(error))  # type: ignore[attr-defined]
    return error


def _lost_peer(exc: BaseException) -> bool:
    """The rank failed because another one raised, hung or left (a torchscope collective
    that timed out, or gloo's connection closed by a peer that had died): not the cause."""
    text = str(exc)
    return isinstance(exc, RankLostError) or "closed by peer" in text or \
        "Connection reset by peer" in text


def _failure(failures: dict[int, Any], errors: Path) -> DistributedError:
    """One error for a failed launch: the first rank that raised (not one that only lost
    its peers), with its own message."""
    found: list[tuple[int, str, str]] = []
    for f in sorted(errors.glob("rank*.txt")):
        kind, _, text = f.read_text().partition("\t")
        found.append((int(f.stem[4:]), kind, text))
    root = [x for x in found if x[1] == "raised"] or found
    if root:
        ranks = [r for r, _, _ in root]
        error = DistributedError(f"{rank_list(ranks[:1])} raised {root[0][2]}",
                                 fix="rerun without --nproc to debug on one process, or with "
                                 "--debug for that rank's traceback.")
        tb = errors / f"rank{ranks[0]}.tb"
        if tb.exists():
            error.__cause__ = RankTracebackError(f"rank {ranks[0]}: {tb.read_text()}")
        return error
    codes = ", ".join(f"rank {f.local_rank}: exit code {f.exitcode}"
                      for f in sorted(failures.values(), key=lambda f: f.local_rank))
    return DistributedError(f"a rank died without an error ({codes or 'no detail'}).",
                            fix="rerun with --debug; a negative exit code is the signal "
                            "that killed it (e.g. -9: out of memory).")


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """The elastic launcher logs every start and failure (with tracebacks) to stderr; the
    doctor reports a failure in one line instead. Its loggers' levels come back on exit."""
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic",
                                              "torch.distributed.launcher",
                                              "torch.multiprocessing")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def launch(job: DistributedJob, nproc: int) -> DoctorReport:
    """Run `run_rank` on `nproc` ranks on this machine with torch's elastic launcher and
    return rank 0's report (also written to `job.out`).

    Every rank's output goes to log files in a temporary folder; a rank that raises stops
    the others (the launcher terminates them), so no process is left behind.

    Raises:
        DistributedError: the request cannot run here (see `check_request`), or a rank
            raised (the message names it and says what it raised).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_request(nproc, job.strategy, job.backend)
    with tempfile.TemporaryDirectory(prefix="torchscope-ranks-") as tmp:
        errors = Path(tmp, "errors")
        errors.mkdir()
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc,
            run_id=f"torchscope-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
            rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
            start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=str(Path(tmp, "logs")), redirects=Std.ALL))
        failures: dict[int, Any] = {}
        try:
            with _quiet_launcher():
                elastic_launch(config, _rank_entry)(job, str(errors))
        except ChildFailedError as exc:
            failures = dict(exc.failures)
        done = Path(tmp, _RESULT)
        if any(errors.iterdir()) or not done.exists():
            raise _failure(failures, errors)
        # A rank may still have died at interpreter exit, after every rank finished: the
        # report is whole, so it stands.
        report: DoctorReport = pickle.loads(done.read_bytes())
    return report
