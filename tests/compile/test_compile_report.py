"""compile_report on tiny-cnn (one child process, shared by every test here)."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

from torchscope._timing import compare, fmt_ratio
from torchscope._util import to_jsonable
from torchscope.compile import CompileReport, compile_report
from torchscope.compile._measure import max_pairs
from torchscope.compile.records import ModeResult, derive_speed
from torchscope.compile.watch import recompile_limit
from torchscope.errors import CompileError
from torchscope.models import TinyCNN
from torchscope.report.compile import compile_table, recompile_table
from torchscope.step import Step

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile")]

HERE = Path(__file__).parent


# What compile_report's `progress` was called with in `tiny_run`: (line, limit_s).
_SAID: list[tuple[str, float | None]] = []


@pytest.fixture(scope="module")
def tiny_run() -> tuple[CompileReport, tuple[object, ...], tuple[object, ...]]:
    """tiny-cnn, inference, default mode, then batch 32 -> 16 -> 8 with dynamic=False; with
    the process state (environment, random generator, stance, torch.compile) around it."""
    torch.manual_seed(0)
    model, x = TinyCNN(), torch.randn(32, 3, 32, 32)
    before = _process()
    report = compile_report(model, x, modes=("default",), iters=5, warmup=1,
                            batch_sizes=(16, 8), dynamic=False, name="tiny-cnn",
                            timeout_s=500.0,
                            progress=lambda line, limit_s: _SAID.append((line, limit_s)))
    return report, before, _process()


@pytest.fixture(scope="module")
def tiny_report(tiny_run: tuple[CompileReport, object, object]) -> CompileReport:
    return tiny_run[0]


def _process() -> tuple[object, ...]:
    stance = str(torch._dynamo.eval_frame._stance.stance)  # imports Dynamo first
    return dict(os.environ), torch.get_rng_state(), stance, torch.compile


def test_child_run_leaves_this_process_as_found(
    tiny_run: tuple[CompileReport, tuple[object, ...], tuple[object, ...]],
) -> None:
    report, (env, rng, stance, compile_fn), after = tiny_run
    assert report.mode("default").isolated
    # The child's time limit is handed to the progress display as a number, with its line.
    assert _SAID == [("default: measuring in a child process (timeout 500 s)", 500.0)]
    assert after[0] == env
    assert isinstance(rng, torch.Tensor) and torch.equal(after[1], rng)  # type: ignore[arg-type]
    assert after[2] == stance and after[3] is compile_fn


def _render(obj: object) -> str:
    console = Console(width=200, record=True)
    console.print(obj)
    return console.export_text()


def test_figures_are_consistent(tiny_report: CompileReport) -> None:
    m = tiny_report.mode("default")
    assert m.status == "ok", m.error
    assert m.isolated
    assert m.eager_ms is not None and m.eager_ms > 0
    assert m.compiled_ms is not None and m.compiled_ms > 0
    assert m.speedup == pytest.approx(m.eager_ms / m.compiled_ms, rel=1e-12)
    assert m.cold_compile_s is not None and m.cold_compile_s > 0
    assert m.warm_compile_s is not None and m.warm_compile_s >= 0
    # The speedup carries its interval: the ratio of the medians, between the bounds.
    speed = m.speedup_ratio
    # 5 calls each, more while the interval included 1 and the timing budget allowed.
    assert speed is not None and speed.n_a == speed.n_b == m.iters >= 5
    assert m.timing_budget_s == 10.0 and m.timing_s is not None
    assert speed.measurable or m.timing_s >= m.timing_budget_s or m.iters == max_pairs(5)
    assert speed.value == pytest.approx(m.speedup, rel=1e-12)
    assert speed.low <= m.speedup <= speed.high
    saved_s = (m.eager_ms - m.compiled_ms) / 1e3
    if saved_s > 0 and speed.above:
        assert m.break_even_calls == math.ceil(m.cold_compile_s / saved_s)
    else:
        assert m.break_even_calls is None  # "never", or no measurable speedup to pay back
    assert (m.speedup, m.break_even_calls) == derive_speed(m.eager_ms, m.compiled_ms,
                                                           m.cold_compile_s, speed)
    assert m.faster == speed.above


def test_outputs_match_eager(tiny_report: CompileReport) -> None:
    m = tiny_report.mode("default")
    assert m.max_abs_diff is not None and m.max_abs_diff < 1e-4
    assert m.max_rel_diff is not None and m.max_rel_diff < 1e-4
    assert m.grad_max_abs_diff is None  # inference: no gradients


def test_no_graph_breaks_in_tiny_cnn(tiny_report: CompileReport) -> None:
    assert tiny_report.graph_breaks == ()
    assert tiny_report.graph_count == 1
    assert tiny_report.mode("default").graphs == 1


def test_batch_size_changes_recompile_with_guard_text(tiny_report: CompileReport) -> None:
    m = tiny_report.mode("default")
    assert [c.batch_size for c in m.shape_calls] == [16, 8]
    assert all(c.compiled for c in m.shape_calls)  # dynamic=False: each new size recompiles
    assert len(m.recompiles) == 2
    first, second = m.recompiles
    assert first.compile_id.endswith("/1") and second.compile_id.endswith("/2")
    assert "size mismatch at index 0" in first.guard
    assert "expected 32, actual 16" in first.guard
    assert "expected 16, actual 8" in second.guard
    assert first.function == "forward" and first.file.endswith("zoo.py")
    assert m.recompile_limit == recompile_limit() == torch._dynamo.config.recompile_limit
    assert not m.limit_hit
    text = _render(recompile_table(m.recompiles, m.recompile_limit))
    assert "expected 32, actual 16" in text and "limit 8" in text


def test_findings_and_table(tiny_report: CompileReport) -> None:
    m = tiny_report.mode("default")
    codes = [f.code for f in tiny_report.findings()]
    assert "compile.recompiles" in codes
    speed = m.speedup_ratio
    assert speed is not None
    assert ("compile.pays_off" in codes) == (m.break_even_calls is not None)
    # A speedup inside the noise is neither paid back nor "never pays off": not measurable.
    assert ("compile.no_measurable_speedup" in codes) == (not speed.measurable)
    assert ("compile.never_pays_off" in codes) == (
        m.break_even_calls is None and speed.measurable)
    text = _render(compile_table(tiny_report))
    # The figure as `fmt_ratio` writes it (a third digit where a bound lies near 1).
    assert (fmt_ratio(speed).split(" (")[0] if speed.measurable else "no measurable") in text
    assert "2/8" in text  # recompiles against the limit
    expected = "never" if m.break_even_calls is None else f"{m.break_even_calls:,}"
    assert expected in text


def _report_of(*modes: ModeResult) -> CompileReport:
    return CompileReport("net", "(8x16)", "cpu", "forward", modes, (), 1, 8, torch.__version__)


def _mode(eager_s: list[float], compiled_s: list[float], mode: str = "default") -> ModeResult:
    """A mode as the child measures it: interleaved samples, medians, speedup, break-even."""
    eager_ms, compiled_ms = statistics.median(eager_s) * 1e3, statistics.median(compiled_s) * 1e3
    ratio = compare(eager_s, compiled_s)
    speedup, calls = derive_speed(eager_ms, compiled_ms, 5.0, ratio)
    return ModeResult(mode, "ok", cold_compile_s=5.0, warm_compile_s=0.5, eager_ms=eager_ms,
                      compiled_ms=compiled_ms, speedup=speedup, break_even_calls=calls,
                      iters=len(eager_s), speedup_ratio=ratio)


def test_a_speedup_inside_the_noise_is_no_measurable_speedup() -> None:
    # Medians 1.25× apart, but the samples overlap: the interval includes 1.
    noisy = _mode([0.010, 0.004, 0.012, 0.011, 0.003], [0.008, 0.011, 0.003, 0.009, 0.002])
    assert noisy.speedup == pytest.approx(1.25)
    assert noisy.speedup_ratio is not None and not noisy.speedup_ratio.measurable
    assert noisy.break_even_calls is None and not noisy.faster
    report = _report_of(noisy)
    codes = [f.code for f in report.findings()]
    # One note that it could not be measured here; "no mode beats eager" would say it again.
    assert "compile.no_measurable_speedup" in codes and "compile.no_gain" not in codes
    assert "compile.pays_off" not in codes and "compile.never_pays_off" not in codes
    assert report.best is None
    text = _render(compile_table(report))
    assert "no measurable difference" in text and "1.25×" not in text
    # A clear speedup pays off, and says its interval.
    clear = _mode([0.010, 0.0101, 0.0099, 0.0102, 0.0100], [0.005, 0.0051, 0.0049, 0.005, 0.005])
    assert clear.faster and clear.break_even_calls == math.ceil(5.0 / (0.010 - 0.005))
    report = _report_of(clear)
    pays = next(f for f in report.findings() if f.code == "compile.pays_off")
    assert "2.00× (1.94–2.08) faster" in pays.summary
    assert report.best is clear


def test_modes_the_noise_cannot_tell_apart_give_the_simplest() -> None:
    # On the CPU, reduce-overhead compiles as default does (no CUDA graphs there): its
    # median read 2.13× against default's 1.91× in one run of `torchscope compile` on a
    # GPT-2, inside each other's intervals. The simplest mode is the advice then; a
    # mode measurably faster than the others still wins.
    eager = [0.0100, 0.0102, 0.0098, 0.0101, 0.0099, 0.0100, 0.0103]
    default = _mode(eager, [0.0052, 0.0050, 0.0055, 0.0049, 0.0051, 0.0053, 0.0050])
    overhead = _mode(eager, [0.0047, 0.0052, 0.0044, 0.0050, 0.0046, 0.0049, 0.0045],
                     "reduce-overhead")
    assert overhead.speedup is not None and default.speedup is not None
    assert overhead.speedup > default.speedup and overhead.faster and default.faster
    report = _report_of(overhead, default)
    assert report.best is default and report.as_fast_as_best == (overhead,)
    best = next(f for f in report.findings() if f.code == "compile.best_mode")
    assert best.summary.startswith("best mode: 'default'") and "no measurable" in best.summary
    assert best.fix == "torch.compile(model)" and best.evidence["as_fast"] == "reduce-overhead"
    autotune = _mode(eager, [0.0026, 0.0025, 0.0027, 0.0025, 0.0026, 0.0024, 0.0026],
                     "max-autotune")
    report = _report_of(default, overhead, autotune)
    assert report.best is autotune and report.as_fast_as_best == ()


def test_report_is_json_ready(tiny_report: CompileReport) -> None:
    data = json.loads(json.dumps(to_jsonable(tiny_report), allow_nan=False))
    assert data["modes"][0]["speedup"] == pytest.approx(tiny_report.modes[0].speedup)
    assert data["modes"][0]["recompiles"][0]["guard"].startswith("tensor 'x'")


def test_training_compares_gradients() -> None:
    from torchscope.models import MLP

    torch.manual_seed(0)
    model, x = MLP(), torch.randn(16, 128)
    report = compile_report(model, x, modes=("default",), measure="step", iters=3, warmup=1)
    m = report.mode("default")
    assert m.status == "ok", m.error
    assert m.isolated
    assert report.measure == "step"
    # The measured step is the shared Step: the child's eager copy ran the same loss.
    assert report.step is not None
    assert report.step.loss == "auto → cross-entropy vs seeded targets"
    assert report.step.loss_value == float(Step(model, x).forward_backward())
    assert m.grad_max_abs_diff is not None and m.grad_max_abs_diff < 1e-4
    assert m.max_abs_diff is not None and m.max_abs_diff < 1e-4
    assert m.speedup == pytest.approx(m.eager_ms / m.compiled_ms)  # type: ignore[operator]


def test_hang_is_reported_not_fatal() -> None:
    report = compile_report(TinyCNN(), torch.randn(32, 3, 32, 32), modes=("default",),
                            iters=1, timeout_s=3)
    m = report.mode("default")
    assert m.status == "timeout"
    assert "killed" in (m.error or "")
    assert "compile.timeout" in [f.code for f in report.findings()]


def test_crash_is_reported_not_fatal() -> None:
    from torchscope.models import load_target

    target = f"{HERE / 'compile_targets.py'}:crash"
    loaded = load_target(target)
    assert loaded.inputs is not None
    report = compile_report(loaded.model, loaded.inputs, modes=("default",), iters=1,
                            factory=target, timeout_s=120)
    m = report.mode("default")
    assert m.status == "crashed"
    assert "SIGSEGV" in (m.error or "")


def test_no_cpp_compiler_is_said_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    report = compile_report(TinyCNN(), torch.randn(2, 3, 8, 8), modes=("default", "max-autotune"))
    assert [m.status for m in report.modes] == ["no_compiler", "no_compiler"]
    assert "no C++ compiler" in (report.modes[0].error or "")
    assert "/nonexistent/c++" in (report.modes[0].error or "")
    assert "compile.no_compiler" in [f.code for f in report.findings()]


def test_bad_settings_raise() -> None:
    with pytest.raises(CompileError, match=r"unknown torch\.compile mode"):
        compile_report(TinyCNN(), torch.randn(2, 3, 8, 8), modes=("fastest",))
    with pytest.raises(CompileError, match="iters"):
        compile_report(TinyCNN(), torch.randn(2, 3, 8, 8), modes=("default",), iters=0)
    with pytest.raises(CompileError, match="timeout_s=0"):
        compile_report(TinyCNN(), torch.randn(2, 3, 8, 8), modes=("default",), timeout_s=0)
    inplace = TinyCNN()
    inplace.conv1.compile(backend="eager")
    with pytest.raises(CompileError, match="conv1 is already compiled"):
        compile_report(inplace, torch.randn(2, 3, 8, 8), modes=("default",))


def test_model_a_child_cannot_import_is_measured_here() -> None:
    class Local(nn.Module):  # defined in a function: no child process can import it
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).relu()

    report = compile_report(Local(), torch.randn(4, 8), modes=("default",), iters=2, warmup=0)
    m = report.mode("default")
    assert m.status == "ok", m.error
    assert not m.isolated
    assert any("in this process" in n for n in report.notes)
    assert m.speedup == pytest.approx(m.eager_ms / m.compiled_ms)  # type: ignore[operator]
    assert m.max_abs_diff is not None and m.max_abs_diff < 1e-5
