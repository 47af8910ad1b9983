"""Screenshot fxreplace's HTML pages in headless Chromium, to look at them as a reader will.

    python scripts/check_report_in_browser.py REPORT_DIR [--out SHOTS_DIR] [--width PX ...]

Writes one PNG per page found (report.html, blame.html) and window width (default 1300
and 800 px: a wide and a narrow window), each as tall as the page, and fails when Chromium
is missing, a page is absent, or a screenshot comes back empty. What to look for: the
verdict at the top, the links between the pages, the plots' legends beside the data and
their text legible at 800 px, a wide table scrolling in its own box, the repro command
where blame names an origin, the per-token table folded. Chromium on Debian:
``apt-get install -y chromium``. tests/test_report.py runs the same browser on real
reports and checks each of these on the layout Chromium computes.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from html import unescape
from pathlib import Path

PAGES = ("report.html", "blame.html")
# What page_layout.js measures once the page has loaded (images included), appended to a copy of the page.
LAYOUT_JS = Path(__file__).with_name("page_layout.js")


def find_browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def headless(browser: str, page: Path, width: int, height: int, *args: str) -> str:
    """Run headless Chromium on ``page`` in a ``width`` x ``height`` window with a fresh profile (no
    first-run state, nothing kept) and no background traffic (the machine may have no network); its
    standard output."""
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                               "--disable-background-networking", "--disable-component-update", "--disable-sync",
                               f"--user-data-dir={profile}", "--virtual-time-budget=5000",
                               f"--window-size={width},{height}", *args, page.resolve().as_uri()],
                              capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"error: Chromium failed on {page}: {done.stderr[-2000:]}")
    return done.stdout


def layout(browser: str, page: Path, width: int) -> dict:
    """What Chromium lays out of ``page`` in a window ``width`` px wide: the window's and the page's
    width and height, every image, table and text node with its box (see page_layout.js)."""
    script = f"<script>{LAYOUT_JS.read_text()}</script></body>"
    with tempfile.NamedTemporaryFile("w", dir=page.parent, prefix=".layout-", suffix=".html") as measured:
        measured.write(page.read_text().replace("</body>", script))  # beside the page: its images load
        measured.flush()
        dom = headless(browser, Path(measured.name), width, 900, "--dump-dom")
    found = re.search(r'<pre id="fxreplace-layout">(.*?)</pre>', dom, re.S)
    if found is None:
        raise SystemExit(f"error: Chromium laid out no page from {page}")
    return json.loads(unescape(found.group(1)))


def screenshot(browser: str, page: Path, png: Path, width: int) -> None:
    """A PNG of the whole page in a window ``width`` px wide (as tall as the page, no scroll bar)."""
    height = layout(browser, page, width)["height"]
    headless(browser, page, width, height, "--hide-scrollbars", f"--screenshot={png.resolve()}")
    if not png.is_file() or png.stat().st_size < 10_000:
        raise SystemExit(f"error: the screenshot of {page} is empty")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("--out", type=Path, help="folder for the PNGs (default: REPORT_DIR)")
    parser.add_argument("--width", type=int, action="append", help="window width in px, repeatable (default: 1300 and 800)")
    args = parser.parse_args()
    browser = find_browser()
    if browser is None:
        raise SystemExit("error: no Chromium found; hint: apt-get install -y chromium")
    pages = [args.report_dir / p for p in PAGES if (args.report_dir / p).is_file()]
    if not pages:
        raise SystemExit(f"error: {args.report_dir} holds neither {' nor '.join(PAGES)}")
    out = args.out or args.report_dir
    out.mkdir(parents=True, exist_ok=True)
    for page in pages:
        for width in args.width or (1300, 800):
            png = out / f"{page.stem}.{width}px.png"
            screenshot(browser, page, png, width)
            print(f"{page} at {width} px -> {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
