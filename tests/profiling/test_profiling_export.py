"""Trace export, JSON summary and text rendering of a profile."""

from __future__ import annotations

import contextlib
import gzip
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from torchscope._util import to_jsonable
from torchscope.models import TinyCNN
from torchscope.profiling import profile_steps
from torchscope.profiling.module_ranges import ModuleRanges
from torchscope.report.profiling import module_table, op_table, phase_table, profile_text


def _cnn(tmp_path: Path, trace: str, **kw: object):
    model = TinyCNN()
    x = torch.randn(4, 3, 12, 12)
    y = torch.randint(0, 10, (4,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return profile_steps(model, x, loss_fn=F.cross_entropy, target=y, optimizer=opt,
                         steps=3, baseline_steps=0, trace=tmp_path / trace, **kw)


def _step_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]


def test_trace_is_json_with_module_and_phase_ranges(tmp_path: Path) -> None:
    result = _cnn(tmp_path, "trace.json", trace_steps=None)
    data = json.loads((tmp_path / "trace.json").read_text())
    assert isinstance(data["traceEvents"], list) and data["traceEvents"]
    names = {e.get("name") for e in data["traceEvents"]}
    assert {"forward", "backward", "optimizer"} <= names
    assert "nn.Module: conv1 (Conv2d)" in names
    assert len(_step_events(data)) == 3
    assert result.trace_path == str(tmp_path / "trace.json")


def test_gz_trace_is_bounded_to_last_steps(tmp_path: Path) -> None:
    _cnn(tmp_path, "trace.json.gz", trace_steps=1)
    with gzip.open(tmp_path / "trace.json.gz", "rt") as fh:
        data = json.load(fh)
    steps = _step_events(data)
    assert len(steps) == 1
    start = steps[0]["ts"]
    assert all(e.get("ph") == "M" or "ts" not in e or e["ts"] >= start
               for e in data["traceEvents"])
    assert any(e.get("ph") == "M" for e in data["traceEvents"])  # thread names survive


def test_json_summary_and_text(tmp_path: Path) -> None:
    result = _cnn(tmp_path, "t.json")
    findings = result.findings()
    payload = json.loads(json.dumps(to_jsonable({"result": result, "findings": findings})))
    mods = {m["module"]: m for m in payload["result"]["modules"]}
    assert mods["conv2"]["backward_ms"] > 0
    assert payload["result"]["timing"]["profiled_steps"] == 3
    assert {f["code"] for f in payload["findings"]} >= {"profiling.top_op"}
    text = profile_text(result, findings, by="module")
    assert "conv1" in text and "phase total" in text and "backward" in text
    ops_text = profile_text(result, findings, by="op", sort="total", limit=5)
    assert "aten::" in ops_text
    for table in (op_table(result), phase_table(result), module_table(result, limit=2)):
        assert table.row_count > 0


def test_module_ranges_close_on_exception() -> None:
    model = TinyCNN()

    def boom(_m: object, _a: object) -> None:
        raise RuntimeError("fc pre-hook fails")

    handle = model.fc.register_forward_pre_hook(boom)
    try:
        with ModuleRanges(model) as ranges, torch.profiler.profile() as prof:
            # One forward wrapper per module (hooks only where a forward cannot be wrapped).
            assert ranges.session.handle_count == len(list(model.modules()))
            with contextlib.suppress(RuntimeError):
                model(torch.randn(1, 3, 8, 8))
    finally:
        handle.remove()
    assert ranges.session.closed
    names = [e.name for e in prof.events()]
    # Every range that opened also closed: the outer model range is a complete event.
    assert names.count("nn.Module: <root> (TinyCNN)") == 1
    root = next(e for e in prof.events() if e.name == "nn.Module: <root> (TinyCNN)")
    assert root.time_range.end > root.time_range.start
    assert not model._forward_hooks and not model.conv1._forward_pre_hooks
    assert all("forward" not in m.__dict__ for m in model.modules())
