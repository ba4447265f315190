"""The GPU check: torchscope's CUDA paths on one GPU, in at most 8 minutes, in one table.

Each check runs in a process of its own (a crash or a hang fails that row only; the
process and what it started are stopped at its time limit), in this order:

  timing      the CUDA timing paths against CUDA events: `_timing.timed_ms` with
              `step.synchronize` around a GPU-bound workload (and without the sync, which
              times only the launches), then `profile_steps` on CUDA: kernel time per op
              and per phase, and its unprofiled step time against an event-timed step
  memory      the memory estimate (`analyze_memory`: saved activations, outputs, gradients
              and the model's state) and torchscope's own CUDA measurement against
              `torch.cuda.max_memory_allocated` around the same step, for resnet-mini and a
              Llama under bf16 autocast
  kernels     the fused kernels for CUDA float32 (AOTInductor), built once per machine
              or loaded from the cache, and checked in a child before they are used
  tests       the CUDA-marked tests (`pytest -m cuda`: every test skipped without CUDA)
  doctor      `torchscope doctor --fast` on CUDA, for resnet-mini and for a Llama from a
              `transformers` config under `--autocast bf16` (report.json read back)
  watch       benchmarks/watch_overhead.py with `--device cuda` (resnet-mini, llama-tiny):
              what watching activations and gradients costs over the bare step

The whole check stops at `--budget` seconds (480 by default): a check that would start
with too little time left is reported as not run. On a machine without CUDA it says so in
one line and exits 0. It exits 1 when a check failed.

Run: PYTHONPATH=src python benchmarks/gpu_check.py [--budget 480] [--only timing,memory]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

# A Llama from a transformers config (no download), for the doctor's command line.
LLAMA_TARGET = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=1000,
                      max_position_embeddings=256)
    ids = torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(0))
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}
'''


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    check: str
    status: str  # ok, FAILED, timeout, not run
    seconds: float
    figures: str


# ---------------------------------------------------------------------- in-process parts
def _llama(device: Any) -> tuple[Any, dict[str, Any]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=1000,
                      max_position_embeddings=256)
    ids = torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)  # (8, 128)
    return LlamaForCausalLM(cfg).to(device), {"input_ids": ids, "labels": ids}


def _resnet(device: Any) -> tuple[Any, Any]:
    import torch

    from torchscope.models import ResNetMini

    torch.manual_seed(0)
    x = torch.randn(32, 3, 64, 64, generator=torch.Generator().manual_seed(0))  # (B, C, H, W)
    return ResNetMini().to(device), x.to(device)


def part_timing() -> dict[str, Any]:
    """`timed_ms` with and without the device sync, and `profile_steps`, against events."""
    import torch

    from torchscope._timing import repeat_interleaved, timed_ms
    from torchscope.profiling import profile_steps
    from torchscope.step import Step, synchronize

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # a fixed amount of work per call
    a = torch.randn(4096, 4096, device=dev)  # (4096, 4096): 137 GFLOP per matmul

    def work() -> None:
        for _ in range(4):
            torch.mm(a, a)  # (4096, 4096), queued: nothing waits for it here

    def events_ms(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))

        return run

    for _ in range(3):
        work()
    torch.cuda.synchronize()
    synced, bare, events = repeat_interleaved(
        [timed_ms(work, lambda: synchronize(dev)), timed_ms(work), events_ms(work)],
        min_repeats=15, max_repeats=15)
    torch.cuda.synchronize()  # the launches `bare` left queued
    out: dict[str, Any] = {
        "events_ms": statistics.median(events),
        "synced_ms": statistics.median(synced),
        "unsynced_ms": statistics.median(bare),
    }

    model, x = _resnet(dev)
    y = torch.randint(0, 10, (x.shape[0],), device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = Step.of(model, x, loss_fn="cross_entropy", target=y, optimizer=opt)
    result = profile_steps(step, steps=3)
    step_events = [events_ms(step.run)() for _ in range(9)]
    out.update({
        "profile_device": result.device,
        "op_device_ms": sum(o.self_device_ms for o in result.ops),
        "phase_device_ms": {p.name: p.device_ms for p in result.phases},
        "baseline_ms": result.timing.baseline_ms,
        "step_events_ms": statistics.median(step_events),
    })
    return out


def _timing_row(r: dict[str, Any]) -> tuple[bool, str]:
    sync_ratio = r["synced_ms"] / r["events_ms"]
    launch_ratio = r["unsynced_ms"] / r["events_ms"]
    step_ratio = (r["baseline_ms"] or 0.0) / r["step_events_ms"]
    phases = r["phase_device_ms"]
    ok = (0.9 <= sync_ratio <= 1.3 and launch_ratio < 0.5 and r["profile_device"] == "cuda"
          and r["op_device_ms"] > 0 and phases.get("backward", 0) > 0
          and 0.75 <= step_ratio <= 1.35)
    return ok, (f"matmuls {r['events_ms']:.2f} ms by events; timed_ms+sync {sync_ratio:.2f}x, "
                f"without sync {launch_ratio:.2f}x (launches only); profile_steps: "
                f"{r['op_device_ms']:.1f} ms of kernels, backward {phases.get('backward', 0):.1f} "
                f"ms, step {r['baseline_ms'] or 0:.2f} ms = {step_ratio:.2f}x events")


def part_memory() -> dict[str, Any]:
    """The estimate and torchscope's measurement against `max_memory_allocated`."""
    import torch

    from torchscope.memory import analyze_memory
    from torchscope.step import Step

    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    # One model on the GPU at a time: the allocator's peak counts everything allocated.
    for name, build, autocast in (("resnet-mini", _resnet, None), ("llama bf16", _llama, "bf16")):
        model, inputs = build(dev)
        step = Step.of(model, inputs).with_autocast(autocast)
        report = analyze_memory(step, name=name)
        # The same step, measured by the allocator alone.
        step.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step.forward_backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        step.zero_grad()
        measured = report.measured
        out[name] = {"estimate": report.totals.peak_estimate, "peak": peak, "base": base,
                     "measured": measured.peak_bytes if measured is not None else None,
                     "method": measured.method if measured is not None else None}
        del model, inputs, step, report
        torch.cuda.empty_cache()
    return out


