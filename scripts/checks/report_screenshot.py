"""A screenshot of a report page in Debian's chromium, as docs/report.png was made:

    python scripts/checks/report_screenshot.py runs/tiny/report.html docs/report.png [--value 0.1] [--full]

The 1280x900 viewport (or, with --full, the whole page) with VALUE typed into the format
explorer. Needs playwright (the test extra) and `apt-get install chromium`; playwright drives
the system's chromium and downloads no browser.
"""

import argparse
import shutil
from pathlib import Path

from playwright.sync_api import sync_playwright

# What works as root on a machine with no network and no GPU (tests/test_report_page.py too).
LAUNCH = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path, help="a report.html")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--value", default="0.1", help="typed into the explorer (default 0.1)")
    parser.add_argument("--full", action="store_true", help="the whole page, not the 1280x900 viewport")
    args = parser.parse_args()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium", args=LAUNCH)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(args.page.resolve().as_uri())
        page.fill("#value", args.value)
        page.screenshot(path=str(args.out), full_page=args.full)
        browser.close()
    if errors:
        raise SystemExit(f"the page logged errors: {errors}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
