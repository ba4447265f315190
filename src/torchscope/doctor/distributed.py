"""The doctor on several ranks: `torchscope doctor TARGET --nproc N --strategy ddp|fsdp2`.

`launch` starts N rank processes on this machine, which meet through a file store; `run_rank`
is what each rank does, and what a rank started by a plain `torchrun ... -m torchscope doctor`
does too:

1. join the process group, with a timeout on every collective;
2. build the TARGET, check that every rank built the same model (one digest, all-gathered),
   wrap it (`DistributedDataParallel`, or `fully_shard` on each repeated block, else each
   child, that holds parameters and ties none, and on the root), and take its own rows of
   the example batch (rows r, r + N, ..., as `DistributedSampler` hands them out);
3. run the doctor's sections on that step (compile is left out: its modes run in child
   processes outside the process group; the memory section plans no checkpointing); a
   section that fails ends the run on that rank;
4. send its records to rank 0 (one gather), which adds the "ranks" section and writes the
   report.

A rank that fails writes what it raised (type, message, the module whose forward raised it,
the part of the run, the time) to a file in the run folder and leaves; the launcher watches
those files and the ranks' exits, stops the other ranks at once, and raises one
`DistributedError` for the first real failure: "rank k raised X", "rank k died (signal or
exit code)", "rank k hung", or "the model differs between ranks". No report is written then.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchscope._process import die_with_parent, seeded, spawn, stop_all, stop_and_exit
from torchscope.distributed.comm import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    DistributedError,
    RankLostError,
    all_gather_tensor,
    all_reduce_sum,
    comm_device,
    exit_status,
    failure_line,
    first_failure,
    gather_objects,
    post_failure,
    posted_failures,
    rank_list,
    timeout_s,
)
from torchscope.distributed.ranked import gather
from torchscope.distributed.world import world
from torchscope.doctor.ranks import RankRecords, RanksRecord, ranks_outcome
from torchscope.doctor.runner import DoctorEvent, DoctorReport, doctor_step, run_doctor
from torchscope.doctor.section import DoctorOptions, Section
from torchscope.doctor.sections import MemorySection, registered_sections
from torchscope.errors import TorchscopeError
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
    "ModelMismatchError",
    "RankExit",
    "check_request",
    "check_same_model",
    "launch",
    "raised_in",
    "rank_failure",
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
        init_method: where the ranks meet (`file://...`: `launch`'s); None: the launcher's
            environment (`env://`, as torchrun sets it).
    """

    target: str | None
    specs: tuple[str, ...]
    inputs_fn: str | None
    strategy: str
    backend: str
    options: DoctorOptions
    out: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    init_method: str | None = None


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


@dataclass
class _RankState:
    """Where a rank is, for the launcher's message when it fails: the model it runs (to name
    the module a forward raised in) and the part of the run it is in."""

    model: nn.Module | None = None
    part: str = "start-up"
    on_part: Any = None  # Callable[[str], None] | None: told each part as it starts

    def enter(self, part: str) -> None:
        self.part = part
        if self.on_part is not None:
            self.on_part(part)


