"""One real full doctor run (every section, torch.compile included) shared by this module:
report.json against the schema, the compile and memory sections against their capabilities,
the model left untouched, and report.html in headless Chromium (every section and plot drawn,
no network). The browser tests are skipped when Chromium is not installed (`make test`
installs it with apt-get when it can).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import jsonschema
import pytest
import torch

from torchscope.doctor import DoctorOptions, DoctorReport, run_doctor, section_names
from torchscope.models import DeepMLP
from torchscope.report.document import load_schema
from torchscope.report.html import write_report

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
    report = run_doctor(model, torch.randn(32, 64), name="deep-mlp",
                        options=DoctorOptions(steps=2, compile_modes=("default",),
                                              compile_iters=5))
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
        "activations", "grads", "memory", "profiling", "compile"}


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
