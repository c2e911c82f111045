"""The fleet page's cost of a restart (issue 42 item 4): what a run measured (HostResult.costs and
.lost) reaches the store (store.remember), and each cell shows its service's last measured restart:
the unavailable seconds, the steps, and the requests its drain left in flight."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest

from reconciler import redact
from reconciler.controller.store import Store, remember
from reconciler.controller.web import hosts, view
from reconciler.controller.web.app import create_app
from reconciler.loop.results import FleetResult, HostResult
from reconciler.plan.records import Result

from .test_web import BAD, GOOD, fleet_of, lookup

with warnings.catch_warnings():     # starlette 1.x asks for httpx2 in its test client; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# what loop/cutover.py measures for one restart (step -> seconds), deliberately out of order
STEPS = {"rejoin": 0.25, "ready": 3.0, "leave": 0.05, "stop": 1.5, "drain": 2.0, "smoke": 0.4, "start": 0.0}
CELL_STEPS = "leave 0.1s, drain 2.0s, stop 1.5s, start 0.0s, ready 3.0s, smoke 0.4s, rejoin 0.2s"


@pytest.mark.parametrize(("row", "text", "steps", "lost"), [
    (None, None, None, None),
    ({"steps": STEPS, "lost": None}, "unavailable 7.2s", CELL_STEPS, None),
    ({"steps": STEPS, "lost": 0.0}, "unavailable 7.2s", CELL_STEPS, None),
    ({"steps": STEPS, "lost": 3.0}, "unavailable 7.2s", CELL_STEPS, "3 requests in flight at the drain timeout"),
    # a plain restart (no drain): stop and ready; a step this version does not know comes last
    ({"steps": {"warp": 1.0, "ready": 40.25, "stop": 2.0}, "lost": None}, "unavailable 43.2s",
     "stop 2.0s, ready 40.2s, warp 1.0s", None),
])
def test_cost_model_says_the_sum_the_steps_in_order_and_the_requests_left(row, text, steps, lost):
    now = 1_000_000.0
    full = {"host": "gpu-1", "service": "sglang", "revision": GOOD, "at": now - 125, **row} if row else None
    m = hosts.cost_model(full, lambda rev: None, now)
    if text is None:
        assert m is None
        return
    assert m == {"text": text, "steps": steps, "lost": lost,
                 "revision": {"full": GOOD, "short": GOOD[:7], "subject": "", "age": ""}, "when": "2 min"}


def test_with_costs_joins_each_status_row_to_its_own_service_and_host():
    rows = [{"host": "gpu-1", "service": "sglang"}, {"host": "gpu-1", "service": "vllm"},
            {"host": "gpu-2", "service": "sglang"}]
    cost = {"host": "gpu-1", "service": "sglang", "steps": {"stop": 1.0}}
    assert [r["cost"] for r in hosts.with_costs(rows, [cost])] == [cost, None, None]


def run_with_costs() -> FleetResult:
    """A run that restarted sglang on gpu-1 with a drain that timed out with 3 requests in
    flight, and vllm on gpu-1 without; gpu-2 was in sync (no restart, no cost)."""
    return FleetResult(BAD, False, [
        HostResult("gpu-1", "127.0.0.50", Result.CONVERGED,
                   costs={"sglang": STEPS, "vllm": {"stop": 0.5, "ready": 9.0}}, lost={"sglang": 3.0}),
        HostResult("gpu-2", "127.0.0.51", Result.IN_SYNC)])


def test_the_store_keeps_each_services_last_measured_restart(tmp_path: Path):
    s = Store(tmp_path / "s")
    remember(s, run_with_costs())
    got = {(c["host"], c["service"]): (c["revision"], c["steps"], c["lost"]) for c in s.costs()}
    assert got == {("gpu-1", "sglang"): (BAD, STEPS, 3.0), ("gpu-1", "vllm"): (BAD, {"stop": 0.5, "ready": 9.0}, None)}
    # a run that restarts nothing keeps it; the next measured restart replaces it
    remember(s, FleetResult(GOOD, False, [HostResult("gpu-1", "127.0.0.50", Result.IN_SYNC)]))
    assert len(s.costs()) == 2
    remember(s, FleetResult(GOOD, False, [HostResult("gpu-1", "127.0.0.50", Result.CONVERGED,
                                                     costs={"sglang": {"stop": 1.0}})]))
    got = {(c["host"], c["service"]): (c["revision"], c["steps"], c["lost"]) for c in s.costs()}
    assert got[("gpu-1", "sglang")] == (GOOD, {"stop": 1.0}, None)
    s.close()
    assert {c["service"] for c in Store(tmp_path / "s").costs()} == {"sglang", "vllm"}     # on disk


def cells(page: str) -> dict[tuple[str, str], str]:
    """The grid's cells by (host, service): the HTML of each."""
    out: dict[tuple[str, str], str] = {}
    for row in page.split('<tr class="host-row" data-host="')[1:]:
        host = row.split('"', 1)[0]
        for cell in row.split('data-service="')[1:]:
            svc, html = cell.split('"', 1)
            out[(host, svc)] = html.split("</td>", 1)[0]
    return out


