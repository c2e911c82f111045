"""A host marked GpuFault shows it, with the fault line quoted, on the fleet page (through the state
store a run writes) and in `status --live` (from the host's own gpu-fault.json)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from reconciler.controller.store import Store, remember
from reconciler.controller.web.app import create_app
from reconciler.controller.web.hub import Hub
from reconciler.host.health import Outcome
from reconciler.loop.live import host_rows
from reconciler.loop.results import Event, FleetResult, HostResult, ServiceEvent, fold
from reconciler.plan.facts import HostFacts, ServiceFacts
from reconciler.plan.gpuhealth import GpuFault
from reconciler.plan.model import HostPlan, ServicePlan, State
from reconciler.plan.records import Pending, ServiceRecord

from ..plan.test_plan import host, svc

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REV, OLD = "a" * 40, "b" * 40
ECC = "GPU 00000000:18:00.0: ECC Errors / Volatile / DRAM Uncorrectable: 2"
FAULT = GpuFault(quote=ECC, at=1796288718, lines=(ECC,), service="m", revision=REV)


def gpu_fault_run() -> FleetResult:
    """A run whose start of m failed with the host's GPUs sick, its next round blocked by them."""
    out = Outcome("m", False, "GpuFault", f"GpuFault: the start failed (StartFailed: start failed) while the "
                                          f"host's GPUs were sick: {ECC}", quote=ECC)
    r = HostResult("gpu-1", "127.0.0.2")
    r.events.append(ServiceEvent("m", Event.DEPLOY, REV, "h", out))
    blocked = ServicePlan("m", State.BLOCKED, result=r.status.FAILED, reason="GpuFault",
                          note=f"not started: the host's {FAULT.why()}", quote=ECC)
    plan = HostPlan("gpu-1", REV, (), {"m": blocked})
    fold(r, plan, dry_run=False)
    r.plan, r.running = plan, {"m": None}
    return FleetResult(REV, False, [r])


def test_the_run_and_the_store_say_gpu_fault_with_the_line(tmp_path: Path) -> None:
    result = gpu_fault_run()
    assert (result.hosts[0].status, result.hosts[0].reason) == ("failed", "GpuFault")
    assert result.exit_code() == 4
    store = Store(tmp_path)
    remember(store, result)
    row = next(r for r in store.status() if r["service"] == "m")
    assert row["quote"] == ECC and "GpuFault: the start failed (StartFailed" in row["last_event"]
    attempt = store.history("gpu-1")[0]
    assert (attempt["result"], attempt["quote"]) == ("GpuFault", ECC)
    store.close()
    app = create_app(Hub(), tmp_path, repo="/srv/git/fleet.git", branch="main", commits=lambda rev: None)
    with TestClient(app, base_url="http://localhost") as c:
        page = c.get("/").text
        assert "GpuFault: the start failed" in page and ECC in page
        assert ECC in c.get("/hosts/gpu-1").text


def test_status_live_shows_the_hosts_gpu_fault_on_each_row() -> None:
    rec = ServiceRecord(hash="h0", revision=OLD, last_good_hash="h0", last_good_revision=OLD,
                        pending=Pending("h1", REV, started=True, unjudged="GpuFault: ...", attempts=1, at=5))
    facts = HostFacts(services={"m": ServiceFacts("m", record=rec, props={"ActiveState": "inactive"})},
                      gpu_fault=FAULT)
    [row] = host_rows(host(svc()), facts, REV)
    assert row["last_event"] == (f"GpuFault: GPU fault (m {REV[:7]} failed to start): {ECC}; pending: "
                                 f"{REV[:7]} started, no verdict yet")
    assert row["quote"] == ECC and row["gpu_fault"]["quote"] == ECC
    [clean] = host_rows(host(svc()), HostFacts(services=facts.services), REV)
    assert clean["gpu_fault"] is None and not clean["last_event"].startswith("GpuFault")
