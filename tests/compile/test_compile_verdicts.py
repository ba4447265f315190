"""The compile section's verdicts (issue 44): a speedup whose interval includes 1 is a note
that it could not be measured here, never a warning; a warning needs an interval wholly
below 1; each fact is said once; the chart and the table show the findings' numbers and
verdicts; a model Dynamo compiles nothing of says so."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from torchscope._timing import compare
from torchscope.compile import CompileReport, compile_report
from torchscope.compile._measure import _time_pairs, max_pairs
from torchscope.compile.records import ModeResult, derive_speed
from torchscope.findings import Severity, Subject

HERE = Path(__file__).parent

# Per-call seconds, interleaved as the child times them.
_EAGER = [0.0100, 0.0102, 0.0098, 0.0101, 0.0099, 0.0100, 0.0103]
_FASTER = [0.0050, 0.0051, 0.0049, 0.0050, 0.0052, 0.0050, 0.0051]
_SLOWER = [0.0130, 0.0131, 0.0129, 0.0132, 0.0130, 0.0128, 0.0131]
# As the "no measurable speedup (0.66–6.95×)": medians 1.25× apart, samples overlapping.
_NOISY_EAGER = [0.010, 0.004, 0.012, 0.011, 0.003, 0.020, 0.006]
_NOISY_COMPILED = [0.008, 0.011, 0.003, 0.009, 0.002, 0.015, 0.005]


def _mode(eager_s: list[float], compiled_s: list[float], mode: str = "default") -> ModeResult:
    """A mode as the child measures it: medians, speedup with its interval, break-even."""
    eager_ms = statistics.median(eager_s) * 1e3
    compiled_ms = statistics.median(compiled_s) * 1e3
    ratio = compare(eager_s, compiled_s)
    speedup, calls = derive_speed(eager_ms, compiled_ms, 5.0, ratio)
    return ModeResult(mode, "ok", cold_compile_s=5.0, warm_compile_s=0.5, eager_ms=eager_ms,
                      compiled_ms=compiled_ms, speedup=speedup, break_even_calls=calls,
                      iters=len(eager_s), speedup_ratio=ratio, timing_s=10.2,
                      timing_budget_s=10.0)


def _report(*modes: ModeResult, graphs: int | None = 1) -> CompileReport:
    return CompileReport("net", "(32x3x32x32)", "cpu", "forward", modes, (), graphs, 8,
                         torch.__version__)


def _by_code(report: CompileReport) -> dict[str, list[Severity]]:
    out: dict[str, list[Severity]] = {}
    for f in report.findings():
        out.setdefault(f.code, []).append(f.severity)
    return out


def test_an_interval_including_1_is_a_measurement_note_said_once() -> None:
    noisy = _mode(_NOISY_EAGER, _NOISY_COMPILED)
    assert noisy.undecided and noisy.speedup == pytest.approx(1.25)
    report = _report(noisy)
    [f] = report.findings()
    assert (f.code, f.severity, f.subject) == ("compile.no_measurable_speedup",
                                               Severity.INFO, Subject.MEASUREMENT)
    r = noisy.speedup_ratio
    assert r is not None and f"({r.low:.2f}–{r.high:.2f}×) still includes 1" in f.summary
    assert "7 calls each in 10.2 s" in f.summary and "timing budget 10 s" in f.summary
    # Two undecided modes: one note each, and no "no mode beats eager" on top of them.
    two = _report(noisy, _mode(_NOISY_EAGER, _NOISY_COMPILED, "max-autotune"))
    assert _by_code(two) == {"compile.no_measurable_speedup": [Severity.INFO] * 2}


def test_slower_is_a_warning_only_outside_the_noise_and_once_for_all_modes() -> None:
    slower = _mode(_EAGER, _SLOWER)
    assert slower.slower and slower.speedup_ratio is not None and slower.speedup_ratio.below
    assert _by_code(_report(slower)) == {"compile.never_pays_off": [Severity.WARNING]}
    # Every mode decidedly slower: one finding for them all, not one per mode beside it.
    both = _report(slower, _mode(_EAGER, _SLOWER, "max-autotune"))
    assert _by_code(both) == {"compile.no_gain": [Severity.WARNING]}
    [gain] = both.findings()
    assert "default 0.77× (0.74–0.80), max-autotune 0.77× (0.74–0.80)" in gain.summary
    # One slower, one undecided: each says its own, and nothing repeats them.
    mixed = _report(slower, _mode(_NOISY_EAGER, _NOISY_COMPILED, "max-autotune"))
    assert _by_code(mixed) == {"compile.never_pays_off": [Severity.WARNING],
                               "compile.no_measurable_speedup": [Severity.INFO]}
    # A clear speedup is silent at warning level.
    assert _by_code(_report(_mode(_EAGER, _FASTER))) == {"compile.pays_off": [Severity.INFO]}


def test_slower_is_a_note_where_the_doctor_only_offers_compiling() -> None:
    from dataclasses import replace

    slower = _mode(_EAGER, _SLOWER)
    one, both = _report(slower), _report(slower, _mode(_EAGER, _SLOWER, "max-autotune"))
    assert _by_code(replace(one, proposed=True)) == {"compile.never_pays_off": [Severity.INFO]}
    assert _by_code(replace(both, proposed=True)) == {"compile.no_gain": [Severity.INFO]}
    nothing = replace(_report(_mode(_EAGER, _FASTER), graphs=0), proposed=True)
    assert _by_code(nothing) == {"compile.nothing_compiled": [Severity.INFO]}


def test_the_chart_and_table_show_the_findings_numbers_and_verdicts() -> None:
    from matplotlib.collections import LineCollection
    from matplotlib.text import Annotation

    from torchscope.report.html import compile_fragment
    from torchscope.report.plots_doctor import compile_speedup_plot

    noisy, faster = _mode(_NOISY_EAGER, _NOISY_COMPILED), _mode(_EAGER, _FASTER, "max-autotune")
    report = _report(noisy, faster)
    fig = compile_speedup_plot(report.modes, report)
    notes = [t.get_text() for t in fig.findobj(Annotation)]
    r, q = noisy.speedup_ratio, faster.speedup_ratio
    assert r is not None and q is not None
    # The labels are `fmt_ratio`'s, as the findings write them (before they had their own
    # format: `2.00× faster (1.94–2.06)`; now `2.00× (1.94–2.06) faster`, the findings' order).
    assert notes == [f"no measurable speedup ({r.low:.2f}–{r.high:.2f}×)",
                     f"{q.value:.2f}× ({q.low:.2f}–{q.high:.2f}) faster"]
    # Each mode's interval is drawn, low to high, as the findings give it.
    [bars] = [c for c in fig.findobj(LineCollection) if len(c.get_segments()) == 2]
    spans = sorted((round(s[0][0], 6), round(s[1][0], 6)) for s in bars.get_segments())
    assert spans == sorted([(round(r.low, 6), round(r.high, 6)),
                            (round(q.low, 6), round(q.high, 6))])
    pays = next(f for f in report.findings() if f.code == "compile.pays_off")
    assert notes[1] in pays.summary
    html = compile_fragment(report, {})
    assert f"no measurable speedup ({r.low:.2f}–{r.high:.2f}×)" in html
    assert f"{noisy.speedup:.2f}×" not in html


def test_speed_labels_write_the_ratio_as_the_findings_do() -> None:
    """`speed_label` is `fmt_ratio` with the verdict: the same figures and interval as the
    findings; a ratio of under 3 samples says it has no spread (before this label showed
    its [min, max] as an interval); without a ratio, the median alone."""
    from dataclasses import replace

    from torchscope._timing import fmt_ratio
    from torchscope.report.compile import speed_label

    slower = _mode(_EAGER, _SLOWER)
    s = slower.speedup_ratio
    assert s is not None
    assert speed_label(slower) == f"{s.value:.2f}× ({s.low:.2f}–{s.high:.2f}) slower"
    assert speed_label(slower) == f"{fmt_ratio(s)} slower"
    [never] = _report(slower).findings()
    assert fmt_ratio(s) in never.summary
    two = _mode(_EAGER[:2], _FASTER[:2])
    assert two.undecided
    assert speed_label(two) == "no measurable speedup (2 sample(s): no spread)"
    bare = replace(slower, speedup_ratio=None)
    assert speed_label(bare) == f"{slower.speedup:.2f}× slower"
    assert speed_label(replace(bare, speedup=1.0)) == "no measurable speedup"
    assert speed_label(replace(slower, status="timeout")) == "—"
    assert speed_label(slower, _report(slower, graphs=0)) == "nothing compiled"


def test_nothing_compiled_is_said_and_no_timing_is_a_verdict() -> None:
    from torchscope.doctor.sections import CompileSection
    from torchscope.report.html import compile_fragment

    report = _report(_mode(_EAGER, _FASTER), graphs=0)
    assert _by_code(report) == {"compile.nothing_compiled": [Severity.WARNING]}
    assert CompileSection().to_json(report)["modes"][0]["verdict"] == "nothing compiled"
    assert "Dynamo compiled nothing" in compile_fragment(report, {})


def test_a_failed_mode_and_changed_numerics_are_said_with_their_entries() -> None:
    from dataclasses import replace

    failed = ModeResult("max-autotune", "error", error="BackendCompilerFailed: boom")
    crashed = ModeResult("default", "crashed", error="the child process died (SIGSEGV)")
    drift = replace(_mode(_EAGER, _FASTER), max_abs_diff=0.03, max_rel_diff=0.0042)
    found = {f.code: f for f in _report(failed, crashed, drift).findings()}
    assert found["compile.error"].severity == Severity.ERROR
    assert found["compile.error"].subject == Subject.ENVIRONMENT
    assert "BackendCompilerFailed: boom" in found["compile.error"].summary
    assert "SIGSEGV" in found["compile.crashed"].summary
    assert "0.42% of the largest eager value" in found["compile.numerics"].summary
    # Within rounding, the numbers are the same: no finding.
    same = replace(drift, max_rel_diff=1e-5)
    assert "compile.numerics" not in {f.code for f in _report(same).findings()}


def test_timing_goes_on_until_the_interval_decides_or_the_budget_is_spent() -> None:
    def measure(values: list[float]):  # type: ignore[no-untyped-def]
        it = iter(values * 1000)
        return lambda: next(it)

    # Decided at once: the calls asked for, no more.
    eager, compiled, _ = _time_pairs(measure(_EAGER), measure(_FASTER), 6, budget_s=60.0)
    assert len(eager) == len(compiled) == 6
    # Never decided: a budget of 0 stops at the calls asked for, a large one at the cap.
    eager, _, _ = _time_pairs(measure(_NOISY_EAGER), measure(_NOISY_COMPILED), 6, 0.0)
    assert len(eager) == 6
    eager, _, _ = _time_pairs(measure([0.01, 0.02]), measure([0.02, 0.01]), 4, 60.0)
    assert len(eager) == max_pairs(4)


@pytest.mark.slow
@pytest.mark.xdist_group("compile")
def test_a_forward_dynamo_never_compiles_is_nothing_compiled() -> None:
    from torchscope.models import load_target

    target = f"{HERE / 'compile_targets.py'}:disabled"
    loaded = load_target(target)
    report = compile_report(loaded.model, loaded.inputs, modes=("default",), iters=3,
                            warmup=1, timing_budget_s=0.0, factory=target, timeout_s=120)
    m = report.mode("default")
    assert m.status == "ok", m.error
    assert report.graph_count == 0 and m.iters == 3
    codes = {f.code for f in report.findings()}
    assert "compile.nothing_compiled" in codes
    assert not codes & {"compile.pays_off", "compile.never_pays_off",
                        "compile.no_measurable_speedup", "compile.no_gain"}