def _memory_row(r: dict[str, Any]) -> tuple[bool, str]:
    ok = True
    parts = []
    for name, m in r.items():
        est, peak, measured = m["estimate"] / m["peak"], m["peak"], m["measured"]
        agree = measured is not None and abs(measured / peak - 1) <= 0.10
        # The estimate leaves out transient buffers (unsaved intermediates, workspaces):
        # below the allocator's peak, by those.
        ok &= agree and 0.5 <= est <= 1.1 and m["method"] == "cuda-allocator"
        parts.append(f"{name}: max_memory_allocated {peak / MiB:.0f} MiB, estimate "
                     f"{est:.2f}x, torchscope's measurement "
                     + (f"{measured / peak:.3f}x" if measured is not None else "none"))
    return ok, "; ".join(parts)


def part_kernels() -> dict[str, Any]:
    """Build (or load) the fused kernels for CUDA float32 once, before the checks that use
    them: the doctor's capture and the watch benchmark then find them in the cache."""
    import torch

    from torchscope import _kernels

    for program in _kernels.PROGRAMS:  # both builds start now, side by side
        _kernels.prepare(program, torch.float32, "cuda", wait=0)
    deadline = time.monotonic() + 140
    for program in _kernels.PROGRAMS:
        _kernels.prepare(program, torch.float32, "cuda",
                         wait=max(deadline - time.monotonic(), 0.0))
    return {k.program: {"state": k.state, "backend": k.backend, "source": k.source,
                        "build_s": k.build_s, "load_s": k.load_s, "reason": k.reason}
            for k in _kernels.kernel_status() if str(k.device).startswith("cuda")}


def _kernels_row(r: dict[str, Any]) -> tuple[bool, str]:
    parts = []
    for program, k in r.items():
        how = f"built in {k['build_s']:.0f} s" if k["build_s"] is not None else \
            "from the cache" if k["source"] == "cache" else k["reason"]
        parts.append(f"{program} float32 cuda: {k['state']} ({k['backend']}, {how})")
    ok = bool(r) and all(k["state"] == "ready" for k in r.values())
    return ok, "; ".join(parts) or "no CUDA kernel was requested"


