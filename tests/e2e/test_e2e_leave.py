"""End-to-end: a leave of rotation recorded on the host (issue 42), on real hosts behind a real
HAProxy (tests/balancer.py, its runtime API), the stand-in playing vLLM.

* a run killed (SIGKILL, RECONCILER_FAULT=after-verdict: the new server judged healthy and
  recorded, the rejoin not yet asked) leaves the server out of HAProxy's rotation and the leave
  recorded on the host; the dry run shows the rejoin; the next plain run puts it back (HAProxy
  serves it) without restarting it (same InvocationID), and the record is gone;
* a server taken out of rotation by hand (no record of a leave) is left out by the next run.
"""

from __future__ import annotations

import json

import pytest

from reconciler.plan.layout import ROTATION_DIR
from tests import balancer
from tests import fleet as fleetlib
from tests.conftest import DesiredRepo, Fleet, run_cli, run_json, wait_for
from tests.e2e.test_e2e_drain import PORT, SERVICE, write

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(300)]

LEFT = f"{ROTATION_DIR}/{SERVICE}.left"


lb_host, lb = balancer.fixtures(1, PORT)


def status(lb: balancer.Balancer, h: fleetlib.Host) -> str:
    """HAProxy's status of the host's server (UP, DRAIN, MAINT, DOWN ...)."""
    return lb.stats()[f"{balancer.BACKEND}/{h.name}"].status


def recorded(fleet: Fleet, h: fleetlib.Host) -> str:
    """The host's record of the service's leave of rotation ('' when there is none)."""
    return fleet.ssh(h, f"cat {LEFT} 2>/dev/null", check=False)


def deployed(fleet: Fleet, repo: DesiredRepo, lb: balancer.Balancer) -> fleetlib.Host:
    """The model on the fleet's first host, behind `lb`, serving."""
    h = fleet.hosts[0]
    write(repo, [h], lb, min_available=None)
    repo.commit("the model on one host")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    wait_for("HAProxy to serve the host", lambda: status(lb, h) == "UP", timeout=30)
    return h


def test_a_run_killed_between_the_leave_and_the_rejoin_is_put_back_by_the_next_run(
        fleet: Fleet, repo: DesiredRepo, lb: balancer.Balancer, monkeypatch: pytest.MonkeyPatch) -> None:
    h = deployed(fleet, repo, lb)
    write(repo, [h], lb, args="--max-model-len 4096", min_available=None)
    rev = repo.commit("a flag change")

    monkeypatch.setenv("RECONCILER_FAULT", "after-verdict")     # SIGKILL right after the healthy verdict
    killed = run_cli("--repo", str(repo.path))
    monkeypatch.delenv("RECONCILER_FAULT")
    assert killed.returncode == -9, killed.stderr
    assert status(lb, h) == "DRAIN"                              # left, and no rejoin came
    left = json.loads(recorded(fleet, h))
    assert left["revision"] == rev and isinstance(left["at"], int)
    assert fleet.ssh(h, f"stat -c %a {LEFT}").strip() == "600"
    before = fleet.show(h, f"{SERVICE}.service", "InvocationID", "ActiveState")
    assert before["ActiveState"] == "active"

    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(2,))   # 2: would change
    assert f"rejoin {SERVICE}  (rejoin rotation (left by a run that did not finish))" in dry.stdout, dry.stdout
    assert status(lb, h) == "DRAIN" and recorded(fleet, h)      # the dry run changed nothing

    _, out = run_json("--repo", str(repo.path), check_codes=(0,))
    [host] = out["hosts"]
    assert host["status"] == "converged", host
    back = f"{SERVICE}: serving again: {balancer.BACKEND}/{h.name}: UP (left by a run that did not finish; " \
           "not restarted)"
    assert back in host["notes"], host
    assert status(lb, h) == "UP"                                 # HAProxy serves it again
    assert fleet.show(h, f"{SERVICE}.service", "InvocationID", "ActiveState") == before   # not restarted
    assert recorded(fleet, h) == ""

    _, again = run_json("--repo", str(repo.path), check_codes=(0,))
    assert again["hosts"][0]["status"] == "in-sync" and status(lb, h) == "UP"


def test_a_server_taken_out_of_rotation_by_hand_stays_out(fleet: Fleet, repo: DesiredRepo,
                                                          lb: balancer.Balancer) -> None:
    h = deployed(fleet, repo, lb)
    lb.state(h.name, "maint")                                    # an operator's, not a run's: no record
    before = fleet.show(h, f"{SERVICE}.service", "InvocationID")
    _, out = run_json("--repo", str(repo.path), check_codes=(0,))
    [host] = out["hosts"]
    assert host["status"] == "in-sync" and not any("rotation" in n for n in host["notes"]), host
    assert status(lb, h) == "MAINT" and recorded(fleet, h) == ""
    assert fleet.show(h, f"{SERVICE}.service", "InvocationID") == before
