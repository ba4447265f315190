"""One real full doctor run (every section, torch.compile included) shared by this module:
report.json against the schema, the compile and memory sections against their capabilities,
the model left untouched, and report.html in headless Chromium (every section and plot drawn,
no network). Then a report on a 12-layer BERT: unique ids, a table of contents, folded long
tables, and in Chromium every chart label drawn whole, inside its figure, naming a module.
The browser tests are skipped when Chromium is not installed (`make test` installs it with
apt-get when it can).
"""

from __future__ import annotations

import html as html_module
import inspect
import json
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from torchscope.doctor import DoctorOptions, DoctorReport, run_doctor, section_names
from torchscope.models import DeepMLP
from torchscope.report.document import load_schema
from torchscope.report.html import leaf_records, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The shared run compiles: keep it on one xdist worker with the other compile tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile")]
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")

PLOTS = {"activations-stats", "activations-zeros", "gradients-flow", "memory-saved",
         "memory-plans", "profile-ops", "profile-modules", "compile-speedup"}


def _chromium(tmp: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    args = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}",
            # Any request that does escape goes to a closed port, and the netlog still shows it.
            "--proxy-server=http://127.0.0.1:9", *extra, url]
    return subprocess.run(args, capture_output=True, text=True, timeout=90, check=False)


def _page_requests(netlog: Path) -> list[str]:
    """URLs requested by the page. Chromium's own services (updater, sign-in, network time)
    are tagged `initiator: not an origin` on their request; a document's loads never are."""
    log = json.loads(netlog.read_text())
    types = {v: k for k, v in log["constants"]["logSourceType"].items()}
    urls: dict[int, str] = {}
    browser: set[int] = set()
    for ev in log["events"]:
        src = ev["source"]
        if types.get(src["type"]) != "URL_REQUEST":
            continue
        params = ev.get("params", {})
        if "url" in params:
            urls.setdefault(src["id"], params["url"])
        if params.get("initiator") == "not an origin":
            browser.add(src["id"])
    return [u for i, u in urls.items() if i not in browser]


class _Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, str] = {}
        self.plots: dict[str, int] = {}
        self._plot: str | None = None
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("data-section"):
            self.sections[str(a["data-section"])] = str(a.get("data-status"))
        if tag == "figure" and a.get("data-plot"):
            self._plot = str(a["data-plot"])
            self.plots[self._plot] = 0
        elif self._plot is not None and tag in ("path", "use", "rect"):
            self.plots[self._plot] += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._plot = None


@dataclass(frozen=True)
class FullRun:
    """The shared full doctor run, and which model tensors/flags changed across it."""

    report: DoctorReport
    html: Path
    json: Path
    changed: tuple[str, ...]


def _full_run(out: Path) -> FullRun:
    torch.manual_seed(0)
    model = DeepMLP()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    # The model's own source file is linted too: torchscope's, which has no trap.
    source = inspect.getsourcefile(DeepMLP)
    assert source is not None
    report = run_doctor(model, torch.randn(32, 64), name="deep-mlp",
                        options=DoctorOptions(steps=2, compile_modes=("default",),
                                              compile_iters=5, sources=(source,)))
    html, js = write_report(report, out)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    changed += [f"{n}.grad" for n, p in model.named_parameters() if p.grad is not None]
    if [m.training for m in model.modules()] != flags:
        changed.append("training flags")
    return FullRun(report, html, js, tuple(changed))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> FullRun:
    """Every section for real on deep-mlp (it has a block sequence, so checkpoint plans are
    drawn too); compile in its default mode only, with few timed calls. Module-scoped, and
    `make test` distributes tests by file, so it runs once per test run."""
    return _full_run(tmp_path_factory.mktemp("doctor") / "report")


def test_full_run_report_json_is_schema_valid(full_run: FullRun) -> None:
    assert {o.name: o.status for o in full_run.report.outcomes} == dict.fromkeys(
        section_names(), "ok"), [(o.name, o.note) for o in full_run.report.outcomes]
    doc = json.loads(full_run.json.read_text())
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)
    assert list(doc["sections"]) == section_names()
    assert all(s["status"] == "ok" and s["data"] is not None for s in doc["sections"].values())
    assert doc["options"]["fast"] is False
    assert {f["code"].split(".")[0] for f in doc["findings"]} <= {
        "activations", "grads", "memory", "profiling", "compile"}  # no trap in the source
    assert doc["sections"]["lint"]["data"]["files"] == 1