def model_signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter and buffer: what must be the same on every
    rank for DDP's and FSDP2's collectives to line up."""
    return [(n, tuple(t.shape), str(t.dtype))
            for n, t in (*model.named_parameters(), *model.named_buffers())]


def _digest(signature: list[tuple[str, tuple[int, ...], str]]) -> int:
    return int.from_bytes(hashlib.sha256(repr(signature).encode()).digest()[:7], "big")


def check_same_model(model: nn.Module) -> None:
    """Raise on every rank when the model differs between ranks (names, shapes or dtypes of
    its parameters and buffers), before any collective of DDP or FSDP2 could mismatch: FSDP2
    would abort a rank in gloo ("Received data size doesn't match"), DDP would compare
    shapes only. One all_gather of a 7-byte digest; the signatures travel only on a
    mismatch.

    Raises:
        ModelMismatchError: the ranks' models differ (rank 0's message says where).
    """
    mine = model_signature(model)
    digest = torch.tensor([_digest(mine)], dtype=torch.int64, device=comm_device())
    digests = all_gather_tensor(digest, what="the model check").view(-1).tolist()
    if len(set(digests)) == 1:
        return
    every = gather_objects(mine, what="the model signatures")
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    detail = ""
    if every is not None:  # rank 0 says where
        ref = {n: f"{tuple(s)} {d}" for n, s, d in every[0]}
        other = {n: f"{tuple(s)} {d}" for n, s, d in every[odd[0]]}
        name = next((n for n in [*ref, *other] if ref.get(n) != other.get(n)), None)
        if name is not None:
            detail = (f": {name} is {other.get(name, 'nothing')} on rank {odd[0]} and "
                      f"{ref.get(name, 'nothing')} on rank 0")
    raise ModelMismatchError(
        f"the model differs between ranks ({rank_list(odd)} against rank 0){detail}; "
        "DDP and FSDP2 need the same parameters and buffers on every rank.",
        fix="build the model the same way on every rank (no rank-dependent sizes, layers "
        "or dtypes).")


class ModelMismatchError(DistributedError):
    """The model differs between ranks: the collectives of DDP and FSDP2 cannot line up."""


def run_rank(job: DistributedJob) -> DoctorReport | None:
    """Run the doctor on this rank and join every rank's records on rank 0 (see the module
    docstring). Joins the process group from the launcher's environment unless one exists.

    A section that fails on a rank ends the run on that rank (its exception is raised
    here): the other ranks would wait for collectives it never joins, and a report of the
    ranks that went on would read as healthy.

    Returns:
        On rank 0 the report with its "ranks" section (written to `job.out` when set); None
        on every other rank.

    Raises:
        DistributedError: the batch cannot be shared out, the model differs between ranks,
            or a collective failed (another rank raised, hung or left).
        TorchscopeError: the TARGET or its inputs cannot be loaded, or the model raised.
    """
    import torch.distributed as dist

    state = _RankState()
    joins = not dist.is_initialized()  # the group is this call's to leave
    try:
        return _run_rank(job, state)
    except BaseException as exc:
        # Under a plain torchrun no launcher of torchscope's reads the ranks' failures:
        # the rank that failed posts its own, and one that only lost it names it.
        if not _lost_peer(exc):
            # A rank interrupted (torchrun's SIGTERM to the survivors of another's failure)
            # posts too, as a victim: blamed only when no rank posted a failure of its own.
            interrupted = isinstance(exc, KeyboardInterrupt)
            name, message = _first_line(exc)
            if interrupted:
                message = getattr(exc, "name", "") or message  # `Interrupted: SIGTERM`
            post_failure(f"{name}: {message}" if message else name,
                         module=raised_in(exc, state.model),
                         part=state.part, victim=interrupted)
            raise
        first = first_failure(posted_failures().values())
        if first is None:
            raise
        raise DistributedError(
            f"{first.line()}; rank {world().rank} stopped with it.",
            fix=f"fix what rank {first.rank} raised (rerun without torchrun to debug on one "
            "process); this rank only lost it.") from exc
    finally:
        if joins:  # after a success `_run_rank` has left it already
            _leave_group()


def _leave_group(wait_s: float = 5.0) -> None:
    """Destroy the default process group after a failure, without waiting on a peer: gloo's
    teardown waits for any collective still pending (one a peer never joined) until the
    group's timeout, so it runs on a thread of its own for at most `wait_s` seconds (the
    group is out of torch's registry at once; the thread finishes the rest). Its own
    errors are dropped: the rank's failure is the one to raise."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return

    def destroy() -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    leaving = threading.Thread(target=destroy, name="torchscope-leave-group", daemon=True)
    leaving.start()
    leaving.join(wait_s)


