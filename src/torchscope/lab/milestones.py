"""`torchscope lab`: the lesson's milestones reproduced on its own models, each claim checked.

The hook milestones show raw forward and full-backward hooks (through `HookSession`), which
is their point; every other number is measured through torchscope's capabilities: gradient
norms by `gradient_flow`, op counts and phase times by `profile_steps`, saved bytes,
checkpointing and its gradient check by `torchscope.memory`, compile cost and speed by
`compile_report` (child processes). The lab's own process never compiles. A claim is *held*
or *failed* with the measured value beside it, or *not checked* with the reason (for
example, CUDA-only claims on a CPU machine).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from torchscope import _process
from torchscope._process import seeded
from torchscope.compile import compile_report
from torchscope.errors import TorchscopeError
from torchscope.grads import gradient_flow
from torchscope.hooks.session import HookSession
from torchscope.lab.records import LabClaim, LabResult, LabTable
from torchscope.memory import SavedActivations, apply, saved_activations
from torchscope.models.zoo import MLP, DeepMLP, TinyCNN
from torchscope.profiling import profile_steps
from torchscope.report.html import mode_error
from torchscope.step import Step

__all__ = ["MILESTONES", "run_lab"]

MILESTONES = ("forward", "backward", "profile", "checkpoint", "memory", "compile")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


_Part = tuple[list[LabTable], list[LabClaim]]


# ------------------------------------------------------------------ milestone 1: forward hooks
def _forward_hooks(device: torch.device) -> _Part:
    model = TinyCNN().to(device)
    x = torch.randn(32, 3, 32, 32, device=device)  # (B, C, H, W), the lesson's batch
    shapes: dict[str, tuple[int, ...]] = {}
    args_seen: list[tuple[bool, bool, bool]] = []
    with HookSession(model) as s, torch.no_grad():
        for name in ("conv1", "conv2"):
            mod = getattr(model, name)

            def hook(m: nn.Module, inp: tuple[Any, ...], out: Any, _n: str = name,
                     _mod: nn.Module = mod) -> None:
                shapes[_n] = tuple(out.shape)
                args_seen.append((m is _mod, isinstance(inp, tuple),
                                  isinstance(out, torch.Tensor)))

            s.forward_hook(mod, hook)
        model(x)
    expected = {"conv1": (32, 8, 30, 30), "conv2": (32, 16, 28, 28)}

    # The trap: registering inside the loop. 100 "epochs" of a batch of one.
    xs = x[:1]
    fired: list[int] = []
    copies: list[torch.Tensor] = []
    iterations = 100
    with HookSession(model) as s, torch.no_grad():
        for _ in range(iterations):
            fired.clear()
            copies.clear()
            def trap(_m: nn.Module, _i: tuple[Any, ...], o: Any) -> None:
                fired.append(1)
                copies.append(o)

            s.forward_hook(model.conv1, trap)
            model(xs)
        fires_last = len(fired)
        copies_last = len(copies)
    left = len(model.conv1._forward_hooks)
    fired.clear()
    with torch.no_grad():
        model(xs)  # nothing of ours may fire now
    after = len(fired)
    copies.clear()

    table = LabTable(
        "Milestone 1: forward hooks on tiny-cnn (batch 32, 3x32x32)",
        ("layer", "activation shape (lesson)", "activation shape (measured)"),
        tuple((n, expected[n], shapes.get(n)) for n in ("conv1", "conv2")))
    claims = [
        LabClaim("forward hooks", f"{n} activation shape is {expected[n]}", expected[n],
                 shapes.get(n), shapes.get(n) == expected[n], "register_forward_hook output")
        for n in ("conv1", "conv2")
    ]
    ok_args = bool(args_seen) and all(all(a) for a in args_seen)
    claims.append(LabClaim(
        "forward hooks", "a forward hook receives (module, input, output)",
        "(module, tuple, Tensor)", "(module, tuple, Tensor)" if ok_args else str(args_seen[:1]),
        ok_args, "types seen by the hook"))
    claims.append(LabClaim(
        "forward hooks", "registering inside the loop adds a hook per iteration: after 100 "
        "iterations, 100 hooks fire and store 100 copies", (iterations, iterations),
        (fires_last, copies_last), fires_last == iterations and copies_last == iterations,
        "fires and stored copies on the last forward"))
    claims.append(LabClaim(
        "forward hooks", "remove() after use leaves no hook behind", 0, left + after,
        left == 0 and after == 0, "hooks left on conv1, and fires, after removing"))
    return [table], claims


# ------------------------------------------------------------------ milestone 2: backward hooks
def _backward_hooks(device: torch.device) -> _Part:
    model = TinyCNN().to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (32,), generator=g).to(device)
    # The lesson's raw full backward hooks: when they fire and what they receive.
    order: list[str] = []
    grad_in: dict[str, tuple[Any, ...]] = {}
    shapes_ok = True
    with HookSession(model) as s, warnings.catch_warnings():
        # conv1's input needs no grad; torch warns that the hook fires on outputs only.
        warnings.simplefilter("ignore", UserWarning)
        for name in ("conv1", "conv2", "fc"):

            def hook(m: nn.Module, gi: tuple[Any, ...], go: tuple[Any, ...],
                     _n: str = name) -> None:
                nonlocal shapes_ok
                order.append(_n)
                shapes_ok &= isinstance(gi, tuple) and isinstance(go, tuple) and all(
                    t is None or isinstance(t, torch.Tensor) for t in (*gi, *go))
                grad_in[_n] = tuple(None if t is None else tuple(t.shape) for t in gi)

            s.full_backward_hook(getattr(model, name), hook)
        functional.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    # The norms of the gradient each layer receives (its grad_output), from gradient_flow.
    flow = gradient_flow(model, x, loss_fn="cross_entropy", target=y)
    model.zero_grad(set_to_none=True)
    grad_out = flow.output_norms()
    lesson = {"fc": 3.16, "conv2": None, "conv1": 0.047}
    table = LabTable(
        "Milestone 2: backward hooks on tiny-cnn (cross-entropy, batch 32)",
        ("layer", "grad norm (lesson)", "grad norm (measured)", "grad_input"),
        tuple((n, lesson[n], grad_out.get(n), grad_in.get(n)) for n in order))
    fc, conv1 = grad_out.get("fc") or 0.0, grad_out.get("conv1") or 0.0
    ratio = fc / conv1 if conv1 else float("inf")
    claims = [
        LabClaim("backward hooks", "full backward hooks fire from the loss down: fc, conv2, "
                 "conv1", ("fc", "conv2", "conv1"), tuple(order),
                 tuple(order) == ("fc", "conv2", "conv1"), "order the hooks fired"),
        LabClaim("backward hooks", "grad_input and grad_output are tuples of tensors (or None)",
                 True, shapes_ok, shapes_ok, "types seen by the hooks"),
        LabClaim("backward hooks", "conv1's grad_input is (None,): its input needs no grad",
                 (None,), grad_in.get("conv1"), grad_in.get("conv1") == (None,),
                 "conv1 fed raw data"),
        LabClaim("backward hooks", "gradient norm drops from fc to conv1 (lesson: 3.16 → 0.047, "
                 "67×)", "≥ 10×", round(ratio, 1), ratio >= 10,
                 f"fc {fc:.3g} → conv1 {conv1:.3g} (grad_output norms from gradient_flow); "
                 "absolute norms depend on init, data and loss"),
    ]
    return [table], claims


# ------------------------------------------------------------------ milestone 3: profiler
def _nll_of_log_softmax(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The lesson's loss, written as it writes it."""
    return functional.nll_loss(functional.log_softmax(output, dim=1), target)


