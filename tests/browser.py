"""Headless Chromium for the fleet page's browser test and benchmark.

Debian's `chromium`, driven by Debian's `chromium-driver` through Selenium (.ci/setup installs
both): nothing is downloaded, and the browser is kept on loopback (no proxy, no background
networking, no name resolution but localhost).
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"
ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-proxy-server",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
        "--disable-background-networking",
        "--disable-component-update", "--disable-default-apps", "--disable-domain-reliability",
        "--disable-extensions", "--disable-sync", "--no-first-run", "--no-default-browser-check", "--no-pings")


def missing() -> str | None:
    """Why the browser cannot start here, or None."""
    absent = [p for p in (CHROMIUM, DRIVER) if not shutil.which(p)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        absent.append("selenium (the test extras)")
    if absent:
        return (f"headless Chromium is not installed ({', '.join(absent)} missing): run .ci/setup as root "
                f"(Debian packages chromium chromium-driver, pip extras [test])")
    return None


def start(width: int = 1400, height: int = 1000) -> Any:
    """A headless Chromium session (selenium.webdriver.Chrome)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (*ARGS, f"--window-size={width},{height}"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(DRIVER), options=opts)


def screenshot(driver: Any, path: Path) -> Path:
    """The whole page, not only the window (Chromium's DevTools protocol)."""
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))
    return path
