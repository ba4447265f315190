"""report.html's own formatting: long tables fold, and a tied parameter is named in the
gradient table (GPT-2's `lm_head.weight` is `transformer.wte.weight`)."""

from __future__ import annotations

import dataclasses
import html
import re

import pytest
import torch

from torchscope.grads import gradient_flow
from torchscope.grads.records import ParamGradRecord
from torchscope.report.html import SHOW_ROWS, gradients_fragment, table


def test_a_long_table_shows_a_screenful_and_folds_the_rest() -> None:
    rows = [(f"layer.{i}", i) for i in range(SHOW_ROWS + 30)]
    html = table(("module", "n"), rows, numeric=(1,))
    shown, folded = html.split("<details>")
    assert shown.count("<tr>") == SHOW_ROWS + 1  # and the header row
    assert "<summary>30 more rows</summary>" in folded and folded.count("<tr>") == 30 + 1
    assert all(f"<td>layer.{i}</td>" in html for i in range(SHOW_ROWS + 30))
    short = table(("module", "n"), rows[:SHOW_ROWS + 5])
    assert "<details>" not in short
    whole = table(("module", "n"), rows[:3], folded="All 3 modules")
    assert whole.startswith("<details><summary>All 3 modules</summary><table>")


@pytest.mark.skipif("tied_to" not in {f.name for f in dataclasses.fields(ParamGradRecord)},
                    reason="the gradient records do not name tied parameters yet")
def test_gpt2_tied_weights_are_named_in_the_gradient_table(tiny_gpt2: torch.nn.Module) -> None:
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    html = gradients_fragment(gradient_flow(tiny_gpt2, {"input_ids": ids}), {})
    head = re.search(r"<tr><td>lm_head</td>.*?</tr>", html)
    wte = re.search(r"<tr><td>transformer\.wte</td>.*?</tr>", html)
    assert head and "weight tied to transformer.wte.weight" in head.group(0)
    assert wte and "weight tied to lm_head.weight" in wte.group(0)


def _contents(page: str) -> dict[str, list[tuple[str, str]]]:
    """The contents' entries of each section: (target id, title) under its link."""
    nav = re.search(r'<nav class="toc".*?</nav>', page, re.S)
    assert nav is not None
    out: dict[str, list[tuple[str, str]]] = {}
    for sec, sub in re.findall(r'<li><a href="#section-([^"]+)">.*?</a>(?:<ol>(.*?)</ol>)?</li>',
                               nav.group(0), re.S):
        out[sec] = re.findall(r'<a href="#([^"]+)">(.*?)</a>', sub)
    return out


def test_the_contents_name_each_entry_of_a_section_once() -> None:
    """A real doctor report of deep-mlp (plans and per-module times): the contents listed
    "Top ops" and "Time per module" twice under Time, and "Checkpoint plans" twice under
    Memory (a plot and the table under it share the title). Each title is listed once,
    linking to its first place, and every id on the page stays unique."""
    from collections import Counter

    from torchscope.doctor import DoctorOptions, run_doctor
    from torchscope.models.zoo import BUILTINS
    from torchscope.report.html import render_report
    from torchscope.report.profiling import timing_line

    spec = BUILTINS["deep-mlp"]
    report = run_doctor(spec.build(), spec.example_input(),
                        options=DoctorOptions(skip=frozenset({"compile", "lint"}), steps=2),
                        name="deep-mlp")
    page = render_report(report)
    contents = _contents(page)
    assert {"profile", "memory"} <= set(contents)
    for sec, entries in contents.items():
        titles = [t for _, t in entries]
        assert len(titles) == len(set(titles)), (sec, titles)
    time_titles = [t for _, t in contents["profile"]]
    assert {"Phases", "Top ops", "Time per module"} <= set(time_titles)
    assert "Checkpoint plans" in [t for _, t in contents["memory"]]
    # Each entry links to the first place its title heads: the plot before the table.
    first = {t: a for a, t in contents["profile"]}
    assert page.index(f'id="{first["Top ops"]}"') < page.index(">Top ops</h3>")
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert [i for i, n in Counter(ids).items() if n > 1] == []
    assert all(f'id="{a}"' in page for es in contents.values() for a, _ in es)
    # The Time section leads with the plain step (the one diff compares), then the
    # profiled one, and its note says what the profiler cost.
    line = timing_line(report.outcome("profile").record)
    assert " ms (" in line and "without profiler" in line and html.escape(line) in page
    assert page.index("step without profiler (median)") < page.index("step profiled (median)")
    _verdict_first_and_codes_explained(report, page)


def _verdict_first_and_codes_explained(report: object, page: str) -> None:
    """The page leads with the verdict report.json has, and every code in the findings
    links to its catalogue entry on the same page (the page explains itself offline)."""
    from torchscope.findings import declared
    from torchscope.report.document import build_document

    doc = build_document(report)  # type: ignore[arg-type]
    assert f"<p data-verdict>{html.escape(doc['verdict'])}</p>" in page
    assert page.index('id="verdict"') < page.index('id="summary"') < page.index('id="findings"')
    codes = {f["code"] for f in doc["findings"]}
    assert codes, "deep-mlp's report has findings to explain"
    for code in codes:
        assert f'<a href="#code-{code}"><code>{code}</code></a>' in page
        entry = re.search(rf'<div class="code-entry" id="code-{re.escape(code)}">(.*?)</div>',
                          page, re.S)
        assert entry is not None, code
        assert html.escape(declared(code).meaning) in entry.group(1)
