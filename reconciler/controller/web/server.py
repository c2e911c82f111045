"""The page's HTTP server: uvicorn inside the daemon's event loop, behind gate.py's limits (LIMITS
below; gate.py says how), so that the loop and the daemon's file descriptors stay free for deploys
whatever the clients do. Event streams have caps of their own and share one render per change
(stream.py). `/metrics` is served here too when the metrics share the page's address (metrics.py).

A port it cannot listen on (taken by someone else, a bad address) is said once and the page is
left off: deploys never wait on it, and the daemon still starts. A local user who binds the port
first serves whatever they like to whoever opens a tunnel to it: the log line says so, and only
a socket bound before any user can (a systemd socket unit, a port below 1024) would prevent it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvicorn
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ...values import replace
from ..config import public_note
from .app import create_app
from .gate import Gated, Limits, listen_at, serve, stop_server
from .hub import Hub
from .peer import Clients
from .stream import MAX_STREAMS, MAX_STREAMS_PER_CLIENT, Refusals, Streams

MAX_CONNECTIONS = 64        # sockets open at once (event streams included)
MAX_CONNECTIONS_PER_CLIENT = 16   # of one client (a browser opens up to 6 to a host, a few tabs more)
HEAD_TIMEOUT = 10.0         # seconds to send a request's head
SLOW_CLIENT = 10.0          # seconds a client may leave what it was sent unread
SEND_BUFFER = 256 * 1024    # bytes of the socket's kernel send buffer (a few events of a large fleet)
LIMITS = Limits(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT, HEAD_TIMEOUT, SLOW_CLIENT, SEND_BUFFER)


class _App:
    """An ASGI app, as an object: starlette routes a request to it as it is."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class PageServer:
    """The page listening on its socket, served by a task in the daemon's loop; its event streams
    and what it turned away (for the tests and the benchmark)."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], url: str, executor: ThreadPoolExecutor,
                 streams: Streams, refusals: Refusals, clients: Clients):
        self.server, self.task, self.url, self.executor = server, task, url, executor
        self.streams, self.refusals, self.clients = streams, refusals, clients

    async def stop(self, hub: Hub) -> None:
        hub.close()                      # event streams end, so the shutdown waits for nothing
        await stop_server(self.server, self.task)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.clients.owners.close()


async def serve_page(address: str, hub: Hub, state_dir: Path, *, repo: str = "", branch: str = "",
                     max_streams: int = MAX_STREAMS, max_streams_per_client: int = MAX_STREAMS_PER_CLIENT,
                     metrics: ASGIApp | None = None, **limits: Any) -> PageServer | None:
    """Listen on `address` and serve the page from the running loop (and `metrics`, an ASGI app,
    at /metrics). A page that cannot listen (address in use, bad address) is said once and left
    off: deploys never wait on it. One that listens beyond loopback (the config allowed it:
    web_public) says so. `limits`: gate.Limits' fields other than the defaults (tests, bench)."""
    if (bound := listen_at(address, "fleet page")) is None:
        return None
    host, sock, url = bound
    refusals, clients = Refusals(), Clients()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-page")
    app = create_app(hub, state_dir, repo=repo, branch=branch, bind=host, executor=executor, refusals=refusals,
                     max_streams=max_streams)
    if metrics is not None:          # an ASGI app as a route (starlette would take a bare function for an endpoint)
        app.router.routes.insert(0, Route("/metrics", endpoint=_App(metrics)))
    streams = app.state.page.streams
    streams.clients, streams.cap_per_client = clients, max_streams_per_client    # the streams' caps per client
    server, task = serve(app, sock, Gated(replace(LIMITS, **limits), refusals, clients))
    print(f"reconciler: fleet page on {url}{public_note('web', host)}", flush=True)
    if metrics is not None:
        print(f"reconciler: metrics on {url}metrics{public_note('metrics', host)}", flush=True)
    return PageServer(server, task, url, executor, streams, refusals, clients)
