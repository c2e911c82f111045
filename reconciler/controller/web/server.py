"""The page's HTTP server: uvicorn inside the daemon's event loop, with limits that keep the loop,
and the daemon's file descriptors, free for deploys whatever the clients do.

- At most MAX_CONNECTIONS sockets at once, and MAX_CONNECTIONS_PER_CLIENT of one client (peer.py:
  a local user by the uid owning the connecting socket, `ssh -L` included; a remote peer by its
  address): the next one is answered 503 and closed as soon as it is accepted, so one client
  cannot take every slot (review N10). (uvicorn's own limit_concurrency acts only once a request
  has arrived: sockets that never send one would still hold the daemon's file descriptors, which
  its SSH connections and its state store need.)
- A connection must send its request's head within HEAD_TIMEOUT seconds, the first one and every
  next one on a kept-alive connection (a client that trickles a header byte by byte is dropped).
- What a client has not read yet is bounded: the kernel's send buffer of its socket is set to
  SEND_BUFFER (Linux would grow it to 4 MiB), the transport's to its 64 KiB high-water mark (the
  server's next send waits for it), and a client that does not read for SLOW_CLIENT seconds while
  both are full is dropped: it never holds memory or a stream slot for long.
- Event streams have their own caps, global and per client, and share one render per change
  (stream.py).

What is turned away is said in the log, at most once a minute (stream.Refusals).

A port it cannot listen on (taken by someone else, a bad address) is said once and the page is
left off: deploys never wait on it, and the daemon still starts. A local user who binds the port
first serves whatever they like to whoever opens a tunnel to it: the log line says so, and only
a socket bound before any user can (a systemd socket unit, a port below 1024) would prevent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ...redact import redact
from ..config import cannot_listen, parse_address, public_note
from .app import create_app
from .hub import Hub
from .peer import Clients
from .stream import MAX_STREAMS, MAX_STREAMS_PER_CLIENT, Refusals, Streams

MAX_CONNECTIONS = 64        # sockets open at once (event streams included)
MAX_CONNECTIONS_PER_CLIENT = 16   # of one client (a browser opens up to 6 to a host, a few tabs more)
HEAD_TIMEOUT = 10.0         # seconds to send a request's head
SLOW_CLIENT = 10.0          # seconds a client may leave what it was sent unread
SEND_BUFFER = 256 * 1024    # bytes of the socket's kernel send buffer (a few events of a large fleet)
# The listen backlog, which is also how many connections the loop accepts in one step: a burst of
# connects is taken in steps of this size (uvicorn's 2048 made one step of a 500-client burst long).
BACKLOG = 128
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 5\r\n"
        b"retry-after: 5\r\nconnection: close\r\n\r\nbusy\n")


class _Limited(H11Protocol):
    """uvicorn's h11 protocol with the page's limits (a subclass per server carries them)."""

    refusals: Refusals
    clients: Clients
    max_connections = MAX_CONNECTIONS
    max_connections_per_client = MAX_CONNECTIONS_PER_CLIENT
    head_timeout = HEAD_TIMEOUT
    slow_client = SLOW_CLIENT
    send_buffer = SEND_BUFFER
    _head: asyncio.TimerHandle | None = None
    _stall: asyncio.TimerHandle | None = None
    _peer: tuple[Any, ...] | None = None
    _client: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        self._peer = transport.get_extra_info("peername")
        self._client = self.clients.opened(sock, self._peer)
        if len(self.connections) > self.max_connections:
            self._busy(f"connections over the cap of {self.max_connections}")
            return
        if self._client is not None and self.clients.connections[self._client] > self.max_connections_per_client:
            self._busy(f"connections over the cap of {self.max_connections_per_client} per client")
            return
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(self.send_buffer))
        self._head = self.loop.call_later(self.head_timeout, self._drop, "idle connections (no request)", False)

    def _busy(self, why: str) -> None:
        self.refusals.note(why)
        self.transport.write(BUSY)          # a few bytes into an empty socket buffer: never blocks
        self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self._head is not None and self.cycle is not None and not self.cycle.response_complete:
            self._head.cancel()             # a request's head has come: its response is under way
            self._head = None

    def on_response_complete(self) -> None:
        if self._head is not None:
            self._head.cancel()
        self._head = self.loop.call_later(self.head_timeout, self._drop, "idle connections (no request)", False)
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.slow_client, self._drop, "clients that did not read", True)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head, self._stall):
            if timer is not None:
                timer.cancel()
        self._head = self._stall = None
        self.clients.closed(self._peer, self._client)
        self._peer = self._client = None
        super().connection_lost(exc)

    def _drop(self, why: str, unread: bool) -> None:
        """Close at once, dropping what is buffered: a client that does not read would otherwise
        keep a closing socket (and its buffer) open for ever."""
        if unread or not self.transport.is_closing():
            self.refusals.note(why)
            self.transport.abort()


def limited_protocol(refusals: Refusals, clients: Clients, **limits: float) -> type[H11Protocol]:
    """The protocol class for one server: its refusals log, its clients, and limits other than the
    defaults (max_connections, max_connections_per_client, head_timeout, slow_client, send_buffer:
    tests and the benchmark)."""
    return type("PageProtocol", (_Limited,), {"refusals": refusals, "clients": clients, **limits})


class _Server(uvicorn.Server):
    """uvicorn inside the daemon's loop: the daemon owns SIGTERM and SIGINT, not the server."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


class PageServer:
    """The page listening on its socket, served by a task in the daemon's loop; its event streams
    and what it turned away (for the tests and the benchmark)."""

    def __init__(self, server: _Server, task: asyncio.Task[None], url: str, executor: ThreadPoolExecutor,
                 streams: Streams, refusals: Refusals, clients: Clients):
        self.server, self.task, self.url, self.executor = server, task, url, executor
        self.streams, self.refusals, self.clients = streams, refusals, clients

    async def stop(self, hub: Hub) -> None:
        hub.close()                      # event streams end, so the shutdown waits for nothing
        self.server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self.task, 5)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.clients.owners.close()


async def serve_page(address: str, hub: Hub, state_dir: Path, *, repo: str = "", branch: str = "",
                     max_streams: int = MAX_STREAMS, max_streams_per_client: int = MAX_STREAMS_PER_CLIENT,
                     **limits: Any) -> PageServer | None:
    """Listen on `address` and serve the page from the running loop. A page that cannot listen
    (address in use, bad address) is said once and left off: deploys never wait on it. One that
    listens beyond loopback (the config allowed it: web_public) says so."""
    try:
        host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family)
    except (ValueError, OSError) as e:
        print(redact(f"reconciler: fleet page off: {cannot_listen(address, e)}"), flush=True)
        return None
    refusals, clients = Refusals(), Clients()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-page")
    app = create_app(hub, state_dir, repo=repo, branch=branch, bind=host, executor=executor, refusals=refusals,
                     max_streams=max_streams)
    streams = app.state.page.streams
    streams.clients, streams.cap_per_client = clients, max_streams_per_client    # the streams' caps per client
    config = uvicorn.Config(app, lifespan="off", http=limited_protocol(refusals, clients, **limits), ws="none",
                            log_config=None, access_log=False, server_header=False, proxy_headers=False,
                            timeout_graceful_shutdown=2, backlog=BACKLOG)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/"
    print(f"reconciler: fleet page on {url}{public_note('web', host)}", flush=True)
    return PageServer(server, task, url, executor, streams, refusals, clients)
