"""torchscope's own communication: a few collectives, each waited on with a timeout.

torchscope communicates only between steps (once per sampled step, and when a result is
gathered), never inside a hook, and always on every rank in the same order, as any
collective must be. Each collective is started asynchronously and waited on with a
timeout, so a rank that raised, hung or left turns into a `DistributedError` on the others
instead of a hang. A rank that fails where torchscope sees it (a doctor's rank) posts what
it raised in the process group's store (`post_failure`), and a collective that fails on
another rank because it left names it. Tensors travel on the device the group's backend
needs: CPU for gloo, the current CUDA device for NCCL.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.profiler import record_function

from torchscope.distributed.world import world
from torchscope.errors import TorchscopeError, describe

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RANGE",
    "TIMEOUT_ENV",
    "DistributedError",
    "PostedFailure",
    "all_gather_tensor",
    "all_gather_tensor_later",
    "all_reduce_sum",
    "comm_device",
    "exit_status",
    "failure_line",
    "first_failure",
    "gather_objects",
    "post_failure",
    "posted_failures",
    "rank_list",
    "timeout_s",
]

class DistributedError(TorchscopeError):
    """A distributed run went wrong: a collective timed out, a rank raised, or the launch
    request cannot work on this machine (NCCL without GPUs, more ranks than devices)."""


class RankLostError(DistributedError):
    """A collective of this rank failed because another rank raised, hung or left: a
    consequence, not the cause (the launcher reports the rank that raised first)."""


#: How long a torchscope collective waits for the other ranks before it gives up, unless
#: the environment variable `TORCHSCOPE_TIMEOUT_S` says otherwise (read at each call).
DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "TORCHSCOPE_TIMEOUT_S"


def timeout_s(given: float | None = None) -> float:
    """The timeout of a collective: `given`, else `TORCHSCOPE_TIMEOUT_S`, else
    `DEFAULT_TIMEOUT_S`.

    Raises:
        DistributedError: `TORCHSCOPE_TIMEOUT_S` is not a positive number.
    """
    if given is not None:
        return float(given)
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds.",
                               fix=f"set {TIMEOUT_ENV} to a positive number (e.g. 120), or "
                               "unset it.")
    return value


def comm_device(group: Any = None) -> torch.device:
    """Where tensors for a collective on `group` must live: the current CUDA device for an
    NCCL group, else the CPU."""
    import torch.distributed as dist

    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# The tensors of torchscope's last collectives, kept referenced from Python for a while.
# Gloo's worker thread drops its hold on a finished collective's tensors after the caller
# has been told it is done; if Python had already dropped them by then, that thread
# must take the GIL to free them, and it deadlocks against `destroy_process_group` (which
# joins that thread while holding the GIL). Kept here, Python frees them, on its own thread.
_KEEP: list[torch.Tensor] = []


def _hold(tensors: list[torch.Tensor]) -> None:
    """Keep `tensors` referenced, with those of the last few collectives before them (a
    collective waited for a step late finishes after others that started after it)."""
    _KEEP.extend(tensors)
    del _KEEP[:-8]


# Where a rank posts what it raised, in the process group's store, for the others to name it.
_FAILURE_KEY = "torchscope/failure/"


def rank_list(ranks: Sequence[int]) -> str:
    """`rank 1`, `ranks 0, 2`."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def failure_line(ranks: int | Sequence[int], how: str, *, error: str = "",
                 module: str | None = None, part: str | None = None,
                 code: int | None = None) -> str:
    """How a failed rank is said, the same in every torchscope message (the launcher's,
    a torchrun rank's, a collective's that lost it):

    - `raised`: "rank 1 raised ValueError: bad batch in head's forward (during the
      activations section)" (`error` is "Type: message", `module` the module whose forward
      raised);
    - `died`: "rank 1 died with exit code 3 in the activations section" (`code`: the exit
      status, negative for the signal that ended it);
    - `hung`: "rank 1 hung", "ranks 1, 2 hung".
    """
    who = rank_list([ranks] if isinstance(ranks, int) else list(ranks))
    if how == "hung":
        return f"{who} hung"
    if how == "died":
        if code is None:
            raise ValueError("a rank that died has an exit code")
        return f"{who} died {exit_status(code)}" + (f" in {part}" if part else "")
    if how != "raised":
        raise ValueError(f"a rank fails by raising, dying or hanging, not {how!r}")
    return (f"{who} raised {error}" + (f" in {module}'s forward" if module else "") +
            (f" (during {part})" if part else ""))


