"""What watching a training step costs, in one run and one table.

Per model, side by side in one process, interleaved round by round (medians, and each
variant's median ratio to the bare step in the same round, with its 95 % interval):

  bare              forward + cross-entropy + backward + SGD step (a language model: its
                    own loss on its input tokens)
  acts eager        the same under `watch_activations` (every leaf), eager statistics
  acts fused        the same, statistics by the fused kernel (one pass per activation)
  .item() hooks     hand-written forward hooks: 5 statistics per leaf, one `.item()` each
  grads eager       under `watch_gradients(every=1)`: grad_output + grad_input norms of
                    every leaf and every parameter's norm, eager `vector_norm`
  grads fused       the same with the fused norm kernel (parameters: one call per
                    backward, the native list kernel or _foreach_norm)
  grads fused, no updates
                    the same without update ratios (`updates=False`): they copy the
                    trainable weights before each update and read them twice more
  param .item()     the usual logger: `p.grad.norm().item()` per parameter after backward
  read floor: acts  forward hooks that only read each leaf's output once (`sum`, kept on
                    the device): what any per-activation statistic costs at the least
  read floor: grads tensor hooks that only read each leaf's grad_output once: the least a
                    per-layer gradient norm costs

then, forward only (no_grad): bare forward, `capture_activations` (fused), torchinfo (shapes
only) and TorchLens (`torchlens.trace` and `torchlens.record`, when installed: the `bench`
extra). Every watch is
opened once for the whole run, on its own copy of the model, as in a real loop.

Also reported: the fused kernels' one-time cost (a cold build in a child process, once per
machine, with `--cold-build`; otherwise how this run got them: built or loaded from the
on-disk cache, and the load time) and how many kernels exist: one per (program, dtype,
device), never recompiled for a new size. Goals: activation statistics <= 1.05x and
gradient flow <= 1.03x of the bare step.

glibc's malloc is told to keep freed memory in the process (`_timing.steady_heap`: page
faults after each step's frees otherwise swing single rounds by several percent);
`--glibc-default` leaves it as it is.

Run: PYTHONPATH=src python benchmarks/watch_overhead.py [--repeats 9] [--threads 2]
     [--batch 16] [--size 64] [--models resnet-mini,resnet-deep,resnet-narrow,llama-tiny]
     [--device cuda] [--kernel-wait SECONDS]
     [--cold-build]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).parent))
from _timing import Interval, interleaved_paired, steady_heap

from torchscope import _kernels
from torchscope.capture import capture_activations, watch_activations
from torchscope.grads import watch_gradients
from torchscope.models import ResNetMini


def _llama() -> nn.Module:
    """A Llama-style decoder from a transformers config (no download): 8 layers of 256,
    84 leaves, 6.8M parameters; trained on 8 sequences of 128 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256))


MODELS: dict[str, Callable[[], nn.Module]] = {
    # 8 residual conv+BN+ReLU blocks of 64 channels: 29 leaves, 16 MiB activations.
    "resnet-mini": ResNetMini,
    # More, smaller layers: 16 blocks of 32 channels: 53 leaves, 8 MiB activations.
    "resnet-deep": lambda: ResNetMini(channels=32, blocks=16),
    # Many more, much smaller layers: 24 blocks of 16 channels: 77 leaves, 4 MiB activations.
    "resnet-narrow": lambda: ResNetMini(channels=16, blocks=24),
    # A real third-party architecture: RMSNorm, rotary attention, SwiGLU MLPs.
    "llama-tiny": _llama,
}
TOKENS = (8, 128)  # llama-tiny's batch: sequences x tokens


