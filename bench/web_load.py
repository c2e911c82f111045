"""The fleet page's load time with 30 hosts x 2 services, in headless Chromium (prints figures).

    .venv/bin/python -m bench.web_load [--hosts 30] [--loads 20] [--screenshot PATH]

A state store is filled as the daemon would leave it after weeks of deploys (30 hosts, two
services each, ten attempts per host, some rolled back with their journal line, one host
unreachable), a real git repo gives the commit subjects, and the hub holds a rollout in
progress (waves, phases with health clocks). The page is served the way `reconcile watch`
serves it (web/app.py's serve_page: uvicorn in an asyncio loop, on 127.0.0.1) and loaded by
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
from types import SimpleNamespace

import pygit2

from reconciler.controller.store import Store
from reconciler.controller.web.hub import Hub
from reconciler.desired.spec import RolloutPolicy
from reconciler.plan.rollout import GroupKey, RolloutPlan, RolloutResult, plan_waves
from tests import browser

SERVICES = ("sglang-qwen", "vllm-qwen3-8b")
QUOTE = ("ValueError: MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer and "
         "SGLANG_ENABLE_SPEC_V2=1")
SUBJECTS = ("sglang: 0.5.12 for all GPU hosts", "vllm: raise max-num-seqs to 256", "qwen: enable MTP (3 steps)",
            "fleet: gpu-7 back from RMA", "sglang: context length 131072")


def make_repo(path: Path) -> list[str]:
    """A desired-state repo with a few commits (their subjects show on the page)."""
    repo = pygit2.init_repository(str(path), initial_head="main")
    sig = pygit2.Signature("Ops", "ops@example.invalid")
    revs: list[str] = []
    for i, subject in enumerate(SUBJECTS):
        blob = repo.create_blob(f"revision {i}\n".encode())
        tb = repo.TreeBuilder()
        tb.insert("fleet.toml", blob, pygit2.GIT_FILEMODE_BLOB)
        parents = [revs[-1]] if revs else []
        revs.append(str(repo.create_commit("HEAD", sig, sig, f"{subject}\n\nbody", tb.write(), parents)))
    return revs


def populate(state_dir: Path, repo_dir: Path, hosts: int = 30) -> Hub:
    """A store and a hub as the daemon has them mid-rollout on a fleet of `hosts` hosts."""
    revs = make_repo(repo_dir)
    old, good, new = revs[-3], revs[-2], revs[-1]
    names = [f"gpu-{i}" for i in range(1, hosts + 1)]
    store = Store(state_dir)
    for i, h in enumerate(names):
        for svc in SERVICES:
            for k in range(10):
                store.add_attempt(h, svc, revs[k % len(revs)], f"h{k}", "deploy", "Healthy", f"healthy after {40 + k}s",
                                  None, None, 40.0 + k)
            if svc == SERVICES[0] and i % 10 == 3:
                store.add_attempt(h, svc, new, "bad", "deploy", "CrashLoop", "NRestarts went from 0 to 3", QUOTE,
                                  ["starting", QUOTE], 12.5)
                store.add_attempt(h, svc, good, "h3", "rollback", "Healthy", "healthy after 61.0s", None, None, 61.0)
                store.set_status(h, svc, desired_rev=new, running_rev=good, health="healthy",
                                 last_event=f"rolled-back: {svc}: CrashLoop: rolled back to {good[:7]}", quote=QUOTE)
            elif svc == SERVICES[1] and i % 9 == 5:
                store.set_status(h, svc, desired_rev=good, running_rev=old, health="healthy",
                                 last_event=f"quarantined: {svc}: desired {good[:7]} quarantined (StartTimeout), "
                                            f"running {old[:7]}", quote="torch.OutOfMemoryError: CUDA out of memory. "
                                                                        "Tried to allocate 2.00 GiB")
            else:
                store.set_status(h, svc, desired_rev=good, running_rev=good, health="healthy",
                                 last_event="converged" if i % 4 else "in-sync")
    store.set_status(names[-1], "*", desired_rev=good, running_rev=None, health="unknown",
                     last_event="failed: Unreachable: connect to 127.0.0.99:22 timed out after 10s")
    store.close()

    hub = Hub()
    fleet = {h: SimpleNamespace(ssh=SimpleNamespace(address=f"127.0.0.{40 + i}"),
                                labels={"gpu": "h200" if i % 3 else "h100", "rack": f"r{i // 8 + 1}",
                                        **({"canary": "true"} if i == 0 else {})},
                                services=dict.fromkeys(SERVICES))
             for i, h in enumerate(names)}
    hub.run_started(new, "push", fleet, str(repo_dir))
    policy = RolloutPolicy(canary=1, max_unavailable="25%")
    labels = {h: f.labels for h, f in fleet.items()}
    waves = plan_waves(names, labels, policy, len(names))
    plan = RolloutPlan(GroupKey(SERVICES[0], "qwen"), policy, tuple(names), tuple(names), policy.bound(len(names)),
                       waves)
    ro = RolloutResult(plan, status="running", waves_done=1)
    hub.rollout("wave", ro)
    for h in waves[0].hosts:
        hub.phase(h, SERVICES[0], "healthy", 58.0, 1200)
    for j, h in enumerate(waves[1].hosts):
        hub.phase(h, SERVICES[0], "loading" if j % 2 else "healthy, stable for 30s?", 20.0 + j, 1200)
    return hub


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
    from reconciler.controller.web.app import serve_page
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
