"""Process-wide state that torchscope touches, always scoped: what it changes it puts back.

The environment (torch's lazy imports write to it: importing `torch._dynamo`, which the
profiler's first trace does, sets `TORCHINDUCTOR_CACHE_DIR`), Kineto's log level while a
profiler starts, and torch's random generators while a measurement draws from them. Every
public function that profiles, compiles or seeds goes through these context managers, so
that after it returns (or raises) the environment and the caller's random streams are as
they were.

And the child processes torchscope starts (`spawn`, `run`, `stop`): each in a process group
of its own, so that stopping one stops whatever it started (g++ under a compile included);
`child_of`, in such a child, ends it with the process that started it, however that ends.
`interruptible`, around the command line, turns SIGINT and SIGTERM
into `Interrupted` and stops every child still running; the signal handlers it replaced
are back when it exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = [
    "Interrupted",
    "child_of",
    "die_with_parent",
    "interrupted",
    "interruptible",
    "kept_environment",
    "kept_signals",
    "note_signal",
    "quiet_kineto",
    "run",
    "seeded",
    "spawn",
    "stop",
    "stop_all",
    "stop_and_exit",
    "stop_children",
]

#: The signals `interruptible` turns into `Interrupted`.
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)

_KINETO = "KINETO_LOG_LEVEL"


@contextlib.contextmanager
def kept_environment() -> Iterator[None]:
    """The process environment as it was on entry, again on exit (also on an exception).

    Variables set inside are removed, changed ones get their old value back. What torch
    derives from them (inductor's cache directory) it derives again when it needs it, so
    putting the environment back changes nothing but the environment.
    """
    env = dict(os.environ)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in env]:
            del os.environ[key]
        for key, value in env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def quiet_kineto() -> Iterator[None]:
    """Keep Kineto's `profiler_start`/`profiler_stop` lines off stderr while a profiler runs;
    the environment is kept (`kept_environment`).

    Kineto reads `KINETO_LOG_LEVEL` once, when the first profiler of the process starts, and
    prints those lines at level 5; only a higher level hides them. The variable is set to 6
    inside the block (unless the user chose a level other than 5) and restored on exit: a
    profiler started inside has read it by then.
    """
    with kept_environment():
        if os.environ.get(_KINETO) in (None, "", "5"):
            os.environ[_KINETO] = "6"
        yield


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Seed torch's CPU and CUDA generators inside; the caller's states come back on exit.

    Args:
        seed: the seed; None forks the states without reseeding (draws inside are not
            reproducible, but the caller's stream still continues as if nothing had run).
    """
    import torch

    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        if seed is not None:
            torch.manual_seed(seed)
        yield


# ---------------------------------------------------------------------- child processes
class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while `interruptible` was open. A `KeyboardInterrupt`, so
    that every clean-up written for Ctrl-C (hooks removed, child processes stopped,
    temporary folders removed) runs for SIGTERM too.

    Attributes:
        signum: the signal's number (the process exits with 128 + it).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def name(self) -> str:
        """The signal's name, e.g. `SIGTERM`."""
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"


@dataclass
class _Children:
    """Every child process started through `spawn` that has not been waited for, the
    thread that started it and the folder it works in (when `spawn` was given one);
    `closing` refuses new ones while `stop_children` runs.
    `spawning` is set while the main thread starts a child and registers it: a signal
    that comes then is kept in `deferred` and raised again once the child is registered."""

    # Reentrant: `stop_and_exit` takes it inside a signal handler, which may interrupt the
    # main thread while it holds it.
    lock: threading.RLock = field(default_factory=threading.RLock)
    live: dict[int, tuple[subprocess.Popen[Any], threading.Thread, Path | None]] = field(
        default_factory=dict)
    closing: bool = False
    signum: int | None = None  # the signal `interruptible` caught, if one came
    spawning: bool = False
    deferred: int | None = None


_CHILDREN = _Children()


def spawn(cmd: Sequence[str], *, folder: Path | None = None, **kwargs: Any
          ) -> subprocess.Popen[Any]:
    """`subprocess.Popen(cmd, **kwargs)` in a new session (a process group of its own), kept
    in a registry until `stop` or `run` is done with it, so that `stop_children` reaches it
    and whatever it started. A new session also keeps a terminal's Ctrl-C, meant for the
    user's loop, from reaching it: torchscope stops it itself.

    A signal that comes while the main thread starts the child, to `interruptible`'s
    handler or `stop_and_exit`, is handled once the child is registered: raised inside
    `Popen`, or between it and the registry, it would leave a child that nothing stops.

    `folder`: a temporary folder that the child works in and that no one needs once a
    signal stopped it: `stop_children` removes it after stopping the child (a worker that
    leaves at once on SIGTERM, `stop_and_exit`, runs no `finally` that would).

    Raises:
        ChildProcessError: `stop_children` is stopping every child (a signal came).
        Interrupted: a signal came while the child started (the child is registered).
    """
    main = threading.current_thread() is threading.main_thread()
    try:
        with _CHILDREN.lock:
            if _CHILDREN.closing:
                raise ChildProcessError("torchscope is stopping its child processes (a "
                                        "signal came), so it starts no new one")
            # Only the main thread runs signal handlers: only its spawns need deferring.
            _CHILDREN.spawning = main
            try:
                proc: subprocess.Popen[Any] = subprocess.Popen(
                    list(cmd), start_new_session=True, **kwargs)
                _CHILDREN.live[proc.pid] = (proc, threading.current_thread(), folder)
            finally:
                if main:
                    _CHILDREN.spawning = False
    finally:  # also when Popen failed: the signal still came
        if main and _CHILDREN.deferred is not None:
            signum, _CHILDREN.deferred = _CHILDREN.deferred, None
            # Its handler again (`interruptible`'s raises, `stop_and_exit` stops the
            # children, this one included, and exits), now that the child is registered.
            signal.raise_signal(signum)
    return proc


def _forget(proc: subprocess.Popen[Any]) -> None:
    with _CHILDREN.lock:
        _CHILDREN.live.pop(proc.pid, None)


def stop(proc: subprocess.Popen[Any], grace: float | None = None) -> None:
    """End `proc`'s whole process group and wait for `proc` (`stop_all` of one).

    Args:
        proc: a child started by `spawn` (the leader of its own group).
        grace: seconds between SIGTERM and SIGKILL, so that a child with files to remove
            can remove them; None sends SIGKILL at once.
    """
    stop_all([proc], grace)


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    # After the leader is gone the group lives on while any member does (g++ started by
    # it): the group is signalled, not only the leader.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_all(procs: Sequence[subprocess.Popen[Any]], grace: float | None = None) -> None:
    """End the whole process group of every one of `procs` and wait for each: SIGTERM to
    every group first, then `grace` seconds for all of them together (one deadline, not
    one each), then SIGKILL to every group, which also ends whatever a leader that left
    had started.

    Args:
        procs: children started by `spawn` (each the leader of its own group).
        grace: seconds between SIGTERM and SIGKILL, so that a child with files to remove
            can remove them; None sends SIGKILL at once.
    """
    procs = list(procs)
    if grace is not None:
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        # Bounded: a signal handler may run this while the main thread, interrupted inside
        # an unbounded `wait` of the same child, holds its wait lock (a bounded one polls).
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)
        _forget(proc)


