"""`torchscope diff`: thresholds, an injected regression, exit codes."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchscope.cli import app
from torchscope.report.diff import ThresholdError, diff_documents, parse_thresholds

runner = CliRunner()


def _doc(**metrics: tuple[float | None, str]) -> dict:
    return {"schema": "torchscope.report", "schema_version": "1.0",
            "metrics": {k: {"value": v, "better": b, "unit": "x", "label": k}
                        for k, (v, b) in metrics.items()}}


@pytest.fixture(scope="module")
def real_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("diffbase")
    res = runner.invoke(app, ["doctor", "--fast", "--skip", "gradients,memory,profile",
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads((out / "report.json").read_text())


def _write(path: Path, doc: dict) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def test_same_report_has_no_regression(tmp_path: Path, real_report: dict) -> None:
    a = _write(tmp_path / "a.json", real_report)
    res = runner.invoke(app, ["diff", a, a])
    assert res.exit_code == 0, res.output
    assert "activations.dead_units" in res.output and "no regression" in res.output


def test_injected_regressions_exit_1(tmp_path: Path, real_report: dict) -> None:
    new = copy.deepcopy(real_report)
    # Inject what a bad commit would do: more saved bytes, a slower step, a lost speedup.
    new["metrics"]["activations.output_bytes"]["value"] *= 1.5
    new["metrics"]["activations.nonfinite_modules"]["value"] = 2
    old = copy.deepcopy(real_report)
    for doc, step, speed in ((old, 10.0, 2.0), (new, 30.0, 1.1)):
        doc["metrics"]["profile.step_ms"] = {"value": step, "better": "lower", "unit": "ms",
                                             "label": "step"}
        doc["metrics"]["compile.speedup:default"] = {"value": speed, "better": "higher",
                                                     "unit": "x", "label": "speedup"}
    res = runner.invoke(app, ["diff", _write(tmp_path / "old.json", old),
                              _write(tmp_path / "new.json", new)])
    assert res.exit_code == 1, res.output
    assert "4 regression(s)" in res.output
    for name in ("activations.output_bytes", "activations.nonfinite_modules",
                 "profile.step_ms", "compile.speedup:default"):
        assert name in res.output
    res = runner.invoke(app, ["diff", str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                              "-t", "activations.nonfinite_modules=inf%"])
    assert res.exit_code == 2  # inf% is not a valid fraction
    # A generous threshold lets the relative changes through; NaN appearing from zero does not.
    res = runner.invoke(app, ["diff", str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                              "-t", "10"])
    assert res.exit_code == 1, res.output
    assert "1 regression(s): activations.nonfinite_modules" in res.output


def test_diff_pure_function_directions_and_zero_baseline() -> None:
    old = _doc(**{"a.lower": (10.0, "lower"), "b.higher": (2.0, "higher"),
                  "c.count": (0.0, "lower"), "d.gone": (1.0, "lower")})
    new = _doc(**{"a.lower": (9.0, "lower"), "b.higher": (1.5, "higher"),
                  "c.count": (1.0, "lower"), "e.new": (1.0, "lower")})
    d = {c.name: c for c in diff_documents(old, new, parse_thresholds(["0.2"])).changes}
    assert d["a.lower"].status == "unchanged" and math.isclose(d["a.lower"].change, -0.1)
    assert d["b.higher"].status == "regressed"  # -25% of a higher-is-better metric
    assert d["c.count"].status == "regressed" and d["c.count"].change == math.inf
    assert d["d.gone"].status == "gone" and d["e.new"].status == "new"


def test_thresholds_parse_prefixes_and_percent() -> None:
    th = parse_thresholds(["profile=50%", "0.05"])
    assert th == {"": 0.05, "profile": 0.5}  # the bare number replaced every default
    assert parse_thresholds([])["profile.step_ms"] == 0.25
    with pytest.raises(ThresholdError):
        parse_thresholds(["profile=-1"])


@pytest.mark.parametrize("content", [None, "not json", json.dumps({"schema": "other"}),
                                     json.dumps({"schema": "torchscope.report",
                                                 "schema_version": "2.0", "metrics": {}}),
                                     json.dumps({"schema": "torchscope.report",
                                                 "schema_version": "1.0",
                                                 "metrics": {"a.b": 1.0}}),
                                     json.dumps({"schema": "torchscope.report",
                                                 "schema_version": "1.0",
                                                 "metrics": {"a.b": {"value": 1.0,
                                                                     "better": "up"}}})])
def test_diff_bad_input_exit_2_one_line(tmp_path: Path, content: str | None) -> None:
    good = _write(tmp_path / "good.json", _doc(**{"a.b": (1.0, "lower")}))
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    res = runner.invoke(app, ["diff", good, str(bad)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output
    assert "unexpected" not in res.output, res.output


def test_a_folder_without_a_report_and_reports_of_two_kinds_are_refused(
        tmp_path: Path, real_report: dict) -> None:
    """A folder without report.json was said not to exist; a doctor report against a run
    report compared nothing (every metric new or gone) and said 'no regression'."""
    good = _write(tmp_path / "good.json", real_report)
    (tmp_path / "empty").mkdir()
    res = runner.invoke(app, ["diff", good, str(tmp_path / "empty")])
    assert res.exit_code == 2 and "is a folder without a report.json" in res.output, res.output
    run = _write(tmp_path / "run.json", {**real_report, "kind": "run"})
    res = runner.invoke(app, ["diff", good, run])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "a doctor report" in lines[0] and "a run report" in lines[0]
    # Two reports of one kind with no metric in common say so, though rows are new/gone.
    a = _write(tmp_path / "a.json", _doc(**{"a.b": (1.0, "lower")}))
    b = _write(tmp_path / "b.json", _doc(**{"c.d": (1.0, "lower")}))
    res = runner.invoke(app, ["diff", a, b])
    assert res.exit_code == 0 and "share no metric" in res.output, res.output


def test_a_threshold_that_names_no_metric_is_refused(tmp_path: Path) -> None:
    """`-t NAME=FRAC` with a NAME no metric starts with did nothing, without a word."""
    a = _write(tmp_path / "a.json", _doc(**{"profile.step_ms": (1.0, "lower")}))
    res = runner.invoke(app, ["diff", a, a, "-t", "profile.step=25%"])
    assert res.exit_code == 0, res.output  # a prefix of a metric: fine
    res = runner.invoke(app, ["diff", a, a, "-t", "profle.step_ms=25%"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "profle.step_ms" in lines[0] and "profile.step_ms" in lines[0]


def test_a_user_prefix_beats_a_longer_default_under_it() -> None:
    """`-t profile=1000%` was ignored for profile.step_ms: the default on the longer name
    won as the longer prefix. The user's prefix covers every metric under it."""
    th = parse_thresholds(["profile=1000%"])
    assert "profile.step_ms" not in th and th["profile"] == 10.0
    old = _doc(**{"profile.step_ms": (1.8, "lower")})
    new = _doc(**{"profile.step_ms": (11.0, "lower")})
    (change,) = diff_documents(old, new, th).changes
    assert change.status == "unchanged" and change.threshold == 10.0
    # A longer name the user gave too stays the more specific one.
    both = parse_thresholds(["profile=1000%", "profile.step_ms=5%"])
    assert both["profile.step_ms"] == 0.05


