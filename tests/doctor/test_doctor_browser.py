"""report.html in a real browser: headless Chromium renders every section and plot, no network.

Skipped when Chromium is not installed (`make test` installs it with apt-get when it can).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from torchscope.doctor import DoctorOptions, run_doctor, section_names, write_report
from torchscope.models import TinyCNN

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")]

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


@pytest.fixture
def full_report(fake_capabilities: None, tmp_path: Path) -> Path:
    """A report in which every section ran, so every plot kind is on the page."""
    report = run_doctor(TinyCNN(), torch.randn(8, 3, 32, 32), name="tiny-cnn",
                        options=DoctorOptions(steps=2))
    html, _ = write_report(report, tmp_path / "report")
    return html


def test_chromium_renders_every_section_and_plot_without_network(full_report: Path,
                                                                 tmp_path: Path) -> None:
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


def test_netlog_check_sees_a_page_request(tmp_path: Path) -> None:
    # The detector must be able to fail: a page that loads a remote image is caught.
    page = tmp_path / "leaky.html"
    page.write_text('<html><body><img src="http://example.invalid/x.png">x</body></html>')
    netlog = tmp_path / "netlog.json"
    _chromium(tmp_path, page.as_uri(), f"--log-net-log={netlog}", "--dump-dom")
    assert any("example.invalid" in u for u in _page_requests(netlog))
