"""The state store and the hosts' records tell one truth: a service no run of this store judged
(deployed healthy by another controller, or before this store existed) reads as its host's
record says, with the words of `status --live`."""

from __future__ import annotations

from pathlib import Path

from reconciler.controller.store import Store, remember
from reconciler.loop.live import host_rows
from reconciler.loop.results import FleetResult, HostResult
from reconciler.plan.facts import HostFacts, ServiceFacts
from reconciler.plan.model import HostPlan, ServicePlan, State
from reconciler.plan.records import Pending, ServiceRecord

from ..plan.test_plan import host, svc

REV = "a" * 40
VERIFIED = ServiceRecord(hash="h", revision=REV, last_good_hash="h", last_good_revision=REV)


def in_sync_run(record: ServiceRecord, active: str) -> FleetResult:
    """A run that found service m in sync: no event, only what it read from the host."""
    facts = HostFacts(services={"m": ServiceFacts("m", record=record, props={"ActiveState": active,
                                                                           "SubState": "running"})})
    plan = HostPlan("gpu-1", REV, (), {"m": ServicePlan("m", State.IN_SYNC)})
    return FleetResult(REV, False, [HostResult("gpu-1", "127.0.0.2", plan=plan, facts=facts)])


def test_an_in_sync_service_no_run_here_judged_is_healthy_as_its_record_says(tmp_path: Path) -> None:
    store = Store(tmp_path)
    result = in_sync_run(VERIFIED, "active")
    remember(store, result)
    row = next(r for r in store.status() if r["service"] == "m")
    assert row["health"] == "healthy"
    live = host_rows(host(svc()), result.hosts[0].facts, REV)     # the same words as status --live
    assert [r["health"] for r in live] == ["healthy"]


def test_a_record_with_a_deploy_in_flight_reads_pending_not_healthy(tmp_path: Path) -> None:
    store = Store(tmp_path)
    remember(store, in_sync_run(ServiceRecord(hash="h", revision=REV, pending=Pending("h2", "b" * 40)),
                                "active"))
    assert next(r for r in store.status() if r["service"] == "m")["health"] == "pending"


def test_a_batch_redacts_each_last_event_once_and_every_write_still_reads_redacted(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """A run's results go in one batch where most hosts' last events read the same ("in-sync"):
    each text is redacted once a batch, a registered secret still masked in every row; outside a
    batch every write redacts its own."""
    from reconciler import redact
    from reconciler.controller import store as store_module
    secret = "s3cr3t-Value-9f8e7d6c"
    redact.register(secret)
    calls: list[str] = []

    def counted(text: str) -> str:
        calls.append(text)
        return redact.redact(text)
    monkeypatch.setattr(store_module, "redact", counted)
    try:
        s = Store(tmp_path)
        with s.batch():
            for h in ("gpu-1", "gpu-2", "gpu-3"):
                s.set_status(h, "m", desired_rev=REV, running_rev=REV, health="healthy", last_event=f"failed: {secret}")
        assert calls == [f"failed: {secret}"]
        s.set_status("gpu-4", "m", desired_rev=REV, running_rev=REV, health="healthy", last_event="in-sync")
        s.set_status("gpu-5", "m", desired_rev=REV, running_rev=REV, health="healthy", last_event="in-sync")
        assert calls[1:] == ["in-sync", "in-sync"]
        rows = {r["host"]: r["last_event"] for r in s.status()}
        assert rows == {"gpu-1": f"failed: {redact.MASK}", "gpu-2": f"failed: {redact.MASK}",
                        "gpu-3": f"failed: {redact.MASK}", "gpu-4": "in-sync", "gpu-5": "in-sync"}
        s.close()
    finally:
        redact._values.discard(secret)