def _profile(device: torch.device) -> _Part:
    model = MLP().to(device)  # 128 -> 256 -> 10
    x = torch.randn(64, 128, device=device)  # (B, 128)
    y = torch.randint(0, 10, (64,), device=device)
    steps = 5
    step = Step.of(model, x, loss_fn=_nll_of_log_softmax, target=y,
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    # Five profiled SGD steps, each labelled forward / backward / optimizer by the Step.
    result = profile_steps(step, steps=steps, by_module=False, baseline_steps=0)

    calls = result.calls

    def self_ms(op: str) -> float:
        rec = result.op(op)
        return 0.0 if rec is None else rec.self_cpu_ms

    def total_ms(label: str) -> float:
        ph = result.phase(label)
        return 0.0 if ph is None else ph.cpu_ms

    expected = {"aten::addmm": 10, "aten::mm": 15, "aten::nll_loss_backward": 5,
                "aten::_log_softmax": 5}
    notes = {"aten::addmm": "linear forward", "aten::mm": "grad matmuls",
             "aten::nll_loss_backward": "loss backward", "aten::_log_softmax": "loss forward"}
    table = LabTable(
        "Milestone 3: profile 5 training steps of the 2-layer MLP (128→256→10, batch 64, SGD)",
        ("op", "what", "calls (lesson)", "calls (measured)", "self CPU ms (5 steps)"),
        tuple((op, notes[op], n, calls(op), self_ms(op)) for op, n in expected.items()))
    claims = [LabClaim("profile", f"{op} is called {n} times in 5 steps", n, calls(op),
                       calls(op) == n, "profile_steps: torch.profiler op counts")
              for op, n in expected.items()]
    fwd, bwd = total_ms("forward"), total_ms("backward")
    loss_bwd = self_ms("aten::nll_loss_backward") + self_ms("aten::_log_softmax_backward_data")
    r_loss = loss_bwd / fwd if fwd else float("nan")
    claims.append(LabClaim(
        "profile", "loss backward (nll_loss_backward + _log_softmax_backward) takes as much time "
        "as the forward pass", "0.5× to 2× the forward", round(r_loss, 2), 0.5 <= r_loss <= 2.0,
        f"{loss_bwd:.2f} ms vs forward {fwd:.2f} ms, CPU time over 5 steps"))
    r = bwd / fwd if fwd else float("nan")
    claims.append(LabClaim(
        "profile", "on small models, backward costs about 2× the forward", "1× to 3× the forward",
        round(r, 2), 1.0 <= r <= 3.0, f"backward {bwd:.2f} ms vs forward {fwd:.2f} ms"))
    return [table], claims


# ------------------------------------------------------------------ milestone 3: checkpointing
def _checkpoint(device: torch.device) -> _Part:
    model = DeepMLP().to(device)  # 8 x [Linear(64, 64) + ReLU]
    x = torch.randn(32, 64, device=device)  # (B, hidden)
    step = Step.of(model, x, loss_fn="sum")  # the lesson's out.sum().backward()
    forward_calls = [0] * len(model)

    def counted() -> SavedActivations:
        """What one step saves, and which blocks started a forward during it."""
        forward_calls[:] = [0] * len(model)
        return saved_activations(step)

    with HookSession(model) as s:
        for i, block in enumerate(model):
            # A pre-hook: non-reentrant checkpoint stops recomputing as soon as the last saved
            # tensor is rebuilt, so the final block of a segment never finishes its re-run.
            def count(_m: nn.Module, _a: tuple[Any, ...], _i: int = i) -> None:
                forward_calls[_i] += 1

            s.forward_pre_hook(block, count)
        saved_all = counted()
        calls_all = list(forward_calls)
        # checkpoint_sequential(model, 2 segments): blocks 0-3 under one checkpoint, 4-7
        # stored; `apply` verifies at once that the loss and every gradient match a step
        # without it.
        with apply(step, segments=[(0, 4)]) as handle:
            saved_ck = counted()
            calls_ck = list(forward_calls)
    verification = handle.verification
    assert verification is not None

    params = len(list(model.parameters()))
    identical = verification.bitwise_equal and len(verification.grads) == params
    bytes_all, bytes_ck = saved_all.total_bytes, saved_ck.total_bytes
    # Saved non-parameter storages: the activations (and the input) each strategy keeps.
    kept_all, kept_ck = ([st for st in saved.storages if st.kind in ("activation", "input")]
                         for saved in (saved_all, saved_ck))
    recomputed = tuple(i for i, c in enumerate(calls_ck) if c == 2)
    table = LabTable(
        "Milestone 3: storing all vs checkpointing at √8 ≈ 2 segments (deep-mlp, batch 32, "
        "hidden 64)",
        ("strategy", "saved tensors", "saved bytes", "blocks re-run in backward",
         "gradients identical"),
        (("store all", len(kept_all), bytes_all, (), True),
         ("checkpoint blocks 0-3 as one segment", len(kept_ck), bytes_ck, recomputed,
          identical)))
    sizes = {st.nbytes for st in kept_all}
    expected_all = (len(model) + 1) * 32 * 64 * 4
    claims = [
        LabClaim("checkpoint", "each activation tensor is 32×64×4 B = 8 KB", 8192,
                 next(iter(sizes)) if len(sizes) == 1 else tuple(sorted(sizes)),
                 sizes == {8192}, "saved_activations: sizes of saved non-parameter storages"),
        LabClaim("checkpoint", "storing all keeps one 8 KB activation per block plus the input",
                 expected_all, bytes_all, bytes_all == expected_all,
                 f"saved_activations: {len(kept_all)} storages"),
        LabClaim("checkpoint", "checkpointing at 2 segments stores less than storing all",
                 f"< {bytes_all:,} B", bytes_ck, bytes_ck < bytes_all,
                 "the last segment is not checkpointed (as checkpoint_sequential does); the "
                 "checkpointed segment saves only its input"),
        LabClaim("checkpoint", "gradient norms are identical with and without checkpointing",
                 True, identical, identical,
                 f"torchscope.memory.verify: torch.equal on all {params} parameter gradients "
                 "and the loss"),
        LabClaim("checkpoint", "backward re-runs the forward of each checkpointed segment",
                 (0, 1, 2, 3), recomputed,
                 recomputed == (0, 1, 2, 3) and calls_all == [1] * len(model),
                 "blocks whose forward started twice"),
    ]
    return [table], claims


# ------------------------------------------------------------------ memory levers (CUDA)
def _memory(device: torch.device) -> _Part:
    claim_a = "empty_cache() cannot free a tensor that is still referenced"
    claim_b = "del the tensor first, then empty_cache() returns its memory"
    if not torch.cuda.is_available():
        why = "needs CUDA: the caching allocator only exists there"
        return [], [LabClaim("memory", claim_a, True, None, None, why),
                    LabClaim("memory", claim_b, True, None, None, why)]
    dev = device if device.type == "cuda" else torch.device("cuda")
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()  # noqa: TS005 - a clean baseline before measuring
    base_alloc = torch.cuda.memory_allocated(dev)
    size = 64 * 2**20
    t = torch.empty(size, dtype=torch.uint8, device=dev)  # 64 MiB
    torch.cuda.empty_cache()  # noqa: TS005 - the lesson's trap, reproduced on purpose
    kept = torch.cuda.memory_allocated(dev) - base_alloc
    reserved_with = torch.cuda.memory_reserved(dev)
    del t
    torch.cuda.empty_cache()
    reserved_after = torch.cuda.memory_reserved(dev)
    freed = reserved_with - reserved_after
    table = LabTable("Memory levers on CUDA (a 64 MiB tensor)",
                     ("step", "allocated by it", "reserved"),
                     (("empty_cache() while referenced", kept, reserved_with),
                      ("del, then empty_cache()", 0, reserved_after)))
    return [table], [
        LabClaim("memory", claim_a, size, kept, kept >= size, "allocated bytes after empty_cache"),
        LabClaim("memory", claim_b, size, freed, freed >= size, "reserved bytes released"),
    ]


# ------------------------------------------------------------------ milestone 4: compile
_LOOP_ITERATIONS = 3
_LOOP_TIMEOUT_S = 600.0
_LOOP_CHILD = ("import sys; from torchscope.lab.milestones import _loop_child; "
               "_loop_child(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])")


def _loop_child(iterations: int, threads: int, parent: int, folder: str) -> None:
    """The child process of `_compile_loop`: the lesson's trap, `torch.compile` called inside
    the training loop, on tiny-cnn. Prints one JSON line: how many distinct wrappers the calls
    returned, how many graphs Dynamo compiled, and each iteration's wall time. It ends with
    `parent`, and removes `folder` (its inductor cache) when a signal or that death stops it
    (`_process.child_of`)."""
    with _process.child_of(parent, cleanup=lambda: shutil.rmtree(folder, ignore_errors=True)):
        _loop(iterations, threads)


def _loop(iterations: int, threads: int) -> None:
    from torch._dynamo.utils import counters

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = TinyCNN().eval()
    x = torch.randn(32, 3, 32, 32)  # (B, C, H, W), the lesson's batch
    wrappers, times = [], []
    with torch.no_grad():
        for _ in range(iterations):
            t0 = time.perf_counter()
            compiled = torch.compile(model)  # noqa: TS004 - the lesson's trap, on purpose
            compiled(x)
            times.append(time.perf_counter() - t0)
            wrappers.append(compiled)
    print(json.dumps({"wrappers": len({id(w) for w in wrappers}),
                      "graphs": int(counters["stats"]["unique_graphs"]), "times": times}))


def _compile_loop() -> tuple[dict[str, Any] | None, str]:
    """The compile-in-the-loop trap, run in a child process with its own inductor cache (so
    that the lab's own process never compiles: the caller's Dynamo caches, recompile counts
    and compiler state stay exactly as they were): its JSON result, or None and why."""
    # The child removes the folder when a signal or this process's death stops it.
    with tempfile.TemporaryDirectory(prefix="torchscope-lab-",
                                     ignore_cleanup_errors=True) as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tmp}
        cmd = [sys.executable, "-c", _LOOP_CHILD, str(_LOOP_ITERATIONS),
               str(torch.get_num_threads()), str(os.getpid()), tmp]
        try:
            # In its own process group, stopped with the compilers it started on a timeout
            # or a signal, before the folder is removed.
            done = _process.run(cmd, timeout=_LOOP_TIMEOUT_S, grace=2.0, env=env,
                                folder=Path(tmp))
        except subprocess.TimeoutExpired:
            return None, f"the child process ran past {_LOOP_TIMEOUT_S:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"the child process failed (exit {done.returncode}): {tail}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result, ""


