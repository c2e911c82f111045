"""End-to-end: the fleet page in a real browser (issue 14), served by `reconcile watch` while it
deploys to real hosts after a git push.

Headless Chromium (Debian's chromium + chromium-driver, Selenium; tests/browser.py) loads the
page once, before the first push. It then follows a three-wave rollout live (a host's phase
changes with no reload: server-sent events), and after a bad push the canary's crash loop,
rollback and halt, waiting for the journal line that explains it. The page is never reloaded
(a marker set in the first load is still there). The search box filters as you type; the host's
page lists the attempts. Screenshots go to the test's tmp dir; with
RECONCILER_SAVE_SCREENSHOTS=1 the final ones are also copied to bench/results/web-*.png (the
ones in the repo were made that way).
"""

from __future__ import annotations

import os
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import browser
from tests.conftest import ROOT, wait_for
from tests.e2e.test_e2e_push import Deploy, free_port
from tests.e2e.test_e2e_rollout import INCIDENT_LINE, SERVICE, SPEC_FLAGS, write_shared

pytestmark = pytest.mark.fleet
RESULTS = ROOT / "bench" / "results"


@pytest.fixture
def chrome() -> Iterator[Any]:
    why = browser.missing()
    if why:
        pytest.fail(why, pytrace=False)        # never a skip: .ci/setup installs it (CI included)
    driver = browser.start()
    yield driver
    driver.quit()


@pytest.fixture
def deploy(tmp_path: Path) -> Iterator[Deploy]:
    d = Deploy(tmp_path)
    yield d
    d.stop()


def page_up(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


def text(driver: Any, css: str) -> str:
    return driver.execute_script("const el = document.querySelector(arguments[0]); return el ? el.textContent : '';",
                                 css) or ""


def wave_phase(driver: Any, host: str) -> str:
    return " ".join(text(driver, f'#live .wave-host[data-host="{host}"] .phase').split())


@pytest.mark.timeout(240)
def test_fleet_page_follows_a_rollout_live_and_quotes_the_rolled_back_host(fleet, deploy, chrome, tmp_path):
    hosts = fleet.hosts[:3]
    canary, last = hosts[0].name, hosts[2].name
    policy = "canary = 1\nmax_unavailable = 1"             # three waves of one host
    port = free_port()
    deploy.env["RECONCILER_WEB"] = f"127.0.0.1:{port}"     # the config key, as an env override
    url = f"http://127.0.0.1:{port}/"
    shots = tmp_path / "screenshots"
    labels = {h.name: f'rack = "r{i + 1}"' for i, h in enumerate(hosts)}
    write_shared(deploy.repo, hosts, rollout=policy, load_seconds=2, labels=labels)
    deploy.start()
    wait_for("the fleet page", lambda: page_up(url), 15)

    chrome.get(url)
    chrome.execute_script("window.sameLoad = 'yes'")       # gone if the page ever reloads
    wait_for("the live connection", lambda: text(chrome, "#conn") == "live", 10)

    c1 = deploy.commit("qwen3.5 on three hosts")
    deploy.push()
    # The last wave's host, followed without a reload: waiting, then its health wait, then healthy.
    seen: list[str] = []
    mid_rollout: Path | None = None

    def follow() -> bool:
        nonlocal mid_rollout
        phase = wave_phase(chrome, last)
        if phase and (not seen or seen[-1] != phase):
            seen.append(phase)
        if mid_rollout is None and wave_phase(chrome, hosts[1].name).startswith("watching health"):
            mid_rollout = browser.screenshot(chrome, shots / "web-rollout.png")
        return phase == "healthy" and "exit 0" in text(chrome, "#live")

    wait_for(f"{last} to end healthy on the page", follow, 90, every=0.05)
    assert seen[0] in ("waiting", "deploying"), seen
    assert any(p.startswith("watching health") for p in seen), seen
    assert mid_rollout is not None
    assert chrome.execute_script("return window.sameLoad") == "yes"          # live updates, no reload
    assert int(chrome.execute_script("return document.body.dataset.updates")) > 3
    assert deploy.wait_exit_file(c1, 30) == 0
    assert text(chrome, f'#grid tr[data-host="{canary}"] td[data-service="{SERVICE}"] .badge') == "in sync"

    # A bad change: the canary crash-loops, is rolled back, the rollout halts; the page quotes why.
    write_shared(deploy.repo, hosts, args=SPEC_FLAGS, rollout=policy, load_seconds=2, labels=labels)
    c2 = deploy.commit("add MTP speculative decoding")
    deploy.push()
    wait_for("the halt and its journal line in the rollout",
             lambda: INCIDENT_LINE in text(chrome, "#live") and "halted at" in text(chrome, "#live"), 90)
    cell = f'#grid tr[data-host="{canary}"] td[data-service="{SERVICE}"]'
    wait_for("the rolled-back cell's journal line", lambda: INCIDENT_LINE in text(chrome, f"{cell} .journal"), 60)
    assert deploy.wait_exit_file(c2, 60) == 3
    assert text(chrome, f"{cell} .badge") == "rolled back"
    assert c2[:7] in text(chrome, cell) and c1[:7] in text(chrome, cell)    # desired vs running
    assert "not restarted (rollout halted)" in text(chrome, "#live")
    assert chrome.execute_script("return window.sameLoad") == "yes"
    browser.screenshot(chrome, shots / "web-rolled-back.png")

    # The filters work as you choose and type (no request, no reload): the labels came with the
    # first push, after the page loaded.
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    def shown() -> list[str]:
        return chrome.execute_script("return Array.from(document.querySelectorAll("
                                     "'#grid tr.host-row:not([hidden])'), r => r.dataset.host)")

    Select(chrome.find_element(By.CSS_SELECTOR, "#filters select[name=label]")).select_by_visible_text("rack=r2")
    wait_for("the label filter", lambda: shown() == [hosts[1].name], 5)
    Select(chrome.find_element(By.CSS_SELECTOR, "#filters select[name=label]")).select_by_index(0)
    chrome.find_element(By.CSS_SELECTOR, "#filters input[name=q]").send_keys("rolled back")
    wait_for("the search", lambda: shown() == [canary], 5)
    assert chrome.execute_script("return window.sameLoad") == "yes"

    # The canary's own page: every attempt, with the crash loop's journal line.
    chrome.get(f"{url}hosts/{canary}")
    history = text(chrome, "table.history")
    assert "CrashLoop" in history and "rollback" in history and INCIDENT_LINE in history
    browser.screenshot(chrome, shots / "web-host.png")
    chrome.set_window_size(412, 915)                          # a phone
    chrome.get(url)
    browser.screenshot(chrome, shots / "web-phone.png")

    if os.environ.get("RECONCILER_SAVE_SCREENSHOTS") == "1":
        RESULTS.mkdir(parents=True, exist_ok=True)
        for shot in sorted(shots.glob("web-*.png")):
            shutil.copyfile(shot, RESULTS / shot.name)