def run(cmd: Sequence[str], *, timeout: float, grace: float | None = None,
        env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
        folder: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
    cwd=cwd)` through `spawn` (with its `folder`): on a timeout, an exception or a signal,
    the child's whole group is stopped (`stop` with `grace`), not only the child.

    Raises:
        subprocess.TimeoutExpired: it ran past `timeout` (and was stopped).
        ChildProcessError: see `spawn`.
    """
    proc = spawn(cmd, folder=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        stop(proc, grace)
        raise
    _forget(proc)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """For a child process, as the first thing it does: `sig` comes to it when `parent` (the
    process that started it, whose pid it was given) dies, whatever ends it: SIGKILL, a
    crash, `os._exit` or a normal exit. If `parent` died before this call (this process is
    another's child by now), `sig` is raised here at once. Install the handler of `sig`
    first: it runs for both.

    Linux only (`prctl(PR_SET_PDEATHSIG)`); elsewhere only a parent already gone is seen.
    Linux sends `sig` when the *thread* that started this process ends: start it from the
    main thread, or from a thread that waits for it (as `run` does), never from a thread
    that may end first.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):  # no libc to call: no guarantee, as elsewhere
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:
        signal.raise_signal(sig)


# How long a child given a `cleanup` may take to leave after a signal when the code it was
# running swallowed the `Interrupted` (caught it, or turned it into another exception).
_LEAVE_S = 5.0


@contextlib.contextmanager
def child_of(parent: int, cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """The body of a child process that `spawn` started (the leader of a process group of
    its own) and that must not outlive `parent`, the process that started it: inside,
    SIGTERM and SIGINT raise `Interrupted` (`interruptible`: a `finally` on the way out
    removes what the child was writing), and so does `parent`'s death however it comes
    (`die_with_parent`; Linux only). After such a signal every other process of the group
    (a compiler the child ran) gets SIGTERM, and the child exits with 128 + the signal.

    A signal is not lost where the body's code swallows its `Interrupted` (an import
    turns an exception raised in a class body into another; a library catches it): a body
    that then ends, normally or not, still ends the child as above.

    Args:
        parent: the pid of the process that started this one.
        cleanup: what to remove when a signal stops the child (a folder whose content no
            one wants once the child is stopped). It runs at once, from the signal's
            handler, before the unwinding: a parent that leaves at once (a doctor rank)
            kills the group a second later. With it, the group is stopped there too, and
            the child leaves at most `_LEAVE_S` seconds later even where the body ran on.

    Raises:
        SystemExit: 128 + the signal, after one.
    """
    caught: int | None = None
    try:
        with interruptible():
            if cleanup is not None:
                _stop_at_once_on_signal(cleanup)
            die_with_parent(parent)
            try:
                yield
            finally:
                caught = interrupted()
    except Interrupted as exc:
        caught = exc.signum
    except BaseException:
        if caught is None:
            raise
    if caught is None:
        return
    _stop_own_group()
    if cleanup is not None:
        with contextlib.suppress(Exception):  # the exit code says the signal, whatever this meets
            cleanup()  # again: what the unwinding wrote
    raise SystemExit(128 + caught) from None


def _stop_own_group() -> None:
    """SIGTERM to every other process of this process's group (never to a group this
    process does not lead, nor where there are none); from the main thread."""
    if hasattr(os, "killpg") and os.getpgrp() == os.getpid():
        # Ignored only for the moment of the kill, so that Linux drops this process's own
        # copy: a compiler started later inherits an ignored SIGTERM, installs no handler
        # for it and is left to the group's SIGKILL, with its temporary files (g++'s .s).
        before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpid(), signal.SIGTERM)
        finally:
            signal.signal(signal.SIGTERM, _previous(before))


def _stop_at_once_on_signal(cleanup: Callable[[], None]) -> None:
    """Inside `interruptible` (main thread), wrap its handlers: the first signal also
    stops the rest of the group and runs `cleanup` right away, and starts a thread that,
    should the main thread still be at work `_LEAVE_S` seconds later, stops the group
    again, runs `cleanup` again and leaves with 128 + the signal. The signal then goes on
    to `interruptible`'s handler, which raises `Interrupted`."""
    inner = {s: signal.getsignal(s) for s in SIGNALS}
    fired: list[int] = []

    def leave(signum: int) -> None:
        time.sleep(_LEAVE_S)
        if hasattr(os, "killpg") and os.getpgrp() == os.getpid():
            # The body ran on: what it started since the signal is stopped too, and given
            # a moment to remove its files. Its own copy goes to the handler below, which
            # lets it pass (or, where the handlers are gone, ends this process at once).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        with contextlib.suppress(Exception):
            cleanup()
        os._exit(128 + signum)

    def handler(signum: int, frame: FrameType | None) -> None:
        if not fired:
            fired.append(signum)
            # Its own copy of the SIGTERM is dropped: delivered, it would run this handler
            # again at once, nested, and raise before the clean-up below.
            _stop_own_group()
            with contextlib.suppress(Exception):
                cleanup()
            threading.Thread(target=leave, args=(signum,), daemon=True).start()
        previous = inner[signal.Signals(signum)]
        if callable(previous):
            previous(signum, frame)

    for s in SIGNALS:
        signal.signal(s, handler)


def stop_and_exit(signum: int, _frame: FrameType | None) -> None:
    """A SIGTERM handler for a worker process that its parent stops with SIGTERM, then
    SIGKILL after a grace period (the doctor's ranks): every child process it started is
    stopped (`stop_children`, within about 2 s; a background kernel build runs in a session
    of its own and would outlive it), then it leaves at once with 128 + the signal
    (`os._exit`). A signal that comes while the main thread is starting a child (it holds
    the registry) is handled by `spawn` once that child is registered (it was dropped, and
    the child outlived the parent's SIGKILL)."""
    if _CHILDREN.spawning:
        if _CHILDREN.deferred is None:
            _CHILDREN.deferred = signum
        return
    stop_children(grace=1.0, join_s=1.0)
    os._exit(128 + signum)


def stop_children(grace: float = 2.0, join_s: float = 5.0) -> None:
    """Stop every child process `spawn` started and that is still running (`stop_all`:
    SIGTERM to every group, SIGKILL to those left after `grace` seconds), refusing new ones
    meanwhile, then give the threads that started them `join_s` seconds in all to finish
    their own clean-up (a background kernel build removes its temporary file and its
    lock), and remove the folders they were given (`spawn`)."""
    with _CHILDREN.lock:
        _CHILDREN.closing = True
        live = list(_CHILDREN.live.values())
    try:
        stop_all([proc for proc, _, _ in live], grace)
        for _, _, folder in live:  # every process of each group is gone: nothing writes
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        me = threading.current_thread()
        deadline = time.monotonic() + join_s
        for thread in {id(t): t for _, t, _ in live}.values():
            if thread is not me and thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        with _CHILDREN.lock:
            _CHILDREN.closing = False


def _previous(handler: Any) -> Any:
    # A handler installed from C (not by Python) reads as None and cannot be set again.
    return signal.SIG_DFL if handler is None else handler


@contextlib.contextmanager
def kept_signals(signals: Sequence[int] = SIGNALS) -> Iterator[None]:
    """The handlers of `signals` as they were on entry, again on exit (torch's elastic
    launcher installs its own for SIGTERM, SIGINT, SIGHUP and SIGQUIT and leaves them
    there). A no-op outside the main thread, where handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in signals}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, _previous(handler))


def note_signal(signum: int) -> Interrupted:
    """Record that `signum` came (a launcher caught it with a handler of its own), for
    `interruptible` to stop the child processes on exit; returns the `Interrupted` to raise.
    """
    if _CHILDREN.signum is None:
        _CHILDREN.signum = int(signum)
    return Interrupted(signum)


def interrupted() -> int | None:
    """The signal `interruptible` caught (or `note_signal` noted), or None."""
    return _CHILDREN.signum


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While open, SIGINT and SIGTERM raise `Interrupted` in the main thread, so that every
    `finally` and context manager on the way out runs (hooks removed, child processes
    stopped, temporary folders removed). A second signal during that clean-up is not
    raised again. On exit after a signal, every child process still running is stopped
    (`stop_children`: background kernel builds included). The previous handlers are back on
    exit, so a library caller's process is left as it was. A no-op outside the main thread.

    The command line's entry point runs inside it. The doctor's launched ranks do not: the
    launcher ends a rank with SIGTERM, and stops the rank's process group with it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: FrameType | None) -> None:
        if _CHILDREN.signum is not None:
            return
        if _CHILDREN.spawning:  # `spawn` raises it once the child is registered
            if _CHILDREN.deferred is None:
                _CHILDREN.deferred = signum
            return
        raise note_signal(signum)

    before = _CHILDREN.signum
    _CHILDREN.signum = None
    _CHILDREN.deferred = None
    with kept_signals():
        for s in SIGNALS:
            signal.signal(s, handler)
        try:
            yield
        finally:
            if _CHILDREN.signum is not None:
                stop_children()
            _CHILDREN.signum = before
            _CHILDREN.deferred = None