PARTS: dict[str, Callable[[], dict[str, Any]]] = {"timing": part_timing,
                                                    "memory": part_memory,
                                                    "kernels": part_kernels}
ROWS: dict[str, Callable[[dict[str, Any]], tuple[bool, str]]] = {
    "timing": _timing_row, "memory": _memory_row, "kernels": _kernels_row}


def _part_main(name: str) -> None:
    """Run one in-process part in this (child) process; its result is the last line."""
    print("RESULT " + json.dumps(PARTS[name]()), flush=True)


# ---------------------------------------------------------------------- the checks
def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p), "COLUMNS": "150"}


def _run(cmd: list[str], timeout: float, cwd: Path = ROOT
         ) -> tuple[int | None, str, str, float]:
    """(exit code or None on a timeout, stdout, stderr, seconds); on a timeout the command's
    whole process group is stopped."""
    from torchscope import _process

    t0 = time.perf_counter()
    try:
        done = _process.run(cmd, timeout=timeout, grace=3.0, env=_env(), cwd=cwd)
    except subprocess.TimeoutExpired:
        return None, "", "", time.perf_counter() - t0
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - t0


def _tail(text: str, n: int = 3) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-400:]


def check_part(name: str, timeout: float) -> Row:
    code, out, err, s = _run([sys.executable, str(Path(__file__).resolve()), "--part", name],
                             timeout)
    if code is None:
        return Row(name, "timeout", s, f"no result after {timeout:.0f} s")
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("RESULT ")), None)
    if code != 0 or line is None:
        return Row(name, "FAILED", s, f"exit {code}: {_tail(err or out)}")
    ok, figures = ROWS[name](json.loads(line.removeprefix("RESULT ")))
    return Row(name, "ok" if ok else "FAILED", s, figures)