def _compile(device: torch.device, modes: tuple[str, ...], iters: int) -> _Part:
    model = TinyCNN().to(device).eval()
    x = torch.randn(32, 3, 32, 32, device=device)
    # Each mode in its own child process with an empty inductor cache: the cold first call,
    # then the median eager and compiled calls (inference, no_grad).
    report = compile_report(model, x, modes=modes, iters=iters)
    rows = tuple((m.mode, m.cold_compile_s, m.compiled_ms, m.eager_ms, m.speedup,
                  mode_error(m)) for m in report.modes)
    ok = {m.mode: m for m in report.modes if m.ok}
    loop, why = _compile_loop()

    table = LabTable(
        "Milestone 4: torch.compile on tiny-cnn inference (batch 32)",
        ("mode", "compile cost (cold first call, s)", "compiled ms", "eager ms", "speedup",
         "error"),
        rows)
    claims = []
    default = ok.get("default")
    if default is not None and default.cold_compile_s is not None and default.compiled_ms:
        first_ms = default.cold_compile_s * 1e3
        claims.append(LabClaim(
            "compile", "the first call pays the compile cost", "first call ≫ steady call",
            round(first_ms / default.compiled_ms), first_ms > 10 * default.compiled_ms,
            f"first call {default.cold_compile_s:.2f} s vs {default.compiled_ms:.2f} ms per "
            "call (ratio shown; compile_report, cold cache)"))
    loop_note = why or "in a child process; later calls took " + ", ".join(
        f"{t:.2f}" for t in (loop or {}).get("times", [])[1:]) + " s"
    claims.append(LabClaim(
        "compile", "torch.compile returns a new wrapper object on every call",
        _LOOP_ITERATIONS, None if loop is None else loop["wrappers"],
        None if loop is None else loop["wrappers"] == _LOOP_ITERATIONS,
        f"distinct wrappers from {_LOOP_ITERATIONS} calls on the same model"
        + (f"; {why}" if why else "")))
    claims.append(LabClaim(
        "compile", "calling torch.compile in the loop recompiles on every iteration",
        _LOOP_ITERATIONS, None if loop is None else loop["graphs"],
        None if loop is None else loop["graphs"] == _LOOP_ITERATIONS,
        f"graphs compiled over {_LOOP_ITERATIONS} iterations; {loop_note}"))
    auto = ok.get("max-autotune")
    costlier = "max-autotune pays a higher compile cost than default"
    if auto is not None and default is not None and auto.cold_compile_s is not None and \
            default.cold_compile_s is not None:
        claims.append(LabClaim(
            "compile", costlier, f"> {default.cold_compile_s:.1f} s",
            round(auto.cold_compile_s, 2), auto.cold_compile_s > default.cold_compile_s,
            "cold first-call time"))
    else:
        claims.append(LabClaim("compile", costlier, None, None, None,
                               "max-autotune not measured (--fast or failed)"))
    overhead = ok.get("reduce-overhead")
    cheaper = "reduce-overhead cuts per-call overhead (CUDA graphs)"
    if device.type == "cuda" and overhead is not None and default is not None and \
            overhead.compiled_ms is not None and default.compiled_ms is not None:
        claims.append(LabClaim(
            "compile", cheaper, f"< {default.compiled_ms:.3f} ms", round(overhead.compiled_ms, 3),
            overhead.compiled_ms < default.compiled_ms, "steady-state median per call"))
    else:
        claims.append(LabClaim("compile", cheaper, None, None, None,
                               "needs CUDA: CUDA graphs do nothing on CPU"))
    if platform.system() == "Linux":
        asked = next((m for m in report.modes if m.mode == "default"), None)
        claims.append(LabClaim(
            "compile", "on Linux the inductor stack works out of the box", True,
            default is not None, default is not None,
            "default mode: " + ("compiled and ran" if asked is None or asked.ok
                                else mode_error(asked))))
    return [table], claims


