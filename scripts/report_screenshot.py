"""Make docs/img/report.png, the README's picture of the HTML report, so that it stays current.

It runs the doctor as `make demo` does (the built-in tiny-cnn), into a temporary folder, then
has headless Chromium draw the top of `report.html` (the verdict and the findings):

    .venv/bin/python scripts/report_screenshot.py            # as `make demo`
    .venv/bin/python scripts/report_screenshot.py --fast     # without torch.compile

Chromium comes with `make test` where apt-get can install it (`/usr/bin/chromium`);
`--chromium PATH` names another.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img" / "report.png"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browser(given: str | None) -> str:
    for name in ((given,) if given else BROWSERS):
        found = shutil.which(name)
        if found:
            return found
    sys.exit(f"error: no headless Chromium found (looked for {', '.join(BROWSERS)}). Fix: "
             "run `make test`, which installs /usr/bin/chromium where apt-get can, or pass "
             "--chromium PATH.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="pass --fast to the doctor")
    parser.add_argument("--chromium", help="the Chromium (or Chrome) binary")
    parser.add_argument("--size", default="1280,900", help="window width,height in pixels")
    parser.add_argument("--out", default=str(OUT), help="the PNG to write")
    args = parser.parse_args()
    browser = _browser(args.chromium)
    torchscope = Path(sys.executable).with_name("torchscope")
    with tempfile.TemporaryDirectory(prefix="torchscope-shot-") as tmp:
        report = Path(tmp) / "report"
        command = [str(torchscope), "doctor", "--out", str(report),
                   *(["--fast"] if args.fast else [])]
        subprocess.run(command, check=True, cwd=ROOT)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        # --no-sandbox: Chromium refuses to start as root (a container, CI) without it.
        shot = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                f"--window-size={args.size}", f"--screenshot={os.path.abspath(args.out)}",
                (report / "report.html").resolve().as_uri()]
        subprocess.run(shot, check=True, cwd=tmp, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
