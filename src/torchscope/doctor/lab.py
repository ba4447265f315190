"""`torchscope lab`: the lesson's milestones reproduced on its own models, each claim checked.

Every check runs real torch: forward and full-backward hooks (through `HookSession`),
`torch.profiler` call counts, `torch.utils.checkpoint.checkpoint_sequential` with
`saved_tensors_hooks` accounting and `torch.equal` on gradients, and `torch.compile` timings.
A claim is *held* or *failed* with the measured value beside it, or *not checked* with the
reason (for example, CUDA-only claims on a CPU machine).
"""

from __future__ import annotations

import contextlib
import platform
import shutil
import statistics
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from torchscope.doctor._env import quiet_kineto, seeded
from torchscope.hooks.session import HookSession
from torchscope.models.zoo import MLP, DeepMLP, TinyCNN

__all__ = ["MILESTONES", "LabClaim", "LabResult", "LabTable", "run_lab"]

MILESTONES = ("forward", "backward", "profile", "checkpoint", "memory", "compile")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class LabClaim:
    """One claim of the lesson and what this machine measured.

    Attributes:
        milestone: which part of the lesson it belongs to.
        claim: the claim, in the lesson's words where possible.
        expected: the value the lesson states or implies.
        measured: what was measured here (None when not checked).
        held: True/False, or None when not checked.
        note: how it was measured, or why it was not checked.
    """

    milestone: str
    claim: str
    expected: Any
    measured: Any
    held: bool | None
    note: str = ""


