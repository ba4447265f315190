"""The report's charts on real models (defect 8): full module names grouped by block, a
per-block summary past `DEEP_ROWS`, nothing drawn outside the figure, no empty chart, plan
labels that cannot overlap, and inline SVGs whose ids do not clash."""

from __future__ import annotations

import re

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

from torchscope.capture import capture_activations
from torchscope.memory import analyze_memory
from torchscope.models import DeepMLP, TinyCNN
from torchscope.report.charts import DEEP_ROWS, EmptyPlot, figure_svg, label_texts
from torchscope.report.html import leaf_records
from torchscope.report.plots_doctor import activation_stats_plot, activation_zeros_plot
from torchscope.report.plots_memory import plot_memory, plot_plans


def _bert(layers: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=2,
                     intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    return BertForSequenceClassification(cfg).eval(), {"input_ids": ids}


def _all_inside(fig: Figure) -> list[str]:
    """Texts the report relies on (row labels, titles, legend entries, axis labels) drawn
    even partly outside the figure, where the SVG would cut them."""
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    texts = [*label_texts(fig), *([fig._suptitle] if fig._suptitle is not None else [])]
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax.xaxis.label, ax.yaxis.label]
        legend = ax.get_legend()
        texts += legend.get_texts() if legend is not None else []
    box = fig.bbox
    out = []
    for text in texts:
        if not text.get_visible() or not text.get_text():
            continue
        ext = text.get_window_extent(renderer)
        if ext.x0 < box.x0 - 1 or ext.x1 > box.x1 + 1 or ext.y0 < box.y0 - 1 or \
                ext.y1 > box.y1 + 1:
            out.append(text.get_text())
    return out


def _labels(fig: Figure) -> list[str]:
    return [t.get_text() for t in label_texts(fig)]


def test_a_two_layer_bert_is_charted_per_module_with_full_names_by_block() -> None:
    model, inputs = _bert(2)
    leaves = leaf_records(capture_activations(model, inputs))
    fig = activation_stats_plot(leaves)
    labels = _labels(fig)
    names = [r.module for r in leaves]
    assert len(names) <= DEEP_ROWS
    assert [n for n in labels if not n.endswith(".*")] == names  # whole, in forward order
    assert {"bert.encoder.layer.0.*", "bert.encoder.layer.1.*", "bert.embeddings.*"} <= \
        set(labels)
    assert _all_inside(fig) == []


def test_a_twelve_layer_bert_is_summarised_per_block() -> None:
    model, inputs = _bert(12)
    leaves = leaf_records(capture_activations(model, inputs))
    assert len(leaves) > DEEP_ROWS
    fig = activation_stats_plot(leaves)
    labels = _labels(fig)
    assert labels[:2] == ["bert.embeddings.*", "bert.encoder.layer.0.*"]
    assert [f"bert.encoder.layer.{i}.*" for i in range(12)] == \
        [x for x in labels if x.startswith("bert.encoder.layer.")]
    assert labels[-1] == "classifier"
    assert _all_inside(fig) == []


def test_zero_fraction_chart_is_dropped_where_nothing_is_zero() -> None:
    # A transformer in eval mode: GELU/tanh and no dropout, so no exact zeros anywhere.
    model, inputs = _bert(2)
    empty = activation_zeros_plot(leaf_records(capture_activations(model, inputs)))
    assert isinstance(empty, EmptyPlot)
    assert "no zero-fraction chart" in empty.reason and empty.axes == []
    # ReLU outputs hold zeros: the chart is drawn, only for the modules that have any.
    relu = activation_zeros_plot(leaf_records(capture_activations(
        TinyCNN(), torch.randn(8, 3, 32, 32))))
    assert not isinstance(relu, EmptyPlot)
    assert set(_labels(relu)) <= {"relu", "pool", "conv1", "conv2", "fc"} and "relu" in \
        _labels(relu)


def test_memory_plot_titles_and_plan_labels_fit() -> None:
    report = analyze_memory(DeepMLP(), torch.randn(32, 64), loss_fn="sum", checkpoint="auto",
                            budget="48KB", repeats=1)
    assert report.plans is not None and len(report.plans.plans) >= 3
    both = plot_memory(report.saved, report.plans)
    assert _all_inside(both) == []
    plans = plot_plans(report.plans)
    # Plans are named in the legend (one entry per distinct point), never at the points.
    ax = plans.axes[0]
    assert [t for t in ax.texts] == []
    entries = _labels(plans)
    named = [n for e in entries for n in e.split(":")[0].split(" = ")]
    assert sorted(named) == sorted(p.name for p in report.plans.plans)
    assert _all_inside(plans) == []


def test_inline_svgs_share_no_id() -> None:
    leaves = leaf_records(capture_activations(TinyCNN(), torch.randn(8, 3, 32, 32)))
    svgs = [figure_svg(activation_stats_plot(leaves), "svg-a"),
            figure_svg(activation_zeros_plot(leaves), "svg-b")]
    ids = [re.findall(r'\bid="([^"]+)"', s) for s in svgs]
    assert all(ids) and not set(ids[0]) & set(ids[1])
    assert all(i.startswith("svg-a-") for i in ids[0])
    for svg, own in zip(svgs, ids, strict=True):
        refs = re.findall(r'(?:href="#|url\(#)([^")]+)', svg)
        assert refs and set(refs) <= set(own)  # every reference stays inside its own SVG
        assert "<!--" not in svg and "<?xml" not in svg
    # Without a prefix, matplotlib's own ids clash between two figures.
    plain = [re.findall(r'\bid="([^"]+)"', figure_svg(activation_stats_plot(leaves)))
             for _ in range(2)]
    assert set(plain[0]) & set(plain[1])


@pytest.mark.parametrize("rows", [1, DEEP_ROWS])
def test_long_titles_wrap_inside_the_figure(rows: int) -> None:
    from torchscope.report.charts import Series, module_chart

    names = [f"encoder.layer.{i}.attention.output.dense" for i in range(rows)]
    fig = module_chart(names, [Series("x", [float(i + 1) for i in range(rows)])],
                       title="Saved activations per module " * 6, xlabel="KiB")
    assert fig.get_suptitle().count("\n") >= 1
    assert _all_inside(fig) == []


def test_the_inside_check_sees_a_clipped_title() -> None:
    # The check must be able to fail: a centred title wider than its figure is cut.
    fig = Figure(figsize=(3, 2), layout="constrained")
    fig.add_subplot().set_title("Saved activations per module (total 835.3 KiB)" * 2)
    assert _all_inside(fig) != []
