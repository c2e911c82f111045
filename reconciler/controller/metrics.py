"""Prometheus metrics of the daemon (prometheus-client): runs and durations, per-host health,
rollbacks, the last applied revision, drift found. Served on 127.0.0.1 by default. Label values
pass through redact (they are names and revisions, but nothing printed bypasses it).

The endpoint is prometheus-client's WSGI app on a bounded server of our own (prometheus-client's
start_http_server starts a thread per connection with no timeout, so idle sockets would pile up
threads and file descriptors in the daemon's process): at most MAX_SCRAPES requests at once (more
are answered 503 at once), and a client that takes SCRAPE_TIMEOUT to send its request or to read
the answer is dropped. A port it cannot listen on (taken by someone else, a bad address) is said
once and the daemon goes on without metrics: it must never keep the daemon from starting.
"""

from __future__ import annotations

import socket
import sys
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from ..loop.results import FleetResult
from ..plan.model import State
from ..redact import redact
from .config import cannot_listen, parse_address, public_note

MAX_SCRAPES = 8             # requests served at once: Prometheus asks one at a time
SCRAPE_TIMEOUT = 10.0       # seconds a client may take to send its request or to read the answer
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n"
        b"Connection: close\r\nRetry-After: 5\r\n\r\nbusy\n")


class _Quiet(WSGIRequestHandler):
    """No access log; the socket times out (an idle or slow client is dropped, its thread ends)."""

    timeout = SCRAPE_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing: a scrape every 15 s would fill the journal."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per request, at most MAX_SCRAPES at once; the next one gets 503 and is closed."""

    daemon_threads = True
    request_queue_size = 64         # the listen backlog (socketserver's 5 drops connects under a burst)

    def __init__(self, address: tuple[str, int], handler: type[WSGIRequestHandler]):
        self.slots = threading.BoundedSemaphore(MAX_SCRAPES)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:           # no thread could start: the slot is free again
            self.slots.release()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away is not an error of ours: no traceback for it."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class MetricsServer6(MetricsServer):
    address_family = socket.AF_INET6


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

    server: MetricsServer | None = None

    def serve(self, address: str) -> MetricsServer | None:
        """Serve the metrics on `address` (host:port) from a thread. A port taken by someone else
        or a bad address is said once and the metrics stay off (the daemon goes on, and still
        starts: a local user who binds the port first must not be able to crash-loop it)."""
        try:
            host, port = parse_address(address)
            cls = MetricsServer6 if ":" in host else MetricsServer
            server = make_server(host, port, make_wsgi_app(self.registry), cls, handler_class=_Quiet)
        except (ValueError, OSError) as e:
            print(redact(f"reconciler: metrics off: {cannot_listen(address, e)}"), flush=True)
            return None
        assert isinstance(server, MetricsServer)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{server.server_address[1]}/metrics"
        print(f"reconciler: metrics on {url}{public_note('metrics', host)}", flush=True)
        self.server = server
        return server

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
