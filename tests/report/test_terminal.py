"""Terminal tables that fit their console: module names shortened from the middle, prose
folded, optional columns left out, nothing cut at its end (defect 9)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console
from rich.table import Table

from torchscope.findings import Finding, Severity
from torchscope.report.findings import findings_table
from torchscope.report.terminal import Fitted, ModuleName, Prose

NAMES = ["bert.embeddings.word_embeddings", "bert.encoder.layer.11.attention.output.dense",
         "bert.encoder.layer.3.intermediate.intermediate_act_fn", "classifier", ""]
CUT = re.compile(r"\w…(?=[\s│┃])")  # a word that ends in an ellipsis: cut at its end


def _render(renderable: object, width: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    return out.splitlines()


def _table() -> Table:
    table = Table(title="x")
    for col, justify in (("module", "left"), ("type", "left"), ("mean", "right"),
                         ("std", "right"), ("min", "right"), ("max", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name in NAMES:
        table.add_row(ModuleName(name), "BertSdpaSelfAttention", "-3.09e-05", "0.0199",
                      "-0.05611", "0.05328")
    return table


def _name_cells(lines: list[str]) -> list[str]:
    return [ln.split("│")[1].strip() for ln in lines if ln.startswith("│") and
            ln.split("│")[1].strip()]


@pytest.mark.parametrize(("width", "optional"), [(60, ("min", "max")), (80, ()), (100, ()),
                                                 (200, ())])
def test_names_keep_block_index_and_leaf_at_any_width(width: int,
                                                       optional: tuple[str, ...]) -> None:
    lines = _render(Fitted(_table(), optional=optional), width)
    assert max(map(len, lines)) <= width
    shown = _name_cells(lines)
    assert len(shown) == len(NAMES), lines
    for given, cell in zip(NAMES, shown, strict=True):
        name = given or "<root>"
        leaf = name.rsplit(".", 1)[-1]
        assert cell == name or (cell.endswith(leaf) and "…" in cell), (name, cell)
        index = [p for p in name.split(".")[:-1] if p.isdigit()]
        assert all(f"{i}." in cell or f"…{i}…" in cell for i in index), (name, cell)
    # Numbers are never folded: each one is whole on its row.
    assert sum("-3.09e-05" in ln for ln in lines) == len(NAMES)
    if width >= 200:
        assert shown == [n or "<root>" for n in NAMES]


def test_a_plain_rich_table_would_cut_the_name() -> None:
    # What Fitted is for: rich alone ends a long name in an ellipsis, losing the leaf.
    table = _table()
    for col in table.columns:
        col.overflow = "ellipsis"
    plain = Table(*[c.header for c in table.columns])
    for name in NAMES:
        plain.add_row(name, "BertSdpaSelfAttention", "-3.09e-05", "0.0199", "-0.05611",
                      "0.05328")
    assert CUT.search("\n".join(_render(plain, 80)))
    assert not CUT.search("\n".join(_render(Fitted(_table()), 80)))


def test_optional_columns_go_first_and_the_caption_says_so() -> None:
    lines = _render(Fitted(_table(), optional=("min", "max")), 60)
    text = "\n".join(lines)
    assert "min" not in lines[1] + lines[2] + lines[3] and "(min, max left out to fit 60 " \
        "columns)" in text.replace("\n", " ")
    assert max(map(len, lines)) <= 60
    wide = "\n".join(_render(Fitted(_table(), optional=("min", "max")), 200))
    assert "left out" not in wide and "-0.05611" in wide


def test_prose_shortens_dotted_names_and_folds_other_words() -> None:
    finding = Finding("profiling.top_module", Severity.INFO,
                      "bert.encoder.layer.11.attention.output.dense (Linear) is the costliest "
                      "module", {"ops": "aten::_local_scalar_dense, aten::item"},
                      fix="look at bert.encoder.layer.11.attention.output.dense first.")
    lines = _render(findings_table([("profile", finding)], verbose=True), 80)
    text = "\n".join(lines)
    assert max(map(len, lines)) <= 80
    assert not CUT.search(text)
    cells = re.findall(r"\S*…\S*", text)
    assert len(cells) == 2 and all(c.endswith("dense") and "11" in c for c in cells), cells
    # The op names are folded, not cut: every character is still there.
    squeezed = re.sub(r"[\s│┃]", "", text)
    assert "aten::_local_scalar_dense,aten::item" in squeezed


def test_prose_and_names_are_whole_when_there_is_room() -> None:
    text = "\n".join(_render(Prose(("see bert.encoder.layer.11.attention.output.dense", "")),
                             200))
    assert "bert.encoder.layer.11.attention.output.dense" in text
    assert str(ModuleName("a.b", indent=2)) == "  a.b"


def test_the_saved_table_names_what_the_model_checkpoints_itself() -> None:
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from torchscope.memory import saved_activations
    from torchscope.report.memory import saved_table

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(checkpoint(self.block, x, use_reentrant=False))
            return out

    x = torch.randn(4, 8, requires_grad=True)
    # The caption wraps at the table's width: compare words.
    text = " ".join(" ".join(_render(saved_table(saved_activations(Net(), x, loss_fn="sum")),
                                     200)).split())
    assert "Checkpointed by the model itself (their inputs count for them): block." in text
    plain = " ".join(_render(saved_table(saved_activations(nn.Linear(8, 2), x,
                                                           loss_fn="sum")), 200))
    assert "Checkpointed" not in plain


def test_a_finding_line_ends_its_summary_with_one_period() -> None:
    from torchscope.report.findings import finding_lines

    clause = Finding("memory.x", Severity.INFO, "outputs hold 41% (2.0 MiB of 4.8 MiB)", {},
                     fix="apply the plan")
    sentence = Finding("memory.y", Severity.INFO, "outputs hold 41% (2.0 MiB of 4.8 MiB).", {},
                       fix="")
    lines = finding_lines([clause, sentence])
    assert all("MiB)." in line and "MiB).." not in line for line in lines)
    assert lines[0].endswith("Fix: apply the plan[/]") and lines[1].endswith("MiB).")


def test_findings_show_their_evidence_only_when_verbose() -> None:
    finding = Finding("profiling.top_module", Severity.INFO, "fc (Linear) is the costliest "
                      "module", {"forward_ms": 1.25, "share": 0.61}, fix="nothing to do.")
    quiet = "\n".join(_render(findings_table([("profile", finding)]), 150))
    loud = "\n".join(_render(findings_table([("profile", finding)], verbose=True), 150))
    assert "costliest" in quiet and "nothing to do" in quiet
    assert "forward_ms" not in quiet and "share=" not in quiet
    assert "forward_ms=1.25" in loud and "share=0.61" in loud
