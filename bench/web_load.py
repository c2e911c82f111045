"""The fleet page's load time with 30 hosts x 2 services, in headless Chromium (prints figures).

    .venv/bin/python -m bench.web_load [--hosts 30] [--loads 20] [--screenshot PATH]

A state store is filled as the daemon would leave it after weeks of deploys (30 hosts, two
services each, ten attempts per host, some rolled back with their journal line, one host
unreachable), a real git repo gives the commit subjects, and the hub holds a rollout in
progress (waves, phases with health clocks). The page is served the way `reconcile watch`
serves it (web/server.py's serve_page: uvicorn in an asyncio loop, on 127.0.0.1) and loaded by
Debian's chromium through chromium-driver (Selenium): time to first byte and full load from
the browser's Navigation Timing, first (cold) load and the median / p95 of the next ones, plus
the server's own time for the HTML over plain HTTP. Loopback only; bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import statistics
import tempfile
import time
from pathlib import Path

from tests import browser
from tests.page_load import SERVICES, populate


def navigation(driver) -> dict[str, float]:
    t = driver.execute_script("const n = performance.getEntriesByType('navigation')[0]; return n.toJSON();")
    return {"ttfb": t["responseStart"] - t["startTime"], "dom": t["domContentLoadedEventEnd"] - t["startTime"],
            "load": t["loadEventEnd"] - t["startTime"], "bytes": t.get("transferSize") or 0}


def measure(url: str, loads: int, screenshot: Path | None) -> dict[str, list[dict[str, float]]]:
    why = browser.missing()
    if why:
        raise SystemExit(why)
    driver = browser.start()
    try:
        runs = []
        for _ in range(loads + 1):
            driver.get(url)
            deadline = time.monotonic() + 10
            while navigation(driver)["load"] <= 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            runs.append(navigation(driver))
        if screenshot is not None:
            browser.screenshot(driver, screenshot)
        return {"cold": runs[:1], "warm": runs[1:]}
    finally:
        driver.quit()


def server_html(host: str, port: int, n: int) -> list[float]:
    """The server's time for the whole HTML over plain HTTP (no browser): ms per request."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", "/")
        c.getresponse().read()
        c.close()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p * (len(s) - 1)))]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=30)
    ap.add_argument("--loads", type=int, default=20)
    ap.add_argument("--screenshot", type=Path)
    args = ap.parse_args()
    from reconciler.controller.web.server import serve_page
    with tempfile.TemporaryDirectory(prefix="web-load-") as tmp:
        hub = populate(Path(tmp) / "state", Path(tmp) / "repo", args.hosts)
        page = await serve_page("127.0.0.1:0", hub, Path(tmp) / "state", repo="/srv/git/fleet.git", branch="main")
        assert page is not None
        port = int(page.url.rsplit(":", 1)[1].strip("/"))
        try:
            plain = await asyncio.to_thread(server_html, "127.0.0.1", port, 50)
            got = await asyncio.to_thread(measure, page.url, args.loads, args.screenshot)
        finally:
            await page.stop(hub)
    warm = got["warm"]
    cold = got["cold"][0]
    print(f"fleet page, {args.hosts} hosts x {len(SERVICES)} services, a rollout in progress; headless chromium "
          f"on 127.0.0.1, {os.cpu_count()} CPU cores")
    print(f"  HTML: {cold['bytes'] / 1024:.0f} KiB; server, plain HTTP GET /: "
          f"median {statistics.median(plain):.1f} ms, p95 {pct(plain, 0.95):.1f} ms ({len(plain)} requests)")
    print(f"  browser, first load:       time to first byte {cold['ttfb']:.1f} ms, DOMContentLoaded "
          f"{cold['dom']:.1f} ms, load {cold['load']:.1f} ms")
    for key, what in (("ttfb", "time to first byte"), ("dom", "DOMContentLoaded"), ("load", "full load")):
        vals = [r[key] for r in warm]
        print(f"  browser, {len(warm)} loads after it: {what:<18} median {statistics.median(vals):6.1f} ms, "
              f"p95 {pct(vals, 0.95):6.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())
