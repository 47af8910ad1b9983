"""Screenshot fxreplace's HTML pages in headless Chromium, to look at them as a reader will.

    python scripts/check_report_in_browser.py REPORT_DIR [--out SHOTS_DIR] [--width PX ...]

Writes one PNG per page found (report.html, blame.html) and window width (default 1300
and 800 px: a wide and a narrow window), and fails when Chromium is missing, a page is
absent, or a screenshot comes back empty. What to look for: the verdict at the top, the
links between the pages, the plots' legends beside the data and their text legible at
800 px, a wide table scrolling in its own box, the repro command where blame names an
origin, the per-token table folded. Chromium on Debian: ``apt-get install -y chromium``.
The test suite checks the same without a browser (tests/test_report.py).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PAGES = ("report.html", "blame.html")


def screenshot(browser: str, page: Path, png: Path, width: int) -> None:
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no first-run state, nothing kept
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                        "--hide-scrollbars", f"--window-size={width},2400", f"--screenshot={png}", page.resolve().as_uri()],
                       check=True, capture_output=True, timeout=120)
    if not png.is_file() or png.stat().st_size < 10_000:
        raise SystemExit(f"error: the screenshot of {page} is empty")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("--out", type=Path, help="folder for the PNGs (default: REPORT_DIR)")
    parser.add_argument("--width", type=int, action="append", help="window width in px, repeatable (default: 1300 and 800)")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
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
