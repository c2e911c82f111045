"""Prometheus metrics of the daemon (prometheus-client): runs and durations, per-host health,
rollbacks, the last applied revision, drift found. Served on 127.0.0.1 by default. Label values
pass through redact (they are names and revisions, but nothing printed bypasses it).

The endpoint is prometheus-client's ASGI app in the daemon's own event loop, no thread, at the
page's /metrics or behind a gate of its own (MAX_SCRAPES, SCRAPE_TIMEOUT): docs/web.md, "How it
is built". A port it cannot listen on (taken by someone else, a bad address) is said once and
the daemon goes on without metrics: it must never keep the daemon from starting.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..loop.results import FleetResult
from ..plan.model import State
from ..redact import redact
from ..values import replace
from .config import parse_address, public_note
from .web.gate import Limits, stop_server

if TYPE_CHECKING:
    import uvicorn
    from starlette.types import ASGIApp

    from .web.gate import Gated

MAX_SCRAPES = 8             # connections at once: Prometheus asks one at a time
SCRAPE_TIMEOUT = 10.0       # seconds a client may take to send its request or to read the answer
LIMITS = Limits(max_connections=MAX_SCRAPES, max_connections_per_client=MAX_SCRAPES, head_timeout=SCRAPE_TIMEOUT,
                slow_client=SCRAPE_TIMEOUT, send_buffer=256 * 1024)


# Health of a service that this run did not (re)start, from its state: in sync means verified
# healthy here; quarantined runs its last good; held ones are stopped.
_HEALTH_OF_STATE = {State.IN_SYNC: 1, State.QUARANTINED: 1, State.QUARANTINED_NO_GOOD: 0,
                    State.ROLLBACK_FAILED: 0}


def on_the_page(metrics: str, web: str) -> bool:
    """Whether the metrics are served at the page's /metrics: both listen on one address (a
    port of 0, any free port, is never one)."""
    try:
        where = parse_address(metrics)
        return where == parse_address(web) and where[1] != 0
    except ValueError:
        return False


class MetricsServer(msgspec.Struct):
    """The metrics' own server: its uvicorn server and task, the port it listens on, what its
    gate turned away."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    gated: Gated

    async def stop(self) -> None:
        await stop_server(self.server, self.task)
        self.gated.clients.owners.close()


class Metrics:
    """The daemon's series, in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.runs = Counter("reconciler_runs_total", "Reconcile runs by result", ["result"], registry=r)
        self.duration = Histogram("reconciler_run_duration_seconds", "Wall time of a reconcile run", registry=r,
                                  buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.healthy = Gauge("reconciler_service_healthy", "1 when the service passed health in its last check",
                             ["host", "service"], registry=r)
        self.host_up = Gauge("reconciler_host_reachable", "1 when the last run reached the host", ["host"], registry=r)
        self.rollbacks = Counter("reconciler_rollbacks_total", "Rollbacks to the last good revision",
                                 ["host", "service"], registry=r)
        self.drift = Counter("reconciler_drift_found_total", "Services found edited on the host",
                             ["host", "service"], registry=r)
        self.revision = Gauge("reconciler_last_applied_revision_info", "The last applied revision (value 1)",
                              ["revision"], registry=r)
        self.last_run = Gauge("reconciler_last_run_timestamp_seconds", "When the last run ended", registry=r)
        self.waiting = Gauge("reconciler_waiting_for_first_push", "1 while the deploy branch does not exist yet",
                             registry=r)
        # The warm pool (pool.py): opened grows by one per host at start, then only on reconnects.
        self.ssh_opened = Counter("reconciler_ssh_connections_opened_total",
                                  "SSH connections opened (a kept connection is reused, not counted)", registry=r)
        self.ssh_reused = Counter("reconciler_ssh_connections_reused_total",
                                  "Runs' host sessions served by a connection kept open since an earlier run",
                                  registry=r)
        self.ssh_open = Gauge("reconciler_ssh_connections_open", "SSH connections kept open between runs",
                              registry=r)

    _seen: tuple[int, int] = (0, 0)

    def app(self) -> ASGIApp:
        """prometheus-client's ASGI app of this registry (the page mounts it at /metrics when the
        metrics share its address)."""
        from prometheus_client import make_asgi_app
        return cast("ASGIApp", make_asgi_app(self.registry))

    async def serve(self, address: str, **limits: float) -> MetricsServer | None:
        """Serve the metrics on `address` (host:port) from the running loop, on an uvicorn server of
        their own behind the page's gate (web/gate.py; LIMITS, or `limits` for tests). A port taken
        by someone else or a bad address is said once and the metrics stay off (the daemon goes on,
        and still starts: a local user who binds the port first must not be able to crash-loop it)."""
        from .web.gate import Gated, listen_at, serve
        from .web.peer import Clients
        from .web.stream import Refusals
        if (bound := listen_at(address, "metrics")) is None:
            return None
        host, sock, url = bound
        gated = Gated(replace(LIMITS, **limits), Refusals(name="metrics endpoint"), Clients())
        server, task = serve(self.app(), sock, gated)
        print(f"reconciler: metrics on {url}metrics{public_note('metrics', host)}", flush=True)
        return MetricsServer(server, task, sock.getsockname()[1], gated)

    def observe_run(self, res: FleetResult, seconds: float) -> None:
        code = res.exit_code()
        self.count_run({0: "ok", 3: "rolled_back", 4: "host_failed"}.get(code, str(code)), seconds)
        self.revision.clear()
        self.revision.labels(redact(res.revision)).set(1)
        for h in res.hosts:
            host = redact(h.host)
            self.host_up.labels(host).set(0 if h.reason in ("Unreachable", "HostKeyUnverified") else 1)
            for name, state in (h.plan.states.items() if h.plan else ()):
                if state is State.DRIFTED:
                    self.drift.labels(host, redact(name)).inc()
                if state in _HEALTH_OF_STATE:
                    # Not restarted in this run: what the host's records say (a daemon that was
                    # just restarted reports the fleet at once, not after the next deploy).
                    self.healthy.labels(host, redact(name)).set(_HEALTH_OF_STATE[state])
            for e in h.events:
                if e.outcome is not None:
                    self.healthy.labels(host, redact(e.service)).set(1 if e.outcome.healthy else 0)
                if e.action == "rollback" and e.outcome is not None and e.outcome.healthy:
                    self.rollbacks.labels(host, redact(e.service)).inc()

    def observe_pool(self, opened: int, reused: int, open_now: int) -> None:
        """The pool's running totals: counters advance by what changed since the last call."""
        self.ssh_opened.inc(max(0, opened - self._seen[0]))
        self.ssh_reused.inc(max(0, reused - self._seen[1]))
        self._seen = (opened, reused)
        self.ssh_open.set(open_now)

    def count_run(self, result: str, seconds: float) -> None:
        """One run ended with `result` (ok, rolled_back, host_failed; refused, invalid, error,
        crash: a run that never reached the hosts' results)."""
        self.runs.labels(result).inc()
        self.duration.observe(seconds)
        self.last_run.set_to_current_time()