@dataclass(frozen=True)
class LabTable:
    """One of the lesson's comparison tables, refilled with measured values."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class LabResult:
    """Every table and claim of a lab run."""

    milestones: tuple[LabTable, ...]
    claims: tuple[LabClaim, ...]

    @property
    def held(self) -> int:
        """Claims that held."""
        return sum(1 for c in self.claims if c.held is True)

    @property
    def failed(self) -> int:
        """Claims that failed."""
        return sum(1 for c in self.claims if c.held is False)

    @property
    def unchecked(self) -> int:
        """Claims not checked here."""
        return sum(1 for c in self.claims if c.held is None)


_Part = tuple[list[LabTable], list[LabClaim]]


# ------------------------------------------------------------------ milestone 1: forward hooks
def _forward_hooks(device: torch.device) -> _Part:
    torch.manual_seed(0)
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
    torch.manual_seed(0)
    model = TinyCNN().to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (32,), generator=g).to(device)
    order: list[str] = []
    grad_out: dict[str, float] = {}
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
                grad_out[_n] = float(go[0].norm())
                grad_in[_n] = tuple(None if t is None else tuple(t.shape) for t in gi)

            s.full_backward_hook(getattr(model, name), hook)
        loss = functional.cross_entropy(model(x), y)
        loss.backward()
    lesson = {"fc": 3.16, "conv2": None, "conv1": 0.047}
    table = LabTable(
        "Milestone 2: backward hooks on tiny-cnn (cross-entropy, batch 32)",
        ("layer", "grad norm (lesson)", "grad norm (measured)", "grad_input"),
        tuple((n, lesson[n], grad_out.get(n), grad_in.get(n)) for n in order))
    ratio = grad_out["fc"] / grad_out["conv1"] if grad_out.get("conv1") else float("inf")
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
                 f"fc {grad_out['fc']:.3g} → conv1 {grad_out['conv1']:.3g}; absolute norms "
                 "depend on init, data and loss"),
    ]
    return [table], claims


# ------------------------------------------------------------------ milestone 3: profiler
def _profile(device: torch.device) -> _Part:
    from torch.profiler import ProfilerActivity, profile, record_function

    quiet_kineto()
    torch.manual_seed(0)
    model = MLP().to(device)  # 128 -> 256 -> 10
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 128, device=device)  # (B, 128)
    y = torch.randint(0, 10, (64,), device=device)
    steps = 5
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            opt.zero_grad()
            with record_function("forward"):
                loss = functional.nll_loss(functional.log_softmax(model(x), dim=1), y)
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer"):
                opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = {e.key: e for e in prof.key_averages()}

    def calls(op: str) -> int:
        return int(events[op].count) if op in events else 0

    def self_ms(op: str) -> float:
        return float(events[op].self_cpu_time_total) / 1e3 if op in events else 0.0

    def total_ms(label: str) -> float:
        return float(events[label].cpu_time_total) / 1e3 if label in events else 0.0

    expected = {"aten::addmm": 10, "aten::mm": 15, "aten::nll_loss_backward": 5,
                "aten::_log_softmax": 5}
    notes = {"aten::addmm": "linear forward", "aten::mm": "grad matmuls",
             "aten::nll_loss_backward": "loss backward", "aten::_log_softmax": "loss forward"}
    table = LabTable(
        "Milestone 3: profile 5 training steps of the 2-layer MLP (128→256→10, batch 64, SGD)",
        ("op", "what", "calls (lesson)", "calls (measured)", "self CPU ms (5 steps)"),
        tuple((op, notes[op], n, calls(op), self_ms(op)) for op, n in expected.items()))
    claims = [LabClaim("profile", f"{op} is called {n} times in 5 steps", n, calls(op),
                       calls(op) == n, "torch.profiler key_averages") for op, n in expected.items()]
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
@contextlib.contextmanager
def _saved_activations(params: Collection[torch.Tensor]) -> Iterator[dict[int, int]]:
    """Storages autograd saves during the block, parameters excluded: {data_ptr: bytes}."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def _checkpoint(device: torch.device) -> _Part:
    from torch.utils.checkpoint import checkpoint_sequential

    torch.manual_seed(0)
    model = DeepMLP().to(device)  # 8 x [Linear(64, 64) + ReLU]
    x = torch.randn(32, 64, device=device)  # (B, hidden)
    params = list(model.parameters())
    forward_calls = [0] * len(model)

    def run(segments: int | None) -> tuple[dict[int, int], list[torch.Tensor], list[int]]:
        model.zero_grad(set_to_none=True)
        for i in range(len(forward_calls)):
            forward_calls[i] = 0
        with _saved_activations(params) as saved:
            out = model(x) if segments is None else checkpoint_sequential(
                model, segments, x, use_reentrant=False)
        out.sum().backward()
        return saved, [p.grad.detach().clone() for p in params if p.grad is not None], \
            list(forward_calls)

    with HookSession(model) as s:
        for i, block in enumerate(model):
            # A pre-hook: non-reentrant checkpoint stops recomputing as soon as the last saved
            # tensor is rebuilt, so the final block of a segment never finishes its re-run.
            def count(_m: nn.Module, _a: tuple[Any, ...], _i: int = i) -> None:
                forward_calls[_i] += 1

            s.forward_pre_hook(block, count)
        saved_all, grads_all, calls_all = run(None)
        saved_ck, grads_ck, calls_ck = run(2)
    model.zero_grad(set_to_none=True)

    identical = len(grads_all) == len(grads_ck) == len(params) and all(
        torch.equal(a, b) for a, b in zip(grads_all, grads_ck, strict=True))
    norms_equal = all(float(a.norm()) == float(b.norm())
                      for a, b in zip(grads_all, grads_ck, strict=True))
    bytes_all, bytes_ck = sum(saved_all.values()), sum(saved_ck.values())
    recomputed = tuple(i for i, c in enumerate(calls_ck) if c == 2)
    table = LabTable(
        "Milestone 3: storing all vs checkpointing at √8 ≈ 2 segments (deep-mlp, batch 32, "
        "hidden 64)",
        ("strategy", "saved tensors", "saved bytes", "blocks re-run in backward",
         "gradients identical"),
        (("store all", len(saved_all), bytes_all, (), True),
         ("checkpoint_sequential, 2 segments", len(saved_ck), bytes_ck, recomputed, identical)))
    sizes = set(saved_all.values())
    expected_all = (len(model) + 1) * 32 * 64 * 4
    claims = [
        LabClaim("checkpoint", "each activation tensor is 32×64×4 B = 8 KB", 8192,
                 sizes.pop() if len(sizes) == 1 else tuple(sorted(sizes)),
                 set(saved_all.values()) == {8192}, "sizes of saved non-parameter storages"),
        LabClaim("checkpoint", "storing all keeps one 8 KB activation per block plus the input",
                 expected_all, bytes_all, bytes_all == expected_all,
                 f"{len(saved_all)} storages seen by saved_tensors_hooks"),
        LabClaim("checkpoint", "checkpointing at 2 segments stores less than storing all",
                 f"< {bytes_all:,} B", bytes_ck, bytes_ck < bytes_all,
                 "checkpoint_sequential never checkpoints its last segment; the checkpointed "
                 "segment saves only its input"),
        LabClaim("checkpoint", "gradient norms are identical with and without checkpointing",
                 True, identical and norms_equal, identical and norms_equal,
                 f"torch.equal on all {len(params)} parameter gradients"),
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
    t = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)  # 64 MiB
    torch.cuda.empty_cache()  # noqa: TS005 - the lesson's trap, reproduced on purpose
    kept = torch.cuda.memory_allocated(dev) - base_alloc
    reserved_with = torch.cuda.memory_reserved(dev)
    del t
    torch.cuda.empty_cache()
    reserved_after = torch.cuda.memory_reserved(dev)
    freed = reserved_with - reserved_after
    size = 64 * 2**20
    table = LabTable("Memory levers on CUDA (a 64 MiB tensor)",
                     ("step", "allocated by it", "reserved"),
                     (("empty_cache() while referenced", kept, reserved_with),
                      ("del, then empty_cache()", 0, reserved_after)))
    return [table], [
        LabClaim("memory", claim_a, size, kept, kept >= size, "allocated bytes after empty_cache"),
        LabClaim("memory", claim_b, size, freed, freed >= size, "reserved bytes released"),
    ]


