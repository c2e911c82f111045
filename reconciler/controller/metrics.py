"""Prometheus metrics of the daemon (prometheus-client): runs and durations, per-host health,
rollbacks, the last applied revision, drift found. Served on 127.0.0.1 by default. Label values
pass through redact (they are names and revisions, but nothing printed bypasses it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..loop.results import FleetResult
from ..plan.model import State
from ..redact import redact

# Health of a service that this run did not (re)start, from its state: in sync means verified
# healthy here; quarantined runs its last good; held ones are stopped.
_HEALTH_OF_STATE = {State.IN_SYNC: 1, State.QUARANTINED: 1, State.QUARANTINED_NO_GOOD: 0,
                    State.ROLLBACK_FAILED: 0}


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

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def observe_run(self, res: FleetResult, seconds: float) -> None:
        code = res.exit_code()
        self.runs.labels({0: "ok", 3: "rolled_back", 4: "host_failed"}.get(code, str(code))).inc()
        self.duration.observe(seconds)
        self.last_run.set_to_current_time()
        self.revision.clear()
        self.revision.labels(redact(res.revision)).set(1)
        for h in res.hosts:
            self.host_up.labels(redact(h.host)).set(0 if h.reason in ("Unreachable", "HostKeyUnverified") else 1)
            for name, state in (h.plan.states.items() if h.plan else ()):
                if state is State.DRIFTED:
                    self.drift.labels(redact(h.host), redact(name)).inc()
                if state in _HEALTH_OF_STATE:
                    # Not restarted in this run: what the host's records say (a daemon that was
                    # just restarted reports the fleet at once, not after the next deploy).
                    self.healthy.labels(redact(h.host), redact(name)).set(_HEALTH_OF_STATE[state])
            for e in h.events:
                if e.outcome is not None:
                    self.healthy.labels(redact(h.host), redact(e.service)).set(1 if e.outcome.healthy else 0)
                if e.action == "rollback" and e.outcome is not None and e.outcome.healthy:
                    self.rollbacks.labels(redact(h.host), redact(e.service)).inc()

    def observe_pool(self, opened: int, reused: int, open_now: int) -> None:
        """The pool's running totals: counters advance by what changed since the last call."""
        self.ssh_opened.inc(max(0, opened - self._seen[0]))
        self.ssh_reused.inc(max(0, reused - self._seen[1]))
        self._seen = (opened, reused)
        self.ssh_open.set(open_now)

    def run_failed(self, result: str, seconds: float) -> None:
        self.runs.labels(result).inc()
        self.duration.observe(seconds)
        self.last_run.set_to_current_time()