def _run_rank(job: DistributedJob, state: _RankState) -> DoctorReport | None:
    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        if job.init_method is not None:  # `launch`'s ranks meet through a file store
            dist.init_process_group(job.backend, init_method=job.init_method,
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=timedelta(seconds=job.timeout_s))
        else:
            dist.init_process_group(job.backend, timeout=timedelta(seconds=job.timeout_s))
        created = True
    w = world()
    if job.backend == "nccl":
        device = torch.device("cuda", w.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Ranks share the machine's cores, as torchrun's OMP_NUM_THREADS=1 intends.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", w.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    state.enter("loading the target")
    loaded = load_target(job.target)
    batch = load_inputs(loaded, job.specs, job.inputs_fn)
    inputs = rank_inputs(batch, w.rank, w.world_size).to(device)
    model = state.model = loaded.model.to(device)
    state.enter("the model check")
    check_same_model(model)
    options = replace(job.options, device=str(device))
    state.enter("the unused-parameter check")
    unused = job.strategy == "ddp" and unused_anywhere(model, inputs, options)
    wrapped = wrap_model(model, job.strategy, device, find_unused=unused)

    def on_event(event: DoctorEvent) -> None:
        if event.phase == "start":
            state.enter(f"the {event.section} section")
        elif event.outcome is not None and event.outcome.status == "failed" and \
                event.outcome.error is not None:
            raise event.outcome.error  # this rank cannot go on in step with the others

    t0 = time.perf_counter()
    state.enter("the doctor's first forward")
    report = run_doctor(wrapped, inputs, options=options, sections=_sections(options),
                        name=loaded.name, on_event=on_event)
    mine = RankRecords(
        rank=w.rank, profile=_record(report, "profile", ProfileResult),
        grads=_record(report, "gradients", GradFlow),
        memory=_record(report, "memory", MemoryReport), bytes=rank_bytes(wrapped),
        loss=None if report.step is None else report.step.loss_value,
        findings=tuple(f for o in report.outcomes for f in o.findings),
        rows=rows_of(inputs))
    state.enter("the gather of every rank's records")
    joined = gather(mine)
    state.enter("writing the report")
    full = None
    if joined is not None:
        record = RanksRecord(w.world_size, job.strategy, str(w.backend), joined.results,
                             batch_rows=rows_of(batch))
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
    # Torn down only after a run that went well: after a failure a peer may be gone, and
    # the teardown could wait for it.
    if created:
        # Let gloo's worker threads finish releasing the last collectives (they need
        # the GIL for that) before the group is torn down.
        time.sleep(0.05)
        dist.destroy_process_group()
    return full


def rows_of(inputs: ModelInputs) -> int | None:
    """The rows of a batch: the first dimension of its first tensor (None without one)."""
    tensors = [t for _, t in iter_tensors((inputs.args, dict(inputs.kwargs))) if t.dim() > 0]
    return int(tensors[0].shape[0]) if tensors else None


def raised_in(exc: BaseException, model: nn.Module | None) -> str | None:
    """The module of `model` whose forward raised `exc` (the innermost one on its traceback,
    or on the traceback of the exception it wraps), or None. `"<root>"` for the model."""
    if model is None:
        return None
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    seen: set[int] = set()
    found: str | None = None
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and found is None:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            me = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
            if me is not None and id(me) in names:
                found = names[id(me)]  # keep going: the innermost wins
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return found


_RESULT = "report.pkl"
_FAILURES = "failures"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # whole or absent


def _first_line(exc: BaseException) -> tuple[str, str]:
    """(type, message) of the exception a rank raised, in one line each: for a torchscope
    error that wraps the user's (the model raised), the user's own."""
    e = exc
    if isinstance(e, TorchscopeError) and e.__cause__ is not None and \
            not isinstance(e.__cause__, TorchscopeError):
        e = e.__cause__
    if isinstance(e, TorchscopeError):
        return type(e).__name__, " ".join(e.message.split())
    lines = str(e).strip().splitlines()
    return type(e).__name__, (lines[0] if lines else "")


def _rank_main(job_file: str, run: str) -> None:
    """What each rank of `launch` runs (in `python -c`): the doctor on this rank. It says
    what it is doing in `failures/rank<r>.part`; when it fails it writes what it raised,
    where, and when to `failures/rank<r>.json`, then leaves at once (its peers may be gone).
    Rank 0 saves its report (pickled) to `report.pkl`. Every rank leaves with `os._exit`,
    skipping interpreter teardown, where torch can abort a process that did all its work
    (a gloo worker thread releasing a finished collective while Python shuts down)."""
    # Linux: killed when the launcher dies, even by SIGKILL, so that no rank outlives it.
    die_with_parent(int(os.environ["TORCHSCOPE_LAUNCHER"]), signal.SIGKILL)
    # The launcher stops a rank with SIGTERM: its own children go with it (a kernel build
    # started here runs in a session of its own, out of the rank's process group).
    signal.signal(signal.SIGTERM, stop_and_exit)
    job: DistributedJob = pickle.loads(Path(job_file).read_bytes())
    os.environ[TIMEOUT_ENV] = str(job.timeout_s)
    rank = int(os.environ["RANK"])
    failures = Path(run, _FAILURES)
    state = _RankState(on_part=(failures / f"rank{rank}.part").write_text)
    code = 0
    try:
        report = _run_rank(job, state)
        if report is not None:
            done = Path(run, _RESULT)
            tmp = done.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(_portable(report)))
            tmp.replace(done)  # whole or absent
        (failures / f"rank{rank}.done").write_text("done")
    except BaseException as exc:  # every failure is the launcher's to report
        kind = "lost" if _lost_peer(exc) else \
            "differs" if isinstance(exc, ModelMismatchError) else "raised"
        name, message = _first_line(exc)
        _write_json(failures / f"rank{rank}.json", {
            "rank": rank, "kind": kind, "type": name, "message": message,
            "module": raised_in(exc, state.model), "part": state.part, "time": time.time(),
            "fix": exc.fix if isinstance(exc, TorchscopeError) else "",
            "traceback": "".join(traceback.format_exception(exc))})
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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