def exit_status(code: int) -> str:
    """How a process ended, as messages say it: `with exit code 3`, or `from signal 6
    (SIGABRT)` for a negative status."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"from signal {-code} ({name})"
    return f"with exit code {code}"


@dataclass(frozen=True)
class PostedFailure:
    """What a rank posted with `post_failure`.

    Attributes:
        rank: the rank that posted it.
        error: `Type: message`.
        module: the module whose forward raised it, or None.
        part: the part of the run it was in, or None.
        time: when it was posted (`time.time()`).
        victim: it was a consequence (the rank was interrupted, or lost another rank), not
            a failure of its own.
    """

    rank: int
    error: str
    module: str | None = None
    part: str | None = None
    time: float = math.inf
    victim: bool = False

    def line(self) -> str:
        """`failure_line` of this failure: "rank k raised X ..."."""
        return failure_line(self.rank, "raised", error=self.error, module=self.module,
                            part=self.part)


def first_failure(posted: Iterable[PostedFailure]) -> PostedFailure | None:
    """The failure to blame: a rank's own before a victim's (interrupted, or lost another
    rank), then the first posted, then the lowest rank; None when none was posted."""
    return min(posted, key=lambda f: (f.victim, f.time, f.rank), default=None)


@contextlib.contextmanager
def _quick_store(seconds: float = 2.0) -> Iterator[Any]:
    """A client of its own to the default group's store with a short timeout, or None: a
    store whose host has died must not hold a failing rank for the store's 5 minutes. The
    shared store (the user's code and torch's own threads use it too) keeps its timeout.

    For a TCP store, a new connection made with the short timeout (a clone would connect
    with the shared store's timeout, and retry a dead host that long); its keys are the
    bare ones, so `_failure_key` names the elastic restart. Any other store (a file, a
    hash in memory) has no host to lose: a clone (`Store.clone`) with the short timeout.
    """
    import torch.distributed as dist

    store: Any = None
    if dist.is_initialized():
        # A store without either (one written in Python), or a host already gone: none.
        with contextlib.suppress(Exception):
            from torch.distributed.distributed_c10d import _get_default_store

            limit = timedelta(seconds=seconds)
            shared: Any = _get_default_store()  # Any: torch's stubs lack clone, timeout
            base = getattr(shared, "_underlying_non_prefix_store", shared)
            if isinstance(base, dist.TCPStore):  # type: ignore[attr-defined]
                store = dist.TCPStore(  # type: ignore[attr-defined]
                    base.host, base.port, is_master=False, timeout=limit,
                    wait_for_workers=False, use_libuv=bool(getattr(base, "libuvBackend", True)))
            else:
                store = shared.clone()
                store.set_timeout(limit)
    yield store


def _failure_key(rank: int) -> str:
    # torchrun's own keys carry the restart (`/worker/attempt_N/`): a failure posted before
    # an elastic restart must not name a rank of the next attempt.
    return f"{_FAILURE_KEY}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def post_failure(error: str, *, module: str | None = None, part: str | None = None,
                 victim: bool = False) -> None:
    """Tell the other ranks what this rank raised (`error`: `Type: message`, with the module
    whose forward raised it and the part of the run), through the process group's store,
    so that a collective of theirs that fails because this rank left names it
    (`posted_failures`). `victim`: the rank only stopped because of another one. Best
    effort: nothing happens without a reachable store."""
    import torch.distributed as dist

    with _quick_store() as store, contextlib.suppress(Exception):
        if store is not None:
            store.set(_failure_key(dist.get_rank()), json.dumps({
                "error": error, "module": module, "part": part, "time": time.time(),
                "victim": victim}))


def posted_failures() -> dict[int, PostedFailure]:
    """What the other ranks posted with `post_failure`, by rank (empty when none did, or
    without a reachable store)."""
    import torch.distributed as dist

    out: dict[int, PostedFailure] = {}
    with _quick_store() as store, contextlib.suppress(Exception):
        if store is not None:
            me = dist.get_rank()
            for r in range(dist.get_world_size()):
                key = _failure_key(r)
                if r != me and store.check([key]):
                    raw = bytes(store.get(key)).decode(errors="replace")
                    try:  # one unreadable entry costs only its own rank's
                        d = json.loads(raw)
                        out[r] = PostedFailure(r, str(d["error"]), d.get("module"),
                                               d.get("part"), float(d.get("time", math.inf)),
                                               bool(d.get("victim", False)))
                    except (ValueError, KeyError, TypeError, AttributeError):
                        continue
    return out


#: The profiler range every torchscope collective is issued in: a profile of the user's
#: step tells torchscope's own communication from the step's (`torchscope.profiling.comm`).
RANGE = "torchscope::collective"


def _run(start: Callable[[], Any], tensors: list[torch.Tensor], what: str,
         seconds: float | None) -> None:
    """Issue a collective (`start()` returns its work) inside `RANGE`, wait for it (see
    `_wait`), then hold `tensors` until the next collective."""
    with record_function(RANGE):
        work = start()
    _wait(work, what, seconds)
    _hold(tensors)


def _wait(work: Any, what: str, seconds: float | None) -> None:
    """Wait for `work`; a failure says whether a peer went away (the collective failed at
    once: gloo's connection closed) or did not come (the timeout ran out)."""
    limit = timeout_s(seconds)
    t0 = time.monotonic()
    try:
        done = work.wait(timeout=timedelta(seconds=limit))
    except RuntimeError as exc:
        waited = time.monotonic() - t0
        first = first_failure(posted_failures().values())
        if first is not None:
            raise RankLostError(
                f"{first.line()}; {what} failed on {world().describe()} after "
                f"{waited:.1f} s as that rank left.",
                fix=f"fix what rank {first.rank} raised; this rank only lost it.") from exc
        if waited < 0.9 * limit:
            raise RankLostError(
                f"{what} failed on {world().describe()} after {waited:.1f} s "
                f"({describe(exc)}): another rank raised or left.",
                fix="look at the other ranks' errors; the first rank that failed is the "
                "cause.") from exc
        raise RankLostError(
            f"{what} did not complete on {world().describe()} within {limit:g} s "
            f"({describe(exc)}): another rank hung, or is slower than the timeout.",
            fix="look for code that runs on some ranks only; every rank must run the same "
            f"torchscope calls in the same order (raise {TIMEOUT_ENV} for slow steps)."
        ) from exc
    if done is False:
        raise RankLostError(f"{what} did not complete on {world().describe()} within "
                            f"{limit:g} s: another rank hung, or is slower than the timeout.",
                            fix="look at the other ranks' errors.")


def all_reduce_sum(t: torch.Tensor, *, group: Any = None,
                   timeout: float | None = None, what: str = "all_reduce") -> torch.Tensor:
    """Sum `t` over the ranks of `group` (default: every rank), in place; returns `t`.

    Raises:
        DistributedError: a rank did not join within the timeout (`timeout` seconds, default
            `timeout_s()`).
    """
    import torch.distributed as dist

    _run(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True), [t],
         what, timeout)
    return t


def all_gather_tensor(t: torch.Tensor, *, group: Any = None,
                      timeout: float | None = None, what: str = "all_gather"
                      ) -> torch.Tensor:
    """Every rank's `t` (the same shape everywhere), stacked: `(ranks in group, *t.shape)`.

    Raises:
        DistributedError: a rank did not join within the timeout (`timeout` seconds, default
            `timeout_s()`).
    """
    return all_gather_tensor_later(t, group=group, timeout=timeout, what=what)()


def all_gather_tensor_later(t: torch.Tensor, *, group: Any = None,
                            timeout: float | None = None, what: str = "all_gather"
                            ) -> Callable[[], torch.Tensor]:
    """`all_gather_tensor`, started now and waited for when the returned function is called
    (once; later calls give the same tensor). Every rank must start it in the same order as
    its other collectives; the wait may come later, e.g. a step later, when the ranks have
    long finished it: the loop does not stop at a collective of torchscope's own.

    Raises (from the returned function):
        DistributedError: a rank did not join within the timeout, counted from the wait.
    """
    import torch.distributed as dist

    n = dist.get_world_size(group)
    # The concatenated form (gloo accepts no other): (n * numel,) -> (n, *t.shape).
    out = torch.empty((n * t.numel(),), dtype=t.dtype, device=t.device)
    flat = t.contiguous().view(-1)
    # torch 2.13 renamed all_gather_into_tensor (kept, deprecated) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with record_function(RANGE):
        work = gather(out, flat, group=group, async_op=True)
    # Held from the start too: a watch closed by an exception never waits, and gloo's
    # worker thread must not be the one to free the tensors (see `_hold`).
    _hold([out, flat])
    waited: list[torch.Tensor] = []

    def wait() -> torch.Tensor:
        if not waited:
            _wait(work, what, timeout)
            _hold([out, flat])
            waited.append(out.view(n, *t.shape))
        return waited[0]

    return wait


def gather_objects(obj: Any, *, dst: int = 0, timeout: float | None = None,
                   what: str = "gather") -> list[Any] | None:
    """Every rank's picklable `obj`, in rank order, on rank `dst`; None on the others.

    Two collectives on the default group: the pickled sizes, then the bytes, padded to the
    largest. Records are small (numbers, names), so this costs milliseconds.

    Raises:
        DistributedError: a rank did not join within the timeout (`timeout` seconds, default
            `timeout_s()`).
    """
    import torch.distributed as dist

    device = comm_device()
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = all_gather_tensor(size, timeout=timeout, what=f"{what} (sizes)").view(-1)
    lengths = [int(s) for s in sizes.cpu().tolist()]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = all_gather_tensor(buf.to(device), timeout=timeout, what=what).cpu()
    if dist.get_rank() != dst:
        return None
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]
