"""The native CPU kernels against an earlier version of their source, side by side.

Both versions of `src/torchscope/_native/reduce.cpp` (the working tree's and the one at
`--against`, by default the version before its last commit) are built the way torchscope
builds its own (`_kernels._compile_native`: -O3, -march=native, no fused multiply-add),
each under its own operator namespace, and loaded into this one process. Then:

  kernels      `stats` (with and without dead units), `norm` and one `sum` on float32
               tensors of 1, 4 and 16 MiB, each thread count, interleaved medians in µs
  steps        with `--models`: bare training steps against a watched copy per version
               (`watch_activations` on every leaf, or `watch_gradients(every=1,
               updates=False)` with `--what grads`), the watch's kernels switched to that
               version before each of its steps; interleaved medians and paired ratios

Both versions' results on a few tensors are printed too: the same bits unless the change
meant to move them.

Run: PYTHONPATH=src python benchmarks/native_ab.py [--against REV] [--kernel-threads 1,2]
     [--models resnet-narrow] [--what acts|grads] [--repeats 21] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_paired
from watch_overhead import MODELS, _batch, _loss, _model_names, _parser, fmt_paired, heap_line

from torchscope import _kernels
from torchscope.capture import watch_activations
from torchscope.grads import watch_gradients

_SOURCE = "src/torchscope/_native/reduce.cpp"
_ROOT = Path(__file__).resolve().parent.parent
_Runner = Callable[[torch.Tensor, bool], torch.Tensor]


def _git(*args: str) -> str | None:
    """A git command's output in this checkout; None where it fails."""
    done = subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def _build(label: str, source: Path, into: Path) -> Any:
    """Build `source` as torchscope does, under namespace tsab_<label>; its ops."""
    namespace = f"tsab_{label}"
    saved = _kernels._NATIVE_SOURCE
    _kernels._NATIVE_SOURCE = source  # _compile_native reads the module's source path
    try:
        error = _kernels._compile_native(into / f"{label}.so", namespace=namespace)
    finally:
        _kernels._NATIVE_SOURCE = saved
    if error is not None:
        raise SystemExit(f"building {label}: {error}")
    torch.ops.load_library(str(into / f"{label}.so"))
    return getattr(torch.ops, namespace)


def _runners(ops: Any) -> dict[tuple[str, torch.dtype, torch.device], _Runner]:
    """`_kernels._ready` entries that call `ops` the way torchscope's own runners do."""
    def stats(t: torch.Tensor, dead: bool) -> torch.Tensor:
        out: torch.Tensor = ops.stats(t, dead) if t.is_contiguous() else \
            ops.stats(_kernels._flat(t), False)
        return out

    def norm(t: torch.Tensor, _dead: bool) -> torch.Tensor:
        out: torch.Tensor = ops.norm(t if t.is_contiguous() else _kernels._flat(t))
        return out

    cpu = torch.device("cpu")
    return {("stats", torch.float32, cpu): stats, ("norm", torch.float32, cpu): norm}


