"""Graph breaks located in the user's source (torch._dynamo.explain, no inductor compile)."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from rich.console import Console
from torch import nn

from torchscope.compile import find_graph_breaks
from torchscope.compile.records import CompileReport
from torchscope.report.compile import graph_break_table

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile")]


class BreakNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        print("debug: after a")
        if x.sum() > 0:
            x = self.b(x)
        return x.relu()


def _line_of(fn: object, needle: str) -> int:
    lines, start = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return start + next(i for i, text in enumerate(lines) if needle in text)


def test_print_and_data_dependent_branch_give_two_breaks() -> None:
    scan = find_graph_breaks(BreakNet(), torch.randn(4, 8))
    assert len(scan.breaks) == 2
    assert scan.graph_count == 3
    printed, branch = scan.breaks
    assert printed.kind == "print() call"
    assert "print" in printed.explanation
    assert printed.line == _line_of(BreakNet.forward, 'print("debug')
    assert branch.kind == "data-dependent branch"
    assert branch.line == _line_of(BreakNet.forward, "if x.sum() > 0")
    for b in scan.breaks:
        assert b.file == __file__
        assert b.function == "forward"  # Dynamo's resume function is named back
        assert b.reason
        assert b.hook is None


class _Breaking(nn.Module):
    """A block that breaks the graph at every call (`.item()` of its mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        scale = h.abs().mean().item()
        return torch.relu(h) * scale


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Breaking() for _ in range(4))
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def test_identical_blocks_that_break_are_counted_as_torch_compiles_them(
        fresh_dynamo: None) -> None:
    """Four instances of one breaking block share one code object: once the break makes
    Dynamo compile the block's frame on its own, it compiles it once for all four. Each
    instance had its own private copy of the code: 8 graphs and 4 breaks, for torch's 3
    and 1 (and twice the cold compile in the measured modes)."""
    x = torch.randn(4, 16)
    scan = find_graph_breaks(_Stack(), x)
    graphs: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, _example: object) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(_Stack(), backend=counting)(x)
    assert scan.graph_count == len(graphs) == 3
    assert [b.kind for b in scan.breaks] == ["Tensor.item()"]


def test_break_inside_a_hook_names_the_hook() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    seen: list[float] = []

    def log_mean(_m: nn.Module, _i: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen.append(out.mean().item())

    handle = model[0].register_forward_hook(log_mean)
    try:
        scan = find_graph_breaks(model, torch.randn(2, 8))
    finally:
        handle.remove()
    assert seen  # explain really ran the hook
    item = [b for b in scan.breaks if b.kind == "Tensor.item()"]
    assert len(item) == 1
    assert item[0].hook == "0 forward hook log_mean"
    assert item[0].line == _line_of(log_mean, ".item()")


def test_breaks_render_and_become_findings() -> None:
    scan = find_graph_breaks(BreakNet(), torch.randn(4, 8))
    console = Console(width=200, record=True)
    console.print(graph_break_table(scan.breaks))
    text = console.export_text()
    assert f"test_compile_breaks.py:{scan.breaks[0].line}" in text
    assert "data-dependent branch" in text
    report = CompileReport("BreakNet", "(4x8)", "cpu", "forward", (), scan.breaks,
                           scan.graph_count, 8, torch.__version__)
    found = [f for f in report.findings() if f.code == "compile.graph_break"]
    assert [f.evidence["line"] for f in found] == [b.line for b in scan.breaks]
    assert all(f.fix for f in found)


def test_scan_survives_the_trip_from_the_child() -> None:
    from pathlib import Path

    from torchscope.compile._measure import MeasureJob
    from torchscope.compile.doctor import _run_child
    from torchscope.models import load_target

    target = f"{Path(__file__).parent / 'compile_targets.py'}:prints"
    loaded = load_target(target)
    assert loaded.inputs is not None
    # An unknown mode fails right after the scan: the child pays for no inductor compile.
    job = MeasureJob("no-such-mode", "forward", iters=1, warmup=0, dynamic=None, explain=True)
    payload = _run_child({"model": None, "factory": target, "inputs": loaded.inputs,
                          "job": job, "threads": 1}, timeout_s=120)
    assert payload["status"] == "error" and "no-such-mode" in payload["error"]
    scan = find_graph_breaks(loaded.model, loaded.inputs)
    assert len(scan.breaks) == 1 and scan.breaks[0].kind == "print() call"
    assert payload["scan"] == scan


_LOG = logging.getLogger("torchscope.tests.compile_breaks")


class LogsInAProperty(nn.Module):
    """As transformers 5's `loss_function`: a property whose getter logs. Dynamo cannot
    resume inside it, so the graph ends at the call in forward with the reason
    `step_unsupported`; the break itself is the logging call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    @property
    def head(self) -> nn.Module:
        _LOG.debug("looking up the head")
        return nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x).sin()
        return self.head(y)  # type: ignore[no-any-return]


def test_a_break_dynamo_cannot_resume_is_placed_where_it_happens() -> None:
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    dynamo_log = InstructionTranslatorBase.log_graph_break
    scan = find_graph_breaks(LogsInAProperty(), torch.randn(2, 8))
    assert InstructionTranslatorBase.log_graph_break is dynamo_log  # put back
    (b,) = scan.breaks
    assert (b.file, b.line, b.function) == (
        __file__, _line_of(LogsInAProperty.head.fget, "_LOG.debug"), "head")
    assert b.kind == "logging call"
    assert b.reason == "logging.Logger method not supported for non-export cases"
    assert "step_unsupported" not in b.detail
    report = CompileReport("LogsInAProperty", "(2x8)", "cpu", "forward", (), scan.breaks,
                           scan.graph_count, 8, torch.__version__)
    (finding,) = [f for f in report.findings() if f.code == "compile.graph_break"]
    assert "ignore_logging_functions" in (finding.fix or "")
