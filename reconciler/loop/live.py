"""`reconcile status --live`: the fleet as the hosts' own records say, from any machine (see
docs/status.md). The truth is on each host: /var/lib/reconciler/services/<name>.json and
host.json (records.py), read with the observation and no secret files (the one part of an
observation that writes: the host's hash key), so it writes nothing and takes no lock. It never
waits for a running reconcile, and never changes what one sees.

`look` reads every selected host (fleet.run_fleet with RunOptions.look). `host_rows` is pure: a
host's facts and its desired services at the revision -> rows of the state store's shape
(report.print_status prints both) plus what only a host knows. A host that cannot be reached or
read is one row (service "*") that says why.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..desired.spec import DesiredState, HostSpec, ServiceSpec
from ..errors import ReconcilerError
from ..host.transport import close_quietly
from ..plan.facts import HostFacts, ServiceFacts
from ..plan.records import ServiceRecord
from ..plan.state import live_quarantine
from ..plan.unit import UP
from ..reasons import Reason
from .host_run import observe, ssh_connector
from .options import RunIO, RunOptions
from .results import FleetResult, HostResult, failed_result
from .revision import Revision


def desired_hash(spec: ServiceSpec | None) -> str | None:
    """The content hash the host's record holds once this service is applied; None when it
    cannot be known here (not desired, or an age secret that was not decrypted)."""
    if spec is None or any(s.source == "age" and not s.digest for s in spec.secrets):
        return None
    return spec.content_hash()


def _running_rev(rec: ServiceRecord, active: str) -> str | None:
    if active not in UP:
        return None
    if rec.pending is not None and rec.pending.started:
        return rec.pending.revision
    return rec.revision


def record_health(rec: ServiceRecord, f: ServiceFacts) -> str:
    active, sub = f.unit.active_state, f.unit.sub_state
    if rec.pending is not None:
        return "pending"
    if active == "failed" or sub == "auto-restart":
        return "unhealthy"
    if active == "activating":
        return "starting"
    if active not in UP:
        return "stopped"
    return "healthy" if rec.verified else "unverified"


def _event(name: str, host: str, rec: ServiceRecord, f: ServiceFacts, spec: ServiceSpec | None,
           revision: str) -> tuple[str, str | None]:
    """The service's state in words, from its record (and the journal line of a quarantine)."""
    rev7 = revision[:7]
    if rec.corrupt:
        return "failed: the record is unreadable (the next run treats the service as unknown)", None
    if spec is None:
        return f"not in the desired state at {rev7}: stopped and removed by the next run", None
    if rec.pending is not None:
        p = rec.pending
        what = f"{p.revision[:7]}{' (rollback)' if p.rollback else ''}"
        if p.blocked:
            return f"pending: {what} not started: {p.blocked}", None
        return f"pending: {what} {'started' if p.started else 'being applied'}, no verdict yet", None
    want = desired_hash(spec)
    q = live_quarantine(rec.quarantine, None, want) if want is not None else rec.quarantine
    if q is not None:
        running = f.unit.active_state in UP
        why = q.why(host)
        if q.rollback_failed:
            return (f"failed: desired {q.revision[:7]} quarantined ({why}); its rollback failed too: "
                    f"left stopped"), q.quote
        if running and rec.last_good_revision and rec.hash == rec.last_good_hash:
            return (f"quarantined: desired {q.revision[:7]} quarantined ({why}), running "
                    f"{rec.last_good_revision[:7]}"), q.quote
        left = "left as it is" if q.halted_at and q.halted_at != host else "left stopped"
        return f"quarantined: desired {q.revision[:7]} quarantined ({why}); {left}", q.quote
    runs = (rec.revision or "?")[:7]
    if want is None:
        return f"runs {runs} (whether {rev7} changes it needs the age identity)", None
    if rec.hash != want:
        return f"out-of-sync: runs {runs}; {rev7} changes it", None
    return ("in-sync" if rec.verified else f"in-sync: {runs} applied, no health verdict yet"), None