# What a rank's error says when a peer, not this rank, went wrong: gloo's words for a
# connection a dead peer closed, torchscope's and torch's timeouts.
_PEER_LOST = ("closed by peer", "Connection reset by peer", "Broken pipe",
              "Application timeout caused pair closure", "Timed out waiting",
              "timed out after", "NCCL communicator was aborted")


def _lost_peer(exc: BaseException) -> bool:
    """The rank failed because another one raised, hung or left (a torchscope collective
    that timed out, gloo's connection closed by a peer that had died, torch's own
    collective timeout): not the cause. The exception's causes are read too."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RankLostError) or any(p in str(e) for p in _PEER_LOST):
            return True
        e = e.__cause__ or e.__context__
    return False


# What a rank that died without a word wrote to its stderr, and what it means.
_DEATH_NOTES = (
    ("Received data size doesn't match", "the model differs between ranks (gloo received "
     "data of another size than it expected: \"Received data size doesn't match\")"),
    ("op.preamble.length <= op.nbytes", "the model differs between ranks (gloo received "
     "more data than it expected)"),
)


@dataclass(frozen=True)
class RankExit:
    """How a rank process of `launch` ended, as the launcher saw it.

    Attributes:
        rank: its rank.
        code: its exit status (negative: the signal that ended it), None while it runs.
        at: when the launcher saw it end (`time.time()`), None while it runs.
        killed: the launcher stopped it (a survivor of another rank's failure).
    """

    rank: int
    code: int | None
    at: float | None
    killed: bool = False


def rank_failure(exits: list[RankExit], run: Path) -> DistributedError | None:
    """The one error of a failed launch, or None when every rank did its work: the first
    real failure by time, never a rank that only lost its peers.

    - "rank k raised X": a rank's own exception (with the module whose forward raised it,
      and the part of the run it was in);
    - "the model differs between ranks": the model check (or gloo's size mismatch in the
      log of a rank that died);
    - "rank k died (signal or exit code)": a rank that ended without a word and before its
      work was done (one that died after it, a teardown abort, is no failure);
    - "rank k hung": another rank gave up waiting for it in a collective.
    """
    failures = run / _FAILURES
    said = {}
    for f in failures.glob("rank*.json"):
        data = json.loads(f.read_text())
        said[int(data["rank"])] = data
    done = {int(f.stem[4:]) for f in failures.glob("rank*.done")}

    def part(r: int) -> str:
        f = failures / f"rank{r}.part"
        return f.read_text() if f.exists() else "start-up"

    real: list[tuple[float, str, int]] = []
    for r, d in said.items():
        if d["kind"] in ("raised", "differs"):
            real.append((float(d["time"]), d["kind"], r))
    for e in exits:
        # Exit code 0 included: a rank that left with os._exit(0) before its work was
        # done died all the same (it read as "rank k hung").
        if e.code is not None and not e.killed and e.rank not in said and \
                e.rank not in done and e.at is not None:
            real.append((e.at, "died", e.rank))
    fix = "rerun without --nproc to debug on one process, or with --debug for that rank's " \
        "traceback."
    if real:
        _, kind, r = min(real)
        if kind == "differs":  # rank 0 says where the models differ
            r = min(r for _, k, r in real if k == "differs")
        if kind == "died":
            code = next(e.code for e in exits if e.rank == r)
            assert code is not None
            log = run / f"rank{r}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            note = next((n for needle, n in _DEATH_NOTES if needle in text), None)
            died = failure_line(r, "died", code=code, part=part(r))
            if note is not None:
                return ModelMismatchError(
                    f"{died}: {note}.",
                    fix="build the model the same way on every rank (no rank-dependent "
                    "sizes or layers), and give every rank inputs of the same shapes.")
            return DistributedError(
                f"{died}, without raising an error.",
                fix="rerun with --debug; a negative exit code is the signal that killed it "
                "(e.g. -9: out of memory), another one a call to exit() or os._exit() in "
                "the model's code.")
        d = said[r]
        error: DistributedError
        if kind == "differs":
            error = ModelMismatchError(d["message"], fix=d.get("fix") or "build the model "
                                       "the same way on every rank.")
        else:
            error = DistributedError(
                failure_line(r, "raised", error=f"{d['type']}: {d['message']}",
                             module=d.get("module"), part=d["part"]) + ".",
                fix=d.get("fix") or fix)
        error.__cause__ = RankTracebackError(f"rank {r}: {d['traceback']}")
        return error
    if said:  # only ranks that lost their peers: the others neither raised nor died
        waited = sorted(said)
        quiet = sorted(e.rank for e in exits if e.rank not in said and e.rank not in done)
        if quiet:
            first = said[waited[0]]
            return DistributedError(
                f"{failure_line(quiet, 'hung')}: {rank_list(waited)} gave up waiting for "
                f"{'it' if len(quiet) == 1 else 'them'} in a collective ({first['type']}: "
                f"{first['message']}); {rank_list(quiet[:1])} was in {part(quiet[0])}.",
                fix="look for code that runs on some ranks only (a rank-dependent branch, a "
                "print or barrier on rank 0) or a step far slower on one rank; raise "
                f"{TIMEOUT_ENV} for steps slower than the timeout.")
        d = said[waited[0]]
        return DistributedError(failure_line(waited[0], "raised",
                                             error=f"{d['type']}: {d['message']}",
                                             part=d["part"]) + ".", fix=fix)
    if any(e.code not in (None, 0) and e.rank not in done for e in exits):
        codes = ", ".join(f"rank {e.rank} {exit_status(e.code)}" for e in exits
                          if e.code not in (None, 0) and e.code is not None)
        return DistributedError(f"ranks were stopped ({codes}).", fix="rerun with --debug.")
    return None


def _rank_env(rank: int, nproc: int) -> dict[str, str]:
    # The ranks import torchscope and the TARGET's modules as this process does.
    path = [p for p in sys.path if p]
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
            "TORCHSCOPE_LAUNCHER": str(os.getpid())}


def _stop(procs: list[subprocess.Popen[bytes]], grace: float = 3.0) -> set[int]:
    """Stop every rank still running, each with its process group (SIGTERM to all, then
    SIGKILL to those left after `grace` seconds in all), and forget those that ended; the
    ranks it had to stop."""
    stopped = {r for r, p in enumerate(procs) if p.poll() is None}
    stop_all(procs, grace if stopped else None)
    return stopped


def launch(job: DistributedJob, nproc: int) -> DoctorReport:
    """Run `run_rank` on `nproc` ranks on this machine and return rank 0's report (also
    written to `job.out`).

    Each rank is a process of its own (its output in a log file of a temporary run
    folder); the ranks meet through a file store in that folder. The launcher watches
    their exits and the failure files they write: when one fails (raises, dies, or another
    gives up waiting for it), the others are stopped at once, and `launch` raises one
    error for the first real failure (see `rank_failure`). No process or folder is left
    behind, whatever happens, an interrupt included.

    Raises:
        DistributedError: the request cannot run here (see `check_request`), or a rank
            failed (the message names it and says how).
    """
    check_request(nproc, job.strategy, job.backend)
    if os.environ.get(TIMEOUT_ENV):
        job = replace(job, timeout_s=timeout_s())
    with tempfile.TemporaryDirectory(prefix="torchscope-ranks-") as tmp:
        run = Path(tmp)
        (run / _FAILURES).mkdir()
        job_file = run / "job.pkl"
        job_file.write_bytes(pickle.dumps(replace(job, init_method=f"file://{run / 'store'}")))
        code = ("from torchscope.doctor.distributed import _rank_main; "
                f"_rank_main({str(job_file)!r}, {str(run)!r})")
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for r in range(nproc):
                with open(run / f"rank{r}.log", "wb") as log:
                    # A session of its own (`_process.spawn`): registered, so that a signal
                    # to this process stops it too.
                    procs.append(spawn(
                        [sys.executable, "-c", code], env=_rank_env(r, nproc), stdout=log,
                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            exits = _watch(procs, run)
        finally:
            stopped = _stop(procs)
        exits = [replace(e, killed=e.killed or e.rank in stopped) for e in exits]
        error = rank_failure(exits, run)
        if error is not None:
            raise error
        done = run / _RESULT
        if not done.exists():
            raise DistributedError("rank 0 finished without a report.",
                                   fix="rerun with --debug.")
        report: DoctorReport = pickle.loads(done.read_bytes())
    return report


def _watch(procs: list[subprocess.Popen[bytes]], run: Path, poll: float = 0.05,
           settle: float = 0.5) -> list[RankExit]:
    """Wait for every rank; at the first sign of a failure (a rank's failure file, or a
    rank that ended, whatever its status, before its work was done) give the others
    `settle` seconds to say theirs, then stop them. How each rank ended."""
    failures = run / _FAILURES
    ended: dict[int, tuple[int, float]] = {}
    failed_at: float | None = None
    while True:
        for r, p in enumerate(procs):
            if r not in ended and (rc := p.poll()) is not None:
                ended[r] = (rc, time.time())
                if not (failures / f"rank{r}.done").exists() and failed_at is None:
                    failed_at = time.monotonic()
        if failed_at is None and any(failures.glob("rank*.json")):
            failed_at = time.monotonic()
        if len(ended) == len(procs):
            break
        if failed_at is not None and time.monotonic() - failed_at >= settle:
            break
        time.sleep(poll)
    return [RankExit(r, *ended[r]) if r in ended else RankExit(r, None, None)
            for r in range(len(procs))]