def run_lab(
    *,
    skip: Collection[str] = (),
    fast: bool = False,
    device: str = "cpu",
    compile_modes: tuple[str, ...] | None = None,
    on_milestone: Callable[[str], None] | None = None,
) -> LabResult:
    """Reproduce the lesson's milestones and check each of its claims.

    Args:
        skip: milestones not to run (see `MILESTONES`).
        fast: compile only in `default` mode with fewer timed calls.
        device: `cpu` or `cuda` (CUDA-only claims need a GPU either way).
        compile_modes: override the compile modes measured.
        on_milestone: called with each milestone's name before it runs (progress display).

    Returns:
        Tables and claims in the lesson's order.

    Raises:
        TorchscopeError: `skip` names an unknown milestone.
    """
    unknown = set(skip) - set(MILESTONES)
    if unknown:
        raise TorchscopeError(f"unknown milestone(s) {', '.join(sorted(unknown))}.",
                              fix=f"choose from {', '.join(MILESTONES)}.")
    dev = torch.device(device)
    modes = compile_modes or (("default",) if fast else COMPILE_MODES)
    parts: dict[str, Callable[[], _Part]] = {
        "forward": lambda: _forward_hooks(dev),
        "backward": lambda: _backward_hooks(dev),
        "profile": lambda: _profile(dev),
        "checkpoint": lambda: _checkpoint(dev),
        "memory": lambda: _memory(dev),
        "compile": lambda: _compile(dev, modes, 10 if fast else 30),
    }
    tables: list[LabTable] = []
    claims: list[LabClaim] = []
    for name in MILESTONES:
        if name in skip:
            continue
        if on_milestone is not None:
            on_milestone(name)
        with seeded(0):
            t, c = parts[name]()
        tables += t
        claims += c
    return LabResult(tuple(tables), tuple(claims))