@pytest.fixture
def page_after_a_run(tmp_path: Path):
    """The page over a store that a run with costs left (gpu-1 restarted, gpu-2 in sync)."""
    from reconciler.controller.web.hub import Hub
    s = Store(tmp_path / "state")
    for host in ("gpu-1", "gpu-2"):
        for svc in ("sglang", "vllm"):
            s.set_status(host, svc, desired_rev=BAD, running_rev=BAD, health="healthy", last_event="converged")
    remember(s, run_with_costs())
    s.close()
    hub = Hub()
    hub.run_started(BAD, "push", fleet_of(**{"gpu-1": {}, "gpu-2": {}}), None)
    with TestClient(create_app(hub, tmp_path / "state", commits=lookup), base_url="http://localhost") as c:
        yield c


def test_the_grid_shows_the_cost_of_a_restarted_host_and_none_for_one_without(page_after_a_run):
    got = cells(page_after_a_run.get("/").text)
    sglang = got[("gpu-1", "sglang")]
    assert ('<details class="cost" title="' + CELL_STEPS + '"><summary><span class="what">last restart:</span> '
            'unavailable 7.2s, <span class="tone-bad">3 requests in flight at the drain timeout</span></summary>'
            in sglang)
    assert f'<span class="steps">{CELL_STEPS}</span> · run of <code title="{BAD}">{BAD[:7]}</code>' in sglang
    vllm = got[("gpu-1", "vllm")]
    assert "last restart:</span> unavailable 9.5s</summary>" in vllm and "in flight" not in vllm
    assert "stop 0.5s, ready 9.0s" in vllm
    assert "last restart" not in got[("gpu-2", "sglang")] and "last restart" not in got[("gpu-2", "vllm")]
    # the search finds a host by its cost
    rows = page_after_a_run.get("/?q=in+flight+at+the+drain").text.split('<tr class="host-row" data-host="')[1:]
    assert {r.split('"', 1)[0]: " hidden" in r.split(">", 1)[0] for r in rows} == {"gpu-1": False, "gpu-2": True}


def test_the_host_page_shows_its_restarts_cost(page_after_a_run):
    page = page_after_a_run.get("/hosts/gpu-1").text
    assert "unavailable 7.2s" in page and "3 requests in flight at the drain timeout" in page
    assert "last restart" not in page_after_a_run.get("/hosts/gpu-2").text


def test_the_cost_is_redacted_like_the_rest_of_the_page(tmp_path: Path):
    """A step's name comes from the host's record: masked like every other text on the page."""
    secret = "S3cr3t-Step-Name-For-The-Page"
    redact.register(secret)
    try:
        m = view.redacted({"cost": hosts.cost_model(
            {"revision": GOOD, "at": time.time(), "steps": {secret: 1.0}, "lost": None}, lookup, time.time())})
        assert m["cost"]["steps"] == "*** 1.0s" and secret not in str(m)
    finally:
        redact._values.discard(secret)
