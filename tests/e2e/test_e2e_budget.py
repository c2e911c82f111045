"""End-to-end: a budget that cannot be kept (issue 42, BudgetBlocked) on real hosts, and the
fleet page's cost of a real drained rollout.

The rig of tests/e2e/test_e2e_drain.py (Debian's HAProxy with its runtime API on the controller,
the stand-in playing vLLM, a bounded load through the balancer and a sampler of the servers it
sends traffic to, every 100 ms), with the model on two test hosts and a third member of its
group that is down (an address where no host answers). With min_available = 2, a flag change
can restart neither live host without leaving one: the rollout is blocked before its first
wave. The run says which hosts wait and why (BudgetBlocked, naming the host that is down),
restarts nothing (each unit's invocation is the one before the run, its record is the first
revision's), the clients see no failure and HAProxy never has fewer than 2 servers; the dry
run foresees the same.

After a drained rollout on the two hosts, the fleet page over that run's state store shows each
host's cost as the run measured it (the steps, their sum), and no requests left in flight.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from reconciler.controller.web.app import create_app
from reconciler.controller.web.hub import Hub
from tests import balancer
from tests import fleet as fleetlib
from tests.conftest import FLEET_FIRST, FLEET_SIZE, DesiredRepo, Fleet, run_cli, run_json, wait_for
from tests.controller.test_web_cost import cells
from tests.e2e.test_e2e_drain import PORT, SERVICE, under_load, write

with warnings.catch_warnings():     # starlette 1.x asks for httpx2 in its test client; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

GHOST = "ghost"
# After the balancer's address (FLEET_FIRST + FLEET_SIZE), in this fleet's own range: nothing listens there
GHOST_ADDRESS = f"127.0.0.{FLEET_FIRST + FLEET_SIZE + 1}"


lb_host, lb = balancer.fixtures(3, PORT)


def with_ghost(repo: DesiredRepo) -> None:
    """The group's third member: declared, down (nothing answers at its address)."""
    repo.write(f"hosts/{GHOST}.toml", f'address = "{GHOST_ADDRESS}"\n\n[services.{SERVICE}]\nuse = "model"\n')


def test_a_budget_that_hosts_down_cannot_keep_blocks_the_rollout_and_restarts_nothing(
        fleet: Fleet, repo: DesiredRepo, lb: balancer.Balancer) -> None:
    duo = fleet.hosts[:2]
    write(repo, duo, lb, min_available=None)
    first = repo.commit("the model on two hosts")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    wait_for("HAProxy to see the two servers up", lambda: lb.ready() == 2, timeout=30)
    before = {h.name: fleet.show(h, SERVICE, "InvocationID")["InvocationID"] for h in duo}

    write(repo, duo, lb, args="--max-model-len 4096", min_available=2)
    with_ghost(repo)
    repo.commit("a flag change; the group's third host is down")
    a, b = (h.name for h in duo)
    why = {h: f"min_available = 2: 2 of 3 hosts ready ({GHOST} not read (not reached in this run)); "
              f"restarting {h} would leave 1" for h in (a, b)}
    blocked = f"blocked: 2 of 3 ready, min_available = 2; {a} waits: {why[a]}; {b} waits: {why[b]}"

    _, dry = run_json("--repo", str(repo.path), "--dry-run", check_codes=(4,))   # 4: the ghost is unreachable
    assert dry["rollouts"][0]["budget"] == [blocked]

    out, report, samples = under_load(lb, "--repo", str(repo.path), codes=(4,))
    assert (report.failed, report.reasons) == (0, {})  # type: ignore[attr-defined]
    assert samples.min == 2 and samples.unread == 0  # type: ignore[attr-defined]
    ro = out["rollouts"][0]
    assert (ro["status"], ro["budget"], ro["untouched"], ro["waves_done"]) == ("halted", [blocked], [a, b], 0)
    assert (ro["halted"], ro["blocked"]) == (None, {"reason": "BudgetBlocked", "message": f"{SERVICE}: {blocked}"})
    hosts = {h["host"]: h for h in out["hosts"]}
    assert (hosts[GHOST]["status"], hosts[GHOST]["reason"]) == ("failed", "Unreachable")
    for h in (a, b):
        r = hosts[h]
        assert (r["status"], r["reason"], r["message"]) == (
            "quarantined", "BudgetBlocked", f"{SERVICE}: not restarted: min_available = 2 could not be kept")
        assert r["costs"] == {} and [e for e in r["events"] if e["outcome"]] == []
        assert f"{SERVICE}: waits: {why[h]}" in r["notes"], r["notes"]      # blocked before wave 1, said per host
    assert_untouched(fleet, duo, before, first)
    assert lb.ready() == 2

    # level-based: the next run finds the same and says it in its report, still restarting nothing
    text = run_cli("--repo", str(repo.path), check_codes=(4,)).stdout
    assert f"BudgetBlocked: {SERVICE}: {blocked}" in " ".join(text.split()), text
    assert_untouched(fleet, duo, before, first)


def assert_untouched(fleet: Fleet, hosts: list[fleetlib.Host], before: dict[str, str], revision: str) -> None:
    """Nothing restarted: each unit's invocation is the one before the run, its record the first
    revision's."""
    assert {h.name: fleet.show(h, SERVICE, "InvocationID")["InvocationID"] for h in hosts} == before
    for h in hosts:
        record = json.loads(fleet.ssh(h, f"cat /var/lib/reconciler/services/{SERVICE}.json"))
        assert record["revision"] == revision, record


def test_the_page_shows_what_a_drained_rollout_cost(fleet: Fleet, repo: DesiredRepo, lb: balancer.Balancer,
                                                    tmp_path: Path) -> None:
    duo = fleet.hosts[:2]
    write(repo, duo, lb, min_available=None)
    repo.commit("the model on two hosts")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    wait_for("HAProxy to see the two servers up", lambda: lb.ready() == 2, timeout=30)
    write(repo, duo, lb, args="--max-model-len 4096", min_available=None)
    repo.commit("a flag change")
    _, out = run_json("--repo", str(repo.path), check_codes=(0,))
    with TestClient(create_app(Hub(), tmp_path / "state", commits=lambda rev: None),
                    base_url="http://localhost") as c:
        grid = cells(c.get("/").text)
    for h in out["hosts"]:
        steps = h["costs"][SERVICE]["steps"]
        assert set(steps) == {"leave", "drain", "stop", "start", "ready", "smoke", "rejoin", "serving"}, h
        cell = grid[(h["host"], SERVICE)]
        total = sum(max(0.0, v) for v in steps.values())
        assert f'<span class="what">last restart:</span> unavailable {total:.1f}s</summary>' in cell, cell
        assert f"drain {steps['drain']:.1f}s, stop {steps['stop']:.1f}s" in cell and "in flight" not in cell