# ------------------------------------------------------------------ milestone 4: compile
def _time_calls(fn: Callable[[], Any], n: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _compile(device: torch.device, modes: tuple[str, ...], iters: int) -> _Part:
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from torchscope.compile._measure import fresh_inductor_cache

    torch.manual_seed(0)
    model = TinyCNN().to(device).eval()
    x = torch.randn(32, 3, 32, 32, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    costs: dict[str, float] = {}
    steady: dict[str, float] = {}
    errors: dict[str, str] = {}
    with torch.no_grad():
        eager_ms = _time_calls(lambda: model(x), iters, sync)
        # One-time start-up (imports, compiler probe, first trace of these ops) is paid here,
        # by no mode: otherwise the first mode measured looks the most expensive.
        with fresh_inductor_cache():
            torch.compile(model)(x)
        for mode in modes:
            try:
                # Cold: empty caches and no FX graph cache, so each mode pays its full compile.
                with fresh_inductor_cache(), inductor_config.patch(fx_graph_cache=False):
                    compiled = torch.compile(model, mode=mode)
                    t0 = time.perf_counter()
                    compiled(x)
                    sync()
                    costs[mode] = time.perf_counter() - t0
                    steady[mode] = _time_calls(partial(compiled, x), iters, sync)
            except Exception as exc:  # a mode that cannot compile here is reported, not fatal
                errors[mode] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            rows.append((mode, costs.get(mode), steady.get(mode), eager_ms,
                         eager_ms / steady[mode] if mode in steady else None,
                         errors.get(mode, "")))
        # The trap: torch.compile inside the loop.
        torch._dynamo.reset()
        counters.clear()
        loop_times = []
        wrappers = []
        for _ in range(3):
            t0 = time.perf_counter()
            c = torch.compile(model)  # noqa: TS004 - the lesson's trap, reproduced on purpose
            c(x)
            sync()
            loop_times.append(time.perf_counter() - t0)
            wrappers.append(c)
        graphs = int(counters["stats"]["unique_graphs"])
        distinct = len({id(w) for w in wrappers})
        torch._dynamo.reset()

    table = LabTable(
        "Milestone 4: torch.compile on tiny-cnn inference (batch 32)",
        ("mode", "compile cost (first call s)", "compiled ms", "eager ms", "speedup", "error"),
        tuple(rows))
    claims = []
    if "default" in steady:
        first_ms = costs["default"] * 1e3
        claims.append(LabClaim(
            "compile", "the first call pays the compile cost", "first call ≫ steady call",
            round(first_ms / steady["default"]), first_ms > 10 * steady["default"],
            f"first call {costs['default']:.2f} s vs {steady['default']:.2f} ms per call "
            "(ratio shown)"))
    claims.append(LabClaim(
        "compile", "torch.compile returns a new wrapper object on every call", 3, distinct,
        distinct == 3, "distinct wrappers from 3 calls on the same model"))
    claims.append(LabClaim(
        "compile", "calling torch.compile in the loop recompiles on every iteration", 3, graphs,
        graphs == 3, "graphs compiled over 3 iterations; later calls took "
        + ", ".join(f"{t:.2f}" for t in loop_times[1:]) + " s"))
    if "max-autotune" in costs and "default" in costs:
        claims.append(LabClaim(
            "compile", "max-autotune pays a higher compile cost than default",
            f"> {costs['default']:.1f} s", round(costs["max-autotune"], 2),
            costs["max-autotune"] > costs["default"], "cold first-call time"))
    else:
        claims.append(LabClaim("compile", "max-autotune pays a higher compile cost than default",
                               None, None, None, "max-autotune not measured (--fast or failed)"))
    if device.type == "cuda" and "reduce-overhead" in steady and "default" in steady:
        claims.append(LabClaim(
            "compile", "reduce-overhead cuts per-call overhead (CUDA graphs)",
            f"< {steady['default']:.3f} ms", round(steady["reduce-overhead"], 3),
            steady["reduce-overhead"] < steady["default"], "steady-state median per call"))
    else:
        claims.append(LabClaim("compile", "reduce-overhead cuts per-call overhead (CUDA graphs)",
                               None, None, None, "needs CUDA: CUDA graphs do nothing on CPU"))
    if platform.system() == "Linux":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            cxx: str | None = shutil.which(get_cpp_compiler()) or get_cpp_compiler()
        except Exception:
            cxx = None
        claims.append(LabClaim(
            "compile", "on Linux the inductor stack works out of the box", True,
            "default" in costs, "default" in costs, f"C++ compiler: {cxx or 'none found'}"))
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
        ValueError: `skip` names an unknown milestone.
    """
    unknown = set(skip) - set(MILESTONES)
    if unknown:
        raise ValueError(f"unknown milestone(s) {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(MILESTONES)}")
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