def test_full_run_compile_section_is_the_capabilitys(full_run: FullRun) -> None:
    outcome = full_run.report.outcome("compile")
    (mode,) = outcome.data["modes"]
    assert mode["mode"] == "default" and mode["error"] == ""
    assert mode["eager_ms"] and mode["compiled_ms"] and mode["cold_s"] and mode["cold_s"] > 0
    assert mode["speedup"] == pytest.approx(mode["eager_ms"] / mode["compiled_ms"])
    # A plain Sequential of Linear/ReLU.
    assert mode["graph_breaks"] == 0 and mode["recompiles"] == 0
    assert mode["max_abs_diff"] is not None and mode["max_abs_diff"] < 1e-3
    (record,) = outcome.record.modes  # the capability's own record holds the same numbers
    assert record.speedup == mode["speedup"] and record.cold_compile_s == mode["cold_s"]
    codes = [f.code for f in outcome.findings]
    assert codes and all(c.startswith("compile.") for c in codes)
    m = outcome.metrics["compile.speedup:default"]
    assert m.value == pytest.approx(mode["speedup"]) and m.better == "higher"


def test_full_run_memory_plans_are_verified(full_run: FullRun) -> None:
    mem = full_run.report.outcome("memory").data
    plans = {p["name"]: p for p in mem["plans"]}
    assert plans["none"]["blocks"] == [] and plans["none"]["saved_bytes"] == mem["saved_bytes"]
    assert plans["all"]["blocks"] == [str(i) for i in range(8)]
    assert all(p["verified"] for name, p in plans.items() if name != "none")
    assert "memory.checkpoint_plan" in [f.code for f in full_run.report.outcome(
        "memory").findings]


def test_full_run_leaves_model_untouched(full_run: FullRun) -> None:
    # Memory, profile and gradients trained and ran backward on the very model.
    assert full_run.changed == ()