def check_tests(timeout: float) -> Row:
    code, out, err, s = _run([sys.executable, "-m", "pytest", "-m", "cuda", "-q",
                              "-p", "no:cacheprovider", "tests"], timeout)
    if code is None:
        return Row("tests -m cuda", "timeout", s, f"no result after {timeout:.0f} s")
    summary = next((ln for ln in reversed(out.splitlines()) if ln.strip()), "")
    counts = {k: int(n) for n, k in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    figures = ", ".join(f"{n} {k}" for k, n in counts.items() if k != "deselected")
    ok = code == 0 and failed == 0 and counts.get("passed", 0) > 0
    if not ok:
        failing = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        figures += f" (exit {code}): " + (" | ".join(failing[:5]) or _tail(out + err))
    return Row("tests -m cuda", "ok" if ok else "FAILED", s, figures)


def check_doctor(label: str, target: str, extra: list[str], timeout: float) -> Row:
    with tempfile.TemporaryDirectory(prefix="torchscope-gpu-check-") as tmp:
        if target == "llama":
            Path(tmp, "llama_target.py").write_text(LLAMA_TARGET)
            target = str(Path(tmp, "llama_target.py")) + ":build"
        out_dir = Path(tmp, "report")
        code, out, err, s = _run([sys.executable, "-m", "torchscope", "doctor", target,
                                  "--device", "cuda", "--fast", "--quiet", "--out",
                                  str(out_dir), *extra], timeout, cwd=Path(tmp))
        if code is None:
            return Row(label, "timeout", s, f"no result after {timeout:.0f} s")
        report = out_dir / "report.json"
        if code != 0 or not report.exists():
            return Row(label, "FAILED", s, f"exit {code}: {_tail(err or out)}")
        doc = json.loads(report.read_text())
    sections = doc["sections"]
    statuses = [v["status"] for v in sections.values()]
    failed = [k for k, v in sections.items() if v["status"] == "failed"]
    by_severity: dict[str, int] = {}
    for f in doc["findings"]:
        by_severity[f["severity"]] = by_severity.get(f["severity"], 0) + 1
    metrics = doc["metrics"]
    step = metrics.get("profile.bare_step_ms", {}).get("value")
    peak = metrics.get("memory.peak_estimate_bytes", {}).get("value")
    on_cuda = str(doc["target"].get("device", "")).startswith("cuda")
    figures = (f"{statuses.count('ok')} sections ok, {statuses.count('skipped')} skipped"
               + (f", failed: {', '.join(failed)}" if failed else "")
               + (f"; step {step:.2f} ms" if step is not None else "")
               + (f"; peak estimate {peak / MiB:.0f} MiB" if peak is not None else "")
               + "; findings " + (", ".join(f"{n} {k}" for k, n in sorted(by_severity.items()))
                                  or "none")
               + f"; verdict: {doc.get('verdict', '?')}")
    if failed:
        figures += " | " + " | ".join(f"{k}: {sections[k]['note']}" for k in failed)
    return Row(label, "ok" if not failed and on_cuda else "FAILED", s, figures)


def check_watch(timeout: float) -> Row:
    code, out, err, s = _run([sys.executable, str(ROOT / "benchmarks" / "watch_overhead.py"),
                              "--device", "cuda", "--models", "resnet-mini,llama-tiny",
                              "--repeats", "5", "--kernel-wait", "120"], timeout)
    if code is None:
        return Row("watch_overhead", "timeout", s, f"no result after {timeout:.0f} s")
    if code != 0:
        return Row("watch_overhead", "FAILED", s, f"exit {code}: {_tail(err or out)}")
    paired: dict[tuple[str, str], str] = {}
    for line in out.splitlines():
        model, variant, rest = line[:14].strip(), line[15:51].strip(), line[52:].split()
        if len(rest) >= 7 and re.fullmatch(r"\d+\.\d+", rest[0]):
            paired[(model, variant)] = rest[6]  # the paired median ratio to bare
    want = ("acts fused", "grads fused")
    figures = "; ".join(
        f"{m}: " + ", ".join(f"{v} {paired[(m, v)]}x" for v in want if (m, v) in paired)
        for m in dict.fromkeys(m for m, _ in paired)) + " of the bare step (goals 1.05, 1.03)"
    return Row("watch_overhead", "ok" if paired else "FAILED", s,
               figures if paired else f"no table: {_tail(out)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=480.0,
                    help="seconds for the whole check (8 minutes)")
    ap.add_argument("--only", default=None,
                    help="comma-separated checks: timing, memory, kernels, tests, doctor, "
                    "watch")
    ap.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        _part_main(args.part)
        return 0

    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__} sees none); "
              "nothing to check.")
        return 0

    start = time.monotonic()
    deadline = start + args.budget
    # (name, what it is at most allowed, how to run it with a time limit)
    checks: list[tuple[str, float, Callable[[float], Row | list[Row]]]] = [
        ("timing", 90, lambda t: check_part("timing", t)),
        ("memory", 120, lambda t: check_part("memory", t)),
        ("kernels", 170, lambda t: check_part("kernels", t)),
        ("tests", 200, check_tests),
        ("doctor", 300, lambda t: [
            check_doctor("doctor resnet-mini", "resnet-mini", [], t / 2),
            check_doctor("doctor llama bf16", "llama", ["--autocast", "bf16"], t / 2)]),
        ("watch", 240, check_watch),
    ]
    only = {c.strip() for c in args.only.split(",")} if args.only else None
    rows: list[Row] = []
    for name, most, run in checks:
        if only is not None and name not in only:
            continue
        left = deadline - time.monotonic()
        if left < 30:
            rows.append(Row(name, "not run", 0.0,
                            f"the {args.budget:.0f} s budget was spent"))
            continue
        got = run(min(most, left - 5))
        rows += got if isinstance(got, list) else [got]

    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, {time.monotonic() - start:.0f} s in all")
    width = max(len(r.check) for r in rows)
    print(f"{'check':{width}}  {'result':8} {'s':>5}  figures")
    for r in rows:
        print(f"{r.check:{width}}  {r.status:8} {r.seconds:5.0f}  {r.figures}")
    return 0 if all(r.status in ("ok", "not run") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