def test_a_section_that_failed_in_the_new_report_is_a_regression() -> None:
    """A backward that now raises fails the gradients section: its metrics were only
    "gone", and diff said no regression (exit 0)."""
    old = _doc(**{"gradients.vanishing_ratio": (3.0, "lower"),
                  "compile.cold_s": (2.0, "lower")})
    new = _doc()
    old["sections"] = {"gradients": {"status": "ok"}, "compile": {"status": "ok"}}
    new["sections"] = {"gradients": {"status": "failed"}, "compile": {"status": "skipped"}}
    result = diff_documents(old, new)
    status = {c.name: c.status for c in result.changes}
    assert status == {"gradients.vanishing_ratio": "failed", "compile.cold_s": "gone"}
    assert [c.name for c in result.regressions] == ["gradients.vanishing_ratio"]
    assert result.notes == ("section compile is ok in old and skipped in new",
                            "section gradients is ok in old and failed in new")


def test_two_runs_of_other_setups_are_compared_with_a_note() -> None:
    old, new = _doc(**{"a.b": (1.0, "lower")}), _doc(**{"a.b": (1.0, "lower")})
    old["target"] = {"model_class": "MLP", "inputs": "(32x64)"}
    new["target"] = {"model_class": "CNN", "inputs": "(32x64)"}
    old["environment"], new["environment"] = {"cpu_threads": 2}, {"cpu_threads": 1}
    notes = diff_documents(old, new).notes
    assert notes == ("model differs: MLP in old, CNN in new",
                     "CPU threads differs: 2 in old, 1 in new")


