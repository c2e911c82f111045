"""One host: connect -> observe -> plan -> apply. The fleet: all hosts, concurrently, bounded.

One host failing (unreachable, bad key, apply error) never stops the others: every host ends
with a HostResult, collected like fabric's GroupResult.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from .apply import apply_plan
from .errors import HostError, ReconcilerError
from .facts import HostFacts, observe_command, parse_observation
from .plan import HostPlan, plan_host
from .spec import DesiredState, HostSpec
from .transport import SSHTransport, Transport

Connector = Callable[[HostSpec], Awaitable[Transport]]


@dataclass
class HostResult:
    """The outcome for one host. status: in-sync | would-change | converged | failed."""

    host: str
    address: str
    status: str
    plan: HostPlan | None = None
    reason: str | None = None          # CamelCase, for failures
    message: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {
            "host": self.host, "address": self.address, "status": self.status,
            "reason": self.reason, "message": self.message, "seconds": round(self.seconds, 3),
            "summary": self.plan.summary() if self.plan else None,
            "actions": [a.to_json() for a in self.plan.actions] if self.plan else [],
        }


@dataclass
class FleetResult:
    revision: str
    dry_run: bool
    hosts: list[HostResult] = field(default_factory=list)

    @property
    def failed(self) -> list[HostResult]:
        return [h for h in self.hosts if h.status == "failed"]

    def exit_code(self) -> int:
        """0 converged/in sync, 2 dry-run found changes, 4 a host failed."""
        if self.failed:
            return 4
        if self.dry_run and any(h.status == "would-change" for h in self.hosts):
            return 2
        return 0

    def to_json(self) -> dict:
        return {"revision": self.revision, "short": self.revision[:7], "dry_run": self.dry_run,
                "exit_code": self.exit_code(), "hosts": [h.to_json() for h in self.hosts]}


def ssh_connector(identity: str | None = None, connect_timeout: float = 10.0) -> Connector:
    async def connect(host: HostSpec) -> Transport:
        return await SSHTransport.connect(host.name, host.ssh, identity=identity, connect_timeout=connect_timeout)
    return connect


async def observe(t: Transport, host: HostSpec) -> HostFacts:
    """Read everything the planner needs from the host, in one round trip."""
    cmd, token = observe_command(list(host.services))
    res = await t.run(cmd, check=True, timeout=30, what="observe")
    return parse_observation(res.stdout, token, host.name)


async def reconcile_host(host: HostSpec, revision: str, connect: Connector, *, dry_run: bool) -> HostResult:
    """Converge one host (or, with dry_run, only plan it). Never raises for host failures."""
    started = time.monotonic()
    result = HostResult(host.name, host.ssh.address, "failed")
    t: Transport | None = None
    try:
        t = await connect(host)
        facts = await observe(t, host)
        plan = plan_host(host, facts, revision)
        result.plan = plan
        if dry_run:
            result.status = "would-change" if plan.changes else "in-sync"
        else:
            await apply_plan(t, plan)   # a no-change plan holds at most the record of a new revision
            result.status = "converged" if plan.changes else "in-sync"
    except HostError as e:
        result.reason, result.message = e.reason, e.message
    except ReconcilerError as e:
        result.reason, result.message = "Failed", str(e)
    finally:
        if t is not None:
            await t.close()
        result.seconds = time.monotonic() - started
    return result


async def reconcile_fleet(state: DesiredState, connect: Connector, *, dry_run: bool = False,
                          concurrency: int | None = None, hosts: list[str] | None = None) -> FleetResult:
    """Reconcile every selected host concurrently (at most `concurrency` at once)."""
    sem = asyncio.Semaphore(concurrency or state.settings.concurrency)
    selected = [h for n, h in sorted(state.hosts.items()) if not hosts or n in hosts]

    async def one(h: HostSpec) -> HostResult:
        async with sem:
            return await reconcile_host(h, state.revision, connect, dry_run=dry_run)

    results = await asyncio.gather(*(one(h) for h in selected))
    return FleetResult(state.revision, dry_run, list(results))