def host_rows(host: HostSpec, facts: HostFacts, revision: str) -> list[dict[str, Any]]:
    """PURE: one row per service desired at `revision` or in the host's inventory."""
    rows = []
    applied = facts.record.applied_revision if facts.record else None
    applied_at = facts.record.applied_at if facts.record else 0
    for name in sorted(set(host.services) | facts.inventory):
        f = facts.services.get(name) or ServiceFacts(name)
        spec = host.services.get(name)
        rec = f.record
        active, sub = f.unit.active_state or None, f.unit.sub_state or None
        row: dict[str, Any] = {"host": host.name, "service": name, "desired_rev": revision,
                               "address": host.ssh.address, "active_state": active, "sub_state": sub,
                               "applied_rev": applied}
        if rec is None:
            foreign = f.foreign_path()
            event = (f"foreign: {foreign} was not installed by the reconciler" if foreign
                     else "not deployed")
            row.update(running_rev=None, health="foreign" if foreign else None, last_event=event, quote=None,
                       updated_at=None, record_rev=None, last_good_rev=None, pending=None, quarantine=None)
        else:
            event, quote = _event(name, host.name, rec, f, spec, revision)
            times = [t for t in (applied_at, rec.pending.at if rec.pending else 0,
                                 rec.quarantine.at if rec.quarantine else 0) if t]
            row.update(running_rev=_running_rev(rec, active or ""), health=record_health(rec, f), last_event=event,
                       quote=quote, updated_at=max(times) if times else None, record_rev=rec.revision,
                       last_good_rev=rec.last_good_revision,
                       pending=rec.pending.to_json() if rec.pending else None,
                       quarantine=rec.quarantine.to_json() if rec.quarantine else None)
        rows.append(_with_gpu_fault(row, facts))
    return rows


def _with_gpu_fault(row: dict[str, Any], facts: HostFacts) -> dict[str, Any]:
    """A host marked GpuFault (gpu-fault.json) says so on each of its rows, the line quoted."""
    g = facts.gpu_fault
    row["gpu_fault"] = g.to_json() if g is not None else None
    if g is not None:
        row["last_event"] = f"GpuFault: {g.why()}; {row['last_event']}"
        row["quote"] = row["quote"] or g.quote
    return row


def failed_row(host: HostSpec, revision: str, reason: str, message: str) -> dict[str, Any]:
    """PURE: the one row of a host that could not be read: it says why."""
    event = f"unreachable: {message}" if reason == "Unreachable" else f"failed: {reason}: {message}"
    return {"host": host.name, "service": "*", "desired_rev": revision, "running_rev": None, "health": "unknown",
            "last_event": event, "quote": None, "updated_at": None, "address": host.ssh.address,
            "active_state": None, "sub_state": None, "applied_rev": None, "record_rev": None,
            "last_good_rev": None, "pending": None, "quarantine": None, "gpu_fault": None}


def rows_of(result: FleetResult, state: DesiredState) -> list[dict[str, Any]]:
    """PURE: the rows of a look at the fleet (fleet.run_fleet with RunOptions.look): each host's
    rows from its facts, or the one row that says why it could not be read."""
    out: list[dict[str, Any]] = []
    for r in result.hosts:
        host = state.hosts[r.host]
        if r.facts is None:
            reason = Reason.OBSERVE_FAILED if r.reason is Reason.COMMAND_FAILED else r.reason or Reason.FAILED
            out.append(failed_row(host, result.revision, reason, r.message or ""))
        else:
            out.extend(host_rows(host, r.facts, result.revision))
    return out


async def look(rev: Revision, opts: RunOptions, io: RunIO, hosts: list[HostSpec]) -> FleetResult:
    """Read every host's records and systemd's state, read-only: the observation without the
    keyed hashes of secret files (the one part that writes: the host's key), no lock."""
    connect = io.connect or ssh_connector(opts.identity)
    sem = asyncio.Semaphore(opts.concurrency or rev.state.settings.concurrency)

    async def one(h: HostSpec) -> HostResult:
        t0 = time.monotonic()
        async with sem:
            try:
                t = await connect(h)
                try:
                    facts = await observe(t, h, secrets=False)
                finally:
                    await close_quietly(t)
            except ReconcilerError as e:
                return failed_result(h.name, h.ssh.address, e, time.monotonic() - t0)
        return HostResult(h.name, h.ssh.address, facts=facts, seconds=time.monotonic() - t0)
    return FleetResult(rev.revision, True, list(await asyncio.gather(*(one(h) for h in hosts))))