def _per_call_us(fn: Callable[[], object], calls: int = 25) -> float:
    """`fn`'s mean time over `calls` calls in a row, in µs: a single call of a few µs is
    below what one timer read resolves, so the rounds interleave runs of calls instead."""
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _kernels_table(versions: dict[str, Any], threads: list[int], rounds: int) -> None:
    print("kernels: interleaved medians of", rounds, "rounds, µs per call")
    for th in threads:
        torch.set_num_threads(th)
        for mib in (1, 4, 16):
            x = torch.randn(16, 16, mib * 2**18 // 256).relu()  # (16, 16, n): mib MiB
            fns: dict[str, Callable[[], object]] = {
                f"{label} {what}": fn for label, ops in versions.items() for what, fn in (
                    ("stats", partial(ops.stats, x, False)),
                    ("stats+dead", partial(ops.stats, x, True)), ("norm", partial(ops.norm, x)))}
            fns["sum"] = x.sum
            times: dict[str, list[float]] = {k: [] for k in fns}
            for r in range(rounds):
                for k in (list(fns) if r % 2 else list(fns)[::-1]):
                    times[k].append(_per_call_us(fns[k]))
            print(f"  {th} thread(s), {mib:2d} MiB: " + ", ".join(
                f"{k} {statistics.median(v):.1f}" for k, v in times.items()))


def _same_bits(versions: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(0)
    cases = {"randn": torch.randn(300_001, generator=g),
             "ReLU (16, 16, 1024)": torch.randn(16, 16, 1024, generator=g).relu(),
             "mean 1e4": 1e4 + torch.randn(50_000, generator=g)}
    (a_label, a), (b_label, b) = versions.items()
    for name, t in cases.items():
        same = all(torch.equal(x.view(torch.int64), y.view(torch.int64)) for x, y in (
            (a.stats(t, t.dim() > 1), b.stats(t, t.dim() > 1)), (a.norm(t), b.norm(t))))
        print(f"  {name}: {a_label} and {b_label} give "
              f"{'the same bits' if same else 'different bits'}")


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor, runner: dict[Any, _Runner] | None) -> Callable[[], None]:
    """One training step of `model`; with `runner`, the watch's kernels are that version's."""
    def run() -> None:
        if runner is not None:
            _kernels._ready.update(runner)
        opt.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        opt.step()

    return run


def _steps(versions: dict[str, Any], models: list[str], args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    for p in _kernels.PROGRAMS:
        _kernels.prepare(p, torch.float32, cpu, wait=None)
    runners = {label: _runners(ops) for label, ops in versions.items()}
    for name in models:
        torch.manual_seed(0)
        base = MODELS[name]().train()
        x, y = _batch(name, args, cpu)
        names = ["bare", *versions]
        copies = {v: base if v == "bare" else copy.deepcopy(base) for v in names}
        opts = {v: torch.optim.SGD(m.parameters(), lr=1e-3) for v, m in copies.items()}

        with contextlib.ExitStack() as stack:
            for v in versions:
                stack.enter_context(
                    watch_gradients(copies[v], every=1, optimizer=opts[v], updates=False)
                    if args.what == "grads" else watch_activations(copies[v]))
            rows = interleaved_paired({v: _step(copies[v], opts[v], x, y, runners.get(v))
                                       for v in names}, repeats=args.repeats)
        bare = rows["bare"][0][0]
        for v, (t, paired) in rows.items():
            print(f"  {name:14} {args.what:6} {v:12} {t[0] * 1e3:8.1f} ms  {t[0] / bare:.3f}  "
                  f"paired {fmt_paired(paired)}")


def main() -> None:
    ap = _parser(__doc__ or "", "")
    ap.add_argument("--against", default=None, help="git revision (default: the version "
                    "before the source's last change)")
    ap.add_argument("--kernel-threads", default="1,2", help="thread counts, kernel table")
    ap.add_argument("--rounds", type=int, default=15, help="rounds of the kernel table")
    ap.add_argument("--what", choices=("acts", "grads"), default="acts")
    args = ap.parse_args()
    models = _model_names(ap, args) if args.models else []
    if args.device != "cpu" and models:
        ap.error("the native kernels are CPU kernels: run the steps with --device cpu")
    try:
        threads = [int(t) for t in args.kernel_threads.split(",")]
    except ValueError:
        ap.error(f"--kernel-threads {args.kernel_threads!r}: expected counts such as 1,2")
    if not (sys.platform.startswith("linux") and _kernels._NATIVE_SOURCE.is_file()):
        print("native kernels are built on Linux only: nothing to compare here")
        return
    # The version before the source's last change, or the one asked for, as a commit hash.
    rev = _git("rev-parse", "--verify", "--quiet", f"{args.against}^{{commit}}") \
        if args.against else _git("log", "-n", "1", "--skip", "1", "--format=%H", "--", _SOURCE)
    old_text = _git("show", f"{rev}:{_SOURCE}") if rev else None
    if rev is None or not old_text:
        ap.error(f"no earlier version of {_SOURCE} "
                 f"{'at ' + repr(args.against) if args.against else 'in git history'}: "
                 "pass --against with a commit of this checkout that holds it")
    print(f"torch {torch.__version__}; {heap_line(args)}")
    with tempfile.TemporaryDirectory() as tmp:
        old_source = Path(tmp) / "reduce_old.cpp"
        old_source.write_text(old_text)
        label = f"at_{rev[:10]}"  # a hash: a name the operator namespace takes
        versions = {label: _build(label, old_source, Path(tmp)),
                    "working_tree": _build("working_tree", _kernels._NATIVE_SOURCE, Path(tmp))}
        _same_bits(versions)
        _kernels_table(versions, threads, args.rounds)
        if models:
            _steps(versions, models, args)


if __name__ == "__main__":
    main()