@needs_chromium
def test_chromium_renders_every_section_and_plot_without_network(full_run: FullRun,
                                                                 tmp_path: Path) -> None:
    full_report = full_run.html
    text = full_report.read_text()
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", text, re.I)
    assert not re.search(r"""url\(\s*["']?\s*(?:https?:)?//""", text, re.I)
    assert not re.search(r"@import|<script|<link\b", text, re.I)

    netlog = tmp_path / "netlog.json"
    res = _chromium(tmp_path, full_report.as_uri(), f"--log-net-log={netlog}", "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = _Dom()
    dom.feed(res.stdout)
    assert dom.sections == dict.fromkeys(section_names(), "ok")
    assert set(dom.plots) == PLOTS
    assert all(n > 5 for n in dom.plots.values()), dom.plots  # each SVG drew its marks
    assert _page_requests(netlog) == []

    shot = tmp_path / "shot.png"
    res = _chromium(tmp_path, full_report.as_uri(), f"--screenshot={shot}",
                    "--window-size=1280,3000", "--hide-scrollbars")
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    import matplotlib.image

    img = matplotlib.image.imread(str(shot))[..., :3]  # (H, W, 3) in [0, 1]
    assert img.std() > 0.05  # not a blank page
    non_white = (img.min(axis=2) < 0.9).mean()
    assert non_white > 0.02
    colours = {tuple(px) for px in (img[::7, ::7] * 255).astype(int).reshape(-1, 3).tolist()}
    assert len(colours) > 30  # text, bars, badges: many colours, not one fill


@needs_chromium
def test_netlog_check_sees_a_page_request(tmp_path: Path) -> None:
    # The detector must be able to fail: a page that loads a remote image is caught.
    page = tmp_path / "leaky.html"
    page.write_text('<html><body><img src="http://example.invalid/x.png">x</body></html>')
    netlog = tmp_path / "netlog.json"
    _chromium(tmp_path, page.as_uri(), f"--log-net-log={netlog}", "--dump-dom")
    assert any("example.invalid" in u for u in _page_requests(netlog))


# ----------------------------------------------------------------- a 12-block transformer
# The report has to hold up on a real architecture of 150+ modules (issue 12, defect 8).

MODULE_CHARTS = {"activations-stats", "activations-zeros", "gradients-flow", "memory-saved",
                 "profile-modules"}

# Measures, in the browser, every label and title of every inline SVG: its box against its
# SVG's box, its glyphs, and overlaps between labels of one figure. Appended to a copy of
# the report (the report itself runs no script).
MEASURE_JS = """
(function () {
  const box = e => { const r = e.getBoundingClientRect();
                     return {l: r.left, t: r.top, r: r.right, b: r.bottom}; };
  const within = (a, o) => a.l >= o.l - 1 && a.r <= o.r + 1 && a.t >= o.t - 1 && a.b <= o.b + 1;
  const cross = (a, o) => a.l < o.r - 0.5 && o.l < a.r - 0.5 && a.t < o.b - 0.5 && o.t < a.b - 0.5;
  const figures = [];
  for (const fig of document.querySelectorAll("figure.plot")) {
    const svg = fig.querySelector("svg"), frame = box(svg);
    const labels = [...svg.querySelectorAll('g[id*="label:"]')].map(g => ({
      text: g.id.slice(g.id.indexOf("label:") + 6), glyphs: g.querySelectorAll("use").length,
      box: box(g)}));
    const overlaps = [];
    labels.forEach((a, i) => labels.slice(i + 1).forEach(o => {
      if (cross(a.box, o.box)) overlaps.push([a.text, o.text]); }));
    figures.push({plot: fig.dataset.plot, width: frame.r - frame.l,
      outside: labels.filter(l => !within(l.box, frame)).map(l => l.text),
      labels: labels.map(l => [l.text, l.glyphs]), overlaps,
      titles: [...svg.querySelectorAll('g[id$="-title"], g[id*="-title-"]')].map(
        g => within(box(g), frame))});
  }
  const pre = document.createElement("pre");
  pre.id = "ts-measure";
  pre.textContent = JSON.stringify(figures);
  document.body.appendChild(pre);
})();
"""


@dataclass(frozen=True)
class DeepRun:
    """The doctor's report on a 12-layer BERT, and the model's module names."""

    report: DoctorReport
    html: Path
    modules: frozenset[str]


@pytest.fixture(scope="module")
def deep_run(tmp_path_factory: pytest.TempPathFactory) -> DeepRun:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=12, hidden_size=32, num_attention_heads=2,
                     intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    model = BertForSequenceClassification(cfg)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    report = run_doctor(model, {"input_ids": ids}, name="bert-12",
                        options=DoctorOptions(fast=True))
    html, _ = write_report(report, tmp_path_factory.mktemp("deep") / "report")
    return DeepRun(report, html, frozenset(n for n, _ in model.named_modules()))


class _Page(HTMLParser):
    """Every id, every in-page reference, the contents' links and the tables (rows, and
    whether they sit in a `<details>`) of a report."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.refs: list[str] = []
        self.toc: list[str] = []
        self.tables: list[tuple[int, bool]] = []
        self.cells: list[str] = []
        self.empty_plots: list[str] = []
        self._stack: list[str] = []
        self._in_toc = self._in_cell = False
        self._details = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.append(str(a["id"]))
        for key in ("href", "xlink:href"):
            if (a.get(key) or "").startswith("#"):
                self.refs.append(str(a[key])[1:])
                if self._in_toc:
                    self.toc.append(str(a[key])[1:])
        for value in a.values():
            self.refs += re.findall(r"url\(#([^)]+)\)", value or "")
        if tag == "nav" and "toc" in (a.get("class") or ""):
            self._in_toc = True
        if tag == "details":
            self._details += 1
        if tag == "table":
            self.tables.append((0, self._details > 0))
        if tag == "tr" and self.tables:
            rows, folded = self.tables[-1]
            self.tables[-1] = (rows + 1, folded)
        if tag == "td":
            self._in_cell = True
            self.cells.append("")
        if a.get("data-empty-plot"):
            self.empty_plots.append(str(a["data-empty-plot"]))

    def handle_endtag(self, tag: str) -> None:
        if tag == "nav":
            self._in_toc = False
        if tag == "details":
            self._details -= 1
        if tag == "td":
            self._in_cell = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.cells[-1] += data


def _parse(html: Path) -> _Page:
    page = _Page()
    page.feed(html.read_text())
    return page


def test_deep_report_ids_are_unique_and_every_reference_resolves(deep_run: DeepRun) -> None:
    page = _parse(deep_run.html)
    duplicates = {i: n for i, n in Counter(page.ids).items() if n > 1}
    assert duplicates == {}
    assert not [i for i in page.ids if re.search(r"\s", i)]  # an id holds no whitespace
    assert len(page.ids) > 500  # the SVGs' own ids are all there, prefixed
    assert set(page.refs) <= set(page.ids), set(page.refs) - set(page.ids)


def test_deep_report_has_contents_and_folds_long_tables(deep_run: DeepRun) -> None:
    from torchscope.report.html import SHOW_ROWS

    page = _parse(deep_run.html)
    assert {"summary", "findings"} | {f"section-{o.name}" for o in deep_run.report.outcomes} \
        <= set(page.toc)
    assert len(page.toc) > 15  # each section's plots and tables are listed too
    # No table shows more than a screenful unfolded (the header row counts as a row).
    assert all(rows <= SHOW_ROWS + 6 or folded for rows, folded in page.tables), page.tables
    assert any(folded and rows > 100 for rows, folded in page.tables)  # every module is kept
    # No module's output is exactly zero outside dropout: one line instead of a chart.
    assert page.empty_plots == ["activations-zeros"]
    text = deep_run.html.read_text()
    assert 'data-plot="activations-zeros"' not in text
    for heading in ("Per block", "Per block (backward order)", "Saved per block",
                    "Time per block"):
        assert f">{heading}</h3>" in text
    # The folded full tables name every leaf module that ran, whole.
    leaves = {r.module for r in leaf_records(deep_run.report.outcome("activations").record)}
    assert len(leaves) > 130 and leaves <= set(page.cells), leaves - set(page.cells)


def _label_text(gid_text: str) -> str:
    """The text a label draws, from its id: spaces were written `_`, repeats `~2`."""
    return re.sub(r"~\d+$", "", gid_text)


def _expected_glyphs(text: str) -> int:
    # DejaVu Sans draws "fi" and "fl" as one ligature glyph.
    return len(text) - len(re.findall("f[il]", text))


def _names_a_module(label: str, modules: frozenset[str]) -> bool:
    # `#2`: a module's third call; ` ∅`: a row with nothing to draw on a log axis.
    name = re.sub(r"(#\d+|_∅)$", "", label)
    if name.endswith(".*"):
        return name[:-2] in modules
    return name in modules or name in ("<root>", "(outside modules)")


def _measure(page: str, tmp_path: Path) -> list[dict[str, Any]]:
    """MEASURE_JS's findings on `page`, rendered by Chromium 1400 pixels wide."""
    harness = tmp_path / "measure.html"
    harness.write_text(page.replace("</body>", f"<script>{MEASURE_JS}</script></body>"))
    res = _chromium(tmp_path, harness.as_uri(), "--window-size=1400,3000", "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    found = re.search(r'<pre id="ts-measure">(.*?)</pre>', res.stdout, re.S)
    assert found, res.stdout[-2000:]
    figures: list[dict[str, Any]] = json.loads(html_module.unescape(found.group(1)))
    return figures


@needs_chromium
def test_deep_report_labels_are_whole_in_chromium(deep_run: DeepRun, tmp_path: Path) -> None:
    figures = _measure(deep_run.html.read_text(), tmp_path)
    assert {f["plot"] for f in figures} == {"activations-stats", "gradients-flow",
                                            "memory-saved", "profile-ops", "profile-modules"}
    for fig in figures:
        assert fig["labels"], fig["plot"]
        assert fig["outside"] == [], (fig["plot"], fig["outside"])  # no label cut off
        assert fig["overlaps"] == [], (fig["plot"], fig["overlaps"])
        assert fig["titles"] and all(fig["titles"]), fig["plot"]
        # Every label is drawn whole: one glyph per character of its full text.
        short = [(t, n) for t, n in fig["labels"] if n != _expected_glyphs(_label_text(t))]
        assert short == [], (fig["plot"], short)
        if fig["plot"] in MODULE_CHARTS:
            # ...and that text is a module's full name, or a block of them (`layer.3.*`).
            others = [t for t, _ in fig["labels"]
                      if not _names_a_module(_label_text(t), deep_run.modules)]
            assert others == [], (fig["plot"], others)
    stats = next(f for f in figures if f["plot"] == "activations-stats")
    assert [t for t, _ in stats["labels"] if t.startswith("bert.encoder.layer.")] == [
        f"bert.encoder.layer.{i}.*" for i in range(12)]


@needs_chromium
def test_label_check_sees_cut_and_overlapping_labels(deep_run: DeepRun, tmp_path: Path) -> None:
    # The checks must be able to fail: labels pushed out of their figure, and labels drawn
    # on top of each other, are both caught.
    page = deep_run.html.read_text()
    moved = _measure(page.replace("</style>", 'g[id*="label:"] { transform: translate(-900px, '
                                  "0); }</style>"), tmp_path)
    assert all(f["outside"] for f in moved)
    piled = _measure(page.replace("</style>", 'g[id*="label:"] > g { transform: '
                                  "translate(0, 0) scale(0.1, -0.1) !important; }</style>"),
                     tmp_path)
    assert all(f["overlaps"] for f in piled if len(f["labels"]) > 1)