def _batch(name: str, args: argparse.Namespace, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch for `name`: (input, target); a language model's target is its input."""
    g = torch.Generator().manual_seed(0)
    if name.startswith("llama"):
        ids = torch.randint(0, 1000, TOKENS, generator=g).to(device)
        return ids, ids
    return (torch.randn(args.batch, 3, args.size, args.size, generator=g).to(device),
            torch.randint(0, 10, (args.batch,), generator=g).to(device))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.long:  # a causal LM: its own shifted cross-entropy
        loss: torch.Tensor = model(input_ids=x, labels=y).loss
        return loss
    return functional.cross_entropy(model(x), y)


# A variant's medians (wall, process CPU, minimum wall; seconds) and its paired ratio to the
# bare step or forward (`_timing.interleaved_paired`).
_Timed = tuple[tuple[float, float, float], Interval]


def _leaves(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if next(m.children(), None) is None]


def _grads_read_floor(model: nn.Module, reads: list[torch.Tensor],
                      stack: contextlib.ExitStack) -> None:
    """Hook every leaf's output so that its gradient is read once (`sum`, kept on the
    device in `reads`): the least a per-layer gradient norm costs. Removed by `stack`."""

    def hook_grad(_m: nn.Module, _i: object, o: object) -> None:
        if isinstance(o, torch.Tensor) and o.requires_grad:
            o.register_hook(lambda g: reads.append(g.sum()) and None)

    for leaf in _leaves(model):
        stack.callback(leaf.register_forward_hook(hook_grad).remove)


def heap_line(args: argparse.Namespace) -> str:
    """Set up malloc as `--glibc-default` says (`_timing.steady_heap`); what was done."""
    return "glibc malloc left as it is" if args.glibc_default else steady_heap()


def fmt_paired(r: Interval) -> str:
    """A paired ratio as `1.021 [1.013-1.030]`."""
    return f"{r.median:.3f} [{r.low:.3f}-{r.high:.3f}]"


def _parser(doc: str, models: str) -> argparse.ArgumentParser:
    """The options every training-step benchmark here takes; `models` is the default."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9, help="interleaved rounds per variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--models", default=models)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--glibc-default", action="store_true",
                    help="leave glibc's malloc as it is (see _timing.steady_heap)")
    return ap


def _model_names(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The models `--models` names, in order; one line and exit 2 for an unknown one."""
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; expected some of {', '.join(MODELS)}")
    return names


def _kernel_lines(cold_build: bool, device: torch.device, kernel_wait: float | None = None
                  ) -> list[str]:
    lines = []
    if cold_build:
        with tempfile.TemporaryDirectory(prefix="torchscope-bench-") as tmp:
            if device.type == "cpu":
                t0 = time.perf_counter()
                error = _kernels._compile_native(Path(tmp) / "native.so")
                took = time.perf_counter() - t0
                lines.append("cold build of the native library (stats and norm, CPU float32): "
                             + (f"{took:.1f} s in a compiler process" if error is None
                                else error))
            for program in _kernels.PROGRAMS:
                path = Path(tmp) / f"{program}.pt2"
                t0 = time.perf_counter()
                error = _kernels._build(path, program, torch.float32, device)
                took = time.perf_counter() - t0
                lines.append(f"cold build of `{program}` by AOTInductor (float32, {device}): "
                             + (f"{took:.1f} s in a child process" if error is None else error))
    for program in _kernels.PROGRAMS:
        _kernels.prepare(program, torch.float32, device, wait=kernel_wait)
    kernels = _kernels.kernel_status()
    for k in kernels:
        how = (f"built here in {k.build_s:.1f} s, " if k.build_s is not None else
               "loaded from the on-disk cache, " if k.source == "cache" else "")
        load = f"load {k.load_s * 1e3:.0f} ms" if k.load_s is not None else k.reason
        lines.append(f"kernel {k.program} {k.dtype} {k.device}: {k.state}, {k.backend} "
                     f"({how}{load})")
    return [*lines, _kernel_reads(device)]


def _kernel_reads(device: torch.device) -> str:
    """What each fused kernel costs, in reads: its time on a 16 MiB float32 tensor over one
    `sum` of it (interleaved medians; the tensor stays in the caches where they hold it)."""
    x = torch.randn(4 * 2**20, device=device)  # (4M,): 16 MiB

    def timed(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        return run

    runs = {"sum": timed(x.sum), **{p: timed(lambda p=p: _kernels.run(p, x))
                                    for p in _kernels.PROGRAMS}}
    if any(_kernels.run(p, x) is None for p in _kernels.PROGRAMS):
        return "kernel cost: not measured (a kernel is not ready here)"
    rows = interleaved_paired(runs, repeats=51, warmup=5)
    one = rows["sum"][0][0]
    return ("kernel cost on 16 MiB of float32, in reads (one `sum`: "
            f"{one * 1e3:.3f} ms): " + ", ".join(
                f"{p} {rows[p][0][0] * 1e3:.3f} ms = {rows[p][0][0] / one:.2f}"
                for p in _kernels.PROGRAMS))


def _training_rows(name: str, build: Callable[[], nn.Module], args: argparse.Namespace,
                   device: torch.device) -> tuple[dict[str, _Timed], list[str]]:
    torch.manual_seed(0)
    base = build().to(device).train()
    x, y = _batch(name, args, device)
    variants = ("bare", "acts eager", "acts fused", ".item() hooks", "read floor: acts",
                "grads eager", "grads fused", "grads fused, no updates", "param .item()",
                "read floor: grads")
    models = {v: base if v == "bare" else copy.deepcopy(base) for v in variants}
    opts = {v: torch.optim.SGD(m.parameters(), lr=1e-3) for v, m in models.items()}
    sink: list[float] = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def item_hook(_m: nn.Module, _i: object, o: object) -> None:
        # The baseline on purpose: what users write by hand, a host read per statistic.
        if isinstance(o, torch.Tensor):
            d = o.detach()
            stats = (d.mean(), d.std(), d.min(), d.max(), d.norm())
            sink.extend(s.item() for s in stats)  # noqa: TS006

    reads: list[torch.Tensor] = []

    def read_output(_m: nn.Module, _i: object, o: object) -> None:
        if isinstance(o, torch.Tensor):
            reads.append(o.detach().sum())  # one read, no host sync

    def step(variant: str) -> Callable[[], None]:
        model, opt = models[variant], opts[variant]
        eager = variant.endswith("eager")

        def run() -> None:
            with _kernels.disabled() if eager else contextlib.nullcontext():
                opt.zero_grad(set_to_none=True)
                _loss(model, x, y).backward()
                if variant == "param .item()":
                    sink.extend(p.grad.norm().item() for p in model.parameters()
                                if p.grad is not None)
                opt.step()
                reads.clear()
                sync()

        return run

    with contextlib.ExitStack() as stack:
        acts = {v: stack.enter_context(watch_activations(models[v]))
                for v in ("acts eager", "acts fused")}
        grads = {v: stack.enter_context(watch_gradients(models[v], every=1, optimizer=opts[v],
                                                        updates=not v.endswith("no updates")))
                 for v in ("grads eager", "grads fused", "grads fused, no updates")}
        for leaf in _leaves(models[".item() hooks"]):
            stack.callback(leaf.register_forward_hook(item_hook).remove)
        for leaf in _leaves(models["read floor: acts"]):
            stack.callback(leaf.register_forward_hook(read_output).remove)
        _grads_read_floor(models["read floor: grads"], reads, stack)
        medians = interleaved_paired({v: step(v) for v in variants}, repeats=args.repeats,
                                     warmup=2)
    notes = [f"{name}: {len(_leaves(base))} leaves, "
             f"{sum(p.numel() for p in base.parameters()) / 1e6:.2f}M parameters, batch "
             f"{'x'.join(map(str, x.shape))}, {device}"]
    for v, cap in acts.items():
        notes.append(f"  {v}: {cap.paths.describe()}")
    for v, watch in grads.items():
        flow = watch.last
        assert flow is not None
        notes.append(f"  {v}: norms {flow.fused_norms} fused, {flow.eager_norms} eager, "
                     f"{len(flow.params)} parameters by one call per backward")
    return medians, notes


@contextlib.contextmanager
def _unwrapped_torchlens() -> Iterator[None]:
    """TorchLens wraps torch's functions on its first call; unwrap after each timed call so
    that the rows timed after it run plain torch."""
    from torchlens.backends.torch.wrappers import unwrap_torch

    try:
        yield
    finally:
        unwrap_torch()


def _forward_rows(name: str, build: Callable[[], nn.Module], args: argparse.Namespace,
                  device: torch.device) -> tuple[dict[str, _Timed], list[str]]:
    torch.manual_seed(0)
    model = build().to(device).eval()
    x, _ = _batch(name, args, device)
    runs: dict[str, Callable[[], object]] = {}

    def bare() -> None:
        with torch.no_grad():
            model(x)

    runs["forward: bare"] = bare
    runs["forward: capture_activations"] = lambda: capture_activations(model, x).records
    notes = []
    if importlib.util.find_spec("torchinfo") is not None:
        import torchinfo

        # A peer that records shapes only, no statistics.
        runs["forward: torchinfo.summary"] = lambda: torchinfo.summary(model, input_data=x,
                                                                       verbose=0)
    if importlib.util.find_spec("torchlens") is None:
        notes.append("TorchLens not installed (pip install -e '.[bench]'): its rows skipped")
    else:
        import torchlens

        def trace() -> None:
            with _unwrapped_torchlens():
                torchlens.trace(model, x)

        def record() -> None:
            with _unwrapped_torchlens():
                torchlens.record(model, x, default_module=True)

        runs["forward: torchlens.trace"] = trace
        runs["forward: torchlens.record (modules)"] = record
        notes.append(f"TorchLens {getattr(torchlens, '__version__', '?')}: times include "
                     "wrapping torch's functions on each call (unwrapped after each)")
    if device.type == "cuda":  # the forward's queued kernels inside each timing
        runs = {k: _synced(fn) for k, fn in runs.items()}
    return interleaved_paired(runs, repeats=max(args.repeats // 2, 1), warmup=1), notes


def _synced(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def main() -> None:
    ap = _parser(__doc__, ",".join(MODELS))
    ap.add_argument("--cold-build", action="store_true",
                    help="also time a cold build of each kernel into a temporary cache")
    ap.add_argument("--kernel-wait", type=float, default=None,
                    help="seconds to wait for the fused kernels to be built (default: as long "
                    "as it takes); the fused rows run eager where one is not ready by then")
    args = ap.parse_args()
    names = _model_names(ap, args)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    notes = [heap_line(args), *_kernel_lines(args.cold_build, device, args.kernel_wait)]
    table: list[tuple[str, str, _Timed, tuple[float, ...]]] = []
    for name in names:
        for rows, more in (_training_rows(name, MODELS[name], args, device),
                           _forward_rows(name, MODELS[name], args, device)):
            notes += more
            base = next(iter(rows.values()))[0]  # the bare step, or the bare forward
            table += [(name, v, t, tuple(a / b for a, b in zip(t[0], base, strict=True)))
                      for v, t in rows.items()]

    print(f"torch {torch.__version__}, {device}, {args.threads} thread(s), "
          f"{args.repeats} interleaved rounds: median wall, median process CPU, min wall, "
          "and the median of each round's wall ratio to bare [95 % interval]")
    print(f"{'model':14} {'variant':36} {'wall ms':>9} {'x bare':>7} {'cpu ms':>9} "
          f"{'x bare':>7} {'min ms':>9} {'x bare':>7}  paired x bare")
    for model, variant, ((wall, cpu, low), paired), (rw, rc, rl) in table:
        print(f"{model:14} {variant:36} {wall * 1e3:9.1f} {rw:7.3f} {cpu * 1e3:9.1f} "
              f"{rc:7.3f} {low * 1e3:9.1f} {rl:7.3f}  {fmt_paired(paired)}")
    kernels = _kernels.kernel_status()
    print(f"fused kernels in this process: {len(kernels)} (one per program, dtype and device;"
          " a new size never recompiles)")
    for line in dict.fromkeys(notes):
        print("  " + line)


if __name__ == "__main__":
    main()