def test_layers_cut_off_from_the_gradient_are_a_regression() -> None:
    """A stray .detach() leaves the layers below it without gradient: the ratios leave
    them out, so the vanishing ratio fell and the diff read "improved". The count of
    layers without gradient regresses from 0."""
    import torch
    from torch import nn

    from torchscope.doctor.sections import GradientsSection
    from torchscope.grads import gradient_flow

    class Detached(nn.Module):
        def __init__(self, cut: bool) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
            self.cut = cut

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 8) -> (N, 8)
            h = self.layers[1](self.layers[0](x))
            return self.layers[3](self.layers[2](h.detach() if self.cut else h))

    torch.manual_seed(0)
    docs = []
    for cut in (False, True):
        flow = gradient_flow(Detached(cut), torch.randn(4, 8), loss_fn="sum")
        metrics = GradientsSection().metrics(flow)
        docs.append({"metrics": {k: {"value": m.value, "better": m.better, "unit": m.unit,
                                     "label": m.label} for k, m in metrics.items()}})
    assert docs[0]["metrics"]["gradients.layers_without_gradient"]["value"] == 0
    assert docs[1]["metrics"]["gradients.layers_without_gradient"]["value"] == 2
    regressed = [c.name for c in diff_documents(*docs).regressions]
    assert "gradients.layers_without_gradient" in regressed


def test_a_timing_inside_its_noise_is_no_regression() -> None:
    """Two doctor runs of one model on a busy machine read 1.8 and 11 ms a step, +518%,
    and diff exited 1. With their intervals in both reports only the gap between them
    counts."""
    def timed(value: float, low: float, high: float) -> dict:
        doc = _doc(**{"profile.step_ms": (value, "lower")})
        doc["metrics"]["profile.step_ms"].update(low=low, high=high)
        return doc

    (noise,) = diff_documents(timed(1.8, 1.7, 12.0), timed(11.0, 1.6, 13.0)).changes
    assert noise.status == "unchanged" and noise.change is not None and noise.change > 5
    (slower,) = diff_documents(timed(10.0, 9.5, 10.5), timed(20.0, 19.0, 21.0)).changes
    assert slower.status == "regressed"  # 19 is 81% above 10.5, beyond 25%
    (faster,) = diff_documents(timed(20.0, 19.0, 21.0), timed(10.0, 9.5, 10.5)).changes
    assert faster.status == "improved"
    # Without an interval in both, the values alone decide, as before.
    plain = _doc(**{"profile.step_ms": (11.0, "lower")})
    (exact,) = diff_documents(timed(1.8, 1.7, 12.0), plain).changes
    assert exact.status == "regressed"


def test_the_doctor_s_step_time_is_the_plain_step_with_its_interval() -> None:
    """The step time diff compares is the step without the profiler (the baseline its
    overhead is measured against), never the profiled one, and carries its interval."""
    import statistics

    import torch
    from torch import nn

    from torchscope.doctor.sections import ProfileSection
    from torchscope.profiling import profile_steps

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    result = profile_steps(model, torch.randn(4, 8), loss_fn="sum", steps=3, baseline_steps=5,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    metrics = ProfileSection().metrics(result)
    assert "profile.step_ms" not in metrics  # the profiled step: it measures the profiler
    metric = metrics["profile.bare_step_ms"]
    samples = result.timing.baseline_samples
    assert len(samples) == 5 and metric.value == statistics.median(samples)
    assert metric.value == result.timing.baseline_ms
    assert metric.low is not None and metric.high is not None
    assert min(samples) <= metric.low <= metric.value <= metric.high <= max(samples)
    # No plain step timed: the step time is not measured, not the profiled one.
    bare = profile_steps(model, torch.randn(4, 8), loss_fn="sum", steps=2, baseline_steps=0)
    unmeasured = ProfileSection().metrics(bare)["profile.bare_step_ms"]
    assert unmeasured.value is None and unmeasured.low is None


def test_a_fast_and_a_full_doctor_run_of_one_model_are_no_regression(tmp_path: Path) -> None:
    """`diff` of a --fast against a full doctor run of mlp read +9,850 % (0.88 → 88 ms, the
    step timed under the profiler: 3 profiled steps against 5 with more overhead), "1
    regression", exit 1. The step time both compare is now the plain step, timed in
    either run (compile is skipped in both: --fast skips it, and it adds no step time)."""
    runs = {}
    for name, flags in (("fast", ["--fast"]), ("full", ["--skip", "compile"])):
        res = runner.invoke(app, ["doctor", "mlp", *flags, "--out", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        runs[name] = json.loads((tmp_path / name / "report.json").read_text())
    for doc in runs.values():
        step = doc["metrics"]["profile.bare_step_ms"]
        assert step["value"] is not None and step["low"] <= step["value"] <= step["high"]
        assert "profile.step_ms" not in doc["metrics"]
    assert runs["fast"]["options"]["fast"] and not runs["full"]["options"]["fast"]
    res = runner.invoke(app, ["diff", str(tmp_path / "fast" / "report.json"),
                              str(tmp_path / "full" / "report.json")])
    assert res.exit_code == 0, res.output
    assert "no regression" in res.output and "profile.bare_step_ms" in res.output
