"""Renderers of gradient flow: rich tables, PNG/SVG plots, TensorBoard event files, JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

from torchscope.grads import GradWatch, gradient_flow, watch_gradients
from torchscope.models import TinyCNN


@pytest.fixture
def watched() -> GradWatch:
    model = TinyCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4, 3, 12, 12)
    y = torch.randint(0, 10, (4,))
    with watch_gradients(model, every=2, optimizer=opt) as watch:
        for _ in range(6):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return watch


def _render(renderable: object) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_tables(watched: GradWatch) -> None:
    from torchscope.report.findings import finding_lines
    from torchscope.report.grads import grad_table, history_table, param_table

    flow = watched.last
    assert flow is not None
    text = _render(grad_table(flow))
    lines = [ln for ln in text.splitlines() if "│" in ln]
    names = [ln.split("│")[2].strip() for ln in lines]
    assert [n for n in names if n] == ["fc", "pool", "conv2", "relu", "conv1"]
    assert "weight=" in text and "bias=" in text
    assert "None (input does not require grad)" in text
    assert "total norm (as clip_grad_norm_)" in text
    assert "conv1.weight" in _render(param_table(flow))
    hist = _render(history_table(watched.history))
    assert "step 0" in hist and "step 4" in hist and "total" in hist
    assert all(ln.startswith("[") for ln in finding_lines(watched.findings()))


def test_plots_png_and_svg(watched: GradWatch, tmp_path: Path) -> None:
    from torchscope.report.plots_grads import plot_grad_heatmap, plot_gradient_flow, save_figure

    flow = watched.last
    assert flow is not None
    fig = plot_gradient_flow(flow)
    ax = fig.axes[0]
    # Horizontal rows in forward order, input side at the top; norms on a log axis.
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["conv1", "relu", "conv2", "pool", "fc"]
    png = save_figure(fig, tmp_path / "flow.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = save_figure(plot_grad_heatmap(watched.history), tmp_path / "heat.svg")
    assert b"<svg" in svg.read_bytes()[:500]
    heat = plot_grad_heatmap(watched.history, kind="params")
    assert heat.axes[0].images[0].get_array().shape == (len(watched.history.layers), 3)
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        save_figure(heat, tmp_path / "x.jpg")


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchscope.integrations.tensorboard import grad_logger, open_writer

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = open_writer(tmp_path / "run")
    samples = []

    def both(flow):
        samples.append(flow)
        grad_logger(writer)(flow)

    with watch_gradients(model, every=2, optimizer=opt, on_sample=both):
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).sum().backward()
            opt.step()
    writer.close()
    acc = EventAccumulator(str(tmp_path / "run"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"grads/total_norm", "grads/grad_output/0", "grads/params/2"} <= set(tags)
    events = acc.Scalars("grads/total_norm")
    assert [e.step for e in events] == [0, 2, 4]
    for e, flow in zip(events, samples, strict=True):
        assert math.isclose(e.value, flow.total_norm, rel_tol=1e-6)
    out = acc.Scalars("grads/grad_output/0")
    assert math.isclose(out[-1].value, samples[-1].output_norms()["0"], rel_tol=1e-6)


def test_history_to_tensorboard(watched: GradWatch, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchscope.integrations.tensorboard import log_grad_history, open_writer

    writer = open_writer(tmp_path / "h")
    n = log_grad_history(writer, watched.history)
    writer.close()
    acc = EventAccumulator(str(tmp_path / "h"))
    acc.Reload()
    assert n == sum(len(acc.Scalars(t)) for t in acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("grads/params/conv1")] == [0, 2, 4]


def test_json_roundtrip(tmp_path: Path) -> None:
    from torchscope._util import write_json

    flow = gradient_flow(TinyCNN(), torch.randn(2, 3, 8, 8), loss_fn="cross_entropy")
    data = json.loads(write_json(tmp_path / "g.json", {"flow": flow}).read_text())
    mods = data["flow"]["modules"]
    assert next(m["module"] for m in mods) == "fc"
    assert mods[-1]["grad_input"][0] == {"path": "[0]", "shape": [2, 3, 8, 8],
                                         "dtype": "torch.float32", "norm": None,
                                         "reason": "input does not require grad"}
