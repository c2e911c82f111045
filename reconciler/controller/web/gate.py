"""An ASGI app served by uvicorn inside the daemon's event loop, behind a gate that keeps the loop,
and the daemon's file descriptors, free for deploys whatever the clients do: the fleet page
(server.py) and the metrics endpoint on an address of its own (metrics.py). How the gate sits in
front of uvicorn, and the limits: docs/web.md ("Limits, per client", "How it is built"). Nothing
of uvicorn's is subclassed or imported from a private module.

- At most `max_connections` sockets at once, and `max_connections_per_client` of one client
  (peer.py), answered 503 as soon as accepted. (uvicorn's limit_concurrency acts only once a
  request has arrived: sockets that never send one would still hold file descriptors, which the
  daemon's SSH connections and its state store need.)
- `head_timeout` holds for the first request's head and every next one on a kept-alive
  connection (a client that trickles a header byte by byte is dropped).
- What a client has not read is bounded: the socket's kernel send buffer is set to `send_buffer`
  (Linux would grow it to 4 MiB), the transport's to its 64 KiB high-water mark, and a client
  that leaves both full for `slow_client` seconds is dropped.

What is turned away is said in the log, at most once a minute (stream.Refusals).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import msgspec

if TYPE_CHECKING:        # uvicorn and starlette load when a server starts (metrics.py imports Limits)
    import uvicorn
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from .peer import Clients
    from .stream import Refusals

# The listen backlog, which is also how many connections the loop accepts in one step: a burst of
# connects is taken in steps of this size (uvicorn's 2048 made one step of a 500-client burst long).
BACKLOG = 128
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 5\r\n"
        b"retry-after: 5\r\nconnection: close\r\n\r\nbusy\n")


class Limits(msgspec.Struct, frozen=True):
    """What one server lets its clients hold (server.py's and metrics.py's defaults)."""

    max_connections: float
    max_connections_per_client: float
    head_timeout: float              # seconds to send a request's head
    slow_client: float               # seconds a client may leave what it was sent unread
    send_buffer: float               # bytes of the socket's kernel send buffer


class Gated(msgspec.Struct):
    """What every connection of one server shares: its limits, its open connections (by peer:
    the ASGI scope's "client" finds one), its clients and what it turned away."""

    limits: Limits
    refusals: Refusals
    clients: Clients
    serve: Callable[..., asyncio.Protocol] = asyncio.Protocol   # uvicorn's h11 protocol (set by serve)
    open: dict[tuple[str, int], _Gate] = msgspec.field(default_factory=dict)


class _Gate(asyncio.Protocol):
    """One connection: counted, refused or handed to uvicorn's protocol; timed (module docstring).
    The subclass made for each server (serve) names what it shares."""

    gated: Gated

    def __init__(self, **uvicorn_args: Any):
        self._uvicorn_args = uvicorn_args    # what uvicorn gives its protocols, passed on as it is
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._peer: tuple[str, int] | None = None
        self._client: str | None = None
        self._head: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gated, limits = self.gated, self.gated.limits
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        peer = transport.get_extra_info("peername")
        self._peer = (str(peer[0]), int(peer[1])) if peer else None
        self._client = gated.clients.opened(sock, peer)
        if self._peer is not None:
            gated.open[self._peer] = self
        if len(gated.open) > limits.max_connections:
            self._busy(f"connections over the cap of {limits.max_connections:g}")
        elif self._client is not None and gated.clients.connections[self._client] > limits.max_connections_per_client:
            self._busy(f"connections over the cap of {limits.max_connections_per_client:g} per client")
        else:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(limits.send_buffer))
            self._inner = gated.serve(**self._uvicorn_args)
            self._inner.connection_made(transport)
            self.waiting_for_request()

    def _busy(self, why: str) -> None:
        self.gated.refusals.note(why)
        assert self._transport is not None
        self._transport.write(BUSY)          # a few bytes into an empty socket buffer: never blocks
        self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def request_started(self) -> None:
        """A request's head has come (its app runs): no head timeout while it is answered."""
        if self._head is not None:
            self._head.cancel()
            self._head = None

    def waiting_for_request(self) -> None:
        """The connection is open, or its last response went out: the next head must come soon."""
        self.request_started()
        if self._transport is not None and not self._transport.is_closing():
            self._head = asyncio.get_running_loop().call_later(
                self.gated.limits.head_timeout, self._drop, "idle connections (no request)", False)

    def pause_writing(self) -> None:
        if self._stall is None:
            self._stall = asyncio.get_running_loop().call_later(
                self.gated.limits.slow_client, self._drop, "clients that did not read", True)
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head, self._stall):
            if timer is not None:
                timer.cancel()
        self._head = self._stall = None
        if self._peer is not None and self.gated.open.get(self._peer) is self:
            del self.gated.open[self._peer]
        self.gated.clients.closed(self._peer, self._client)
        self._peer = self._client = None
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def _drop(self, why: str, unread: bool) -> None:
        """Close at once, dropping what is buffered: a client that does not read would otherwise
        keep a closing socket (and its buffer) open for ever."""
        transport = self._transport
        if transport is not None and (unread or not transport.is_closing()):
            self.gated.refusals.note(why)
            transport.abort()


class _Requests:
    """ASGI middleware that tells a connection's gate when a request is answered (its head has
    come) and when its response went out (the next head's timeout starts)."""

    def __init__(self, app: ASGIApp, gated: Gated):
        self.app, self.gated = app, gated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        peer = scope.get("client")
        gate = self.gated.open.get((str(peer[0]), int(peer[1]))) if scope["type"] == "http" and peer else None
        if gate is None:
            await self.app(scope, receive, send)
            return
        gate.request_started()

        async def sent(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                gate.waiting_for_request()
        await self.app(scope, receive, sent)


def listen_at(address: str, what: str) -> tuple[str, socket.socket, str] | None:
    """The listening socket for `address` (host:port), its host and its URL (http://host:port/);
    None, said once as "`what` off: why" (a port in use, a bad address), where it cannot be had:
    a server of the daemon's that cannot listen stays off, the daemon goes on."""
    from ...redact import redact
    from ..config import cannot_listen, parse_address
    try:
        host, port = parse_address(address)
        sock = listen(host, port)
    except (ValueError, OSError) as e:
        print(redact(f"reconciler: {what} off: {cannot_listen(address, e)}"), flush=True)
        return None
    shown = f"[{host}]" if ":" in host else host
    return host, sock, f"http://{shown}:{sock.getsockname()[1]}/"


def listen(host: str, port: int) -> socket.socket:
    """The listening socket (IPv6 for a v6 address); OSError, with the system's own words, when it
    cannot be had."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def serve(app: ASGIApp, sock: socket.socket, gated: Gated) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """Serve `app` on the listening `sock` from the running loop, behind the gate; the server and
    its task (stop_server stops them). uvicorn's serve takes SIGINT and SIGTERM for
    itself while it runs and raises a caught one again when it ends; the daemon's own handlers
    (the loop's) see each signal all the same, through the loop's wake-up descriptor."""
    import uvicorn
    h11 = uvicorn.Config(app, http="h11", log_config=None)   # uvicorn's h11 protocol serves an admitted one
    h11.load()
    gated.serve = h11.http_protocol_class
    gate = type("Gate", (_Gate,), {"gated": gated})
    config = uvicorn.Config(_Requests(app, gated), lifespan="off", http=gate, ws="none", log_config=None,
                            access_log=False, server_header=False, proxy_headers=False, timeout_graceful_shutdown=2,
                            backlog=BACKLOG)
    server = uvicorn.Server(config)
    return server, asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))


async def stop_server(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    """Stop a server `serve` started: ask it to exit, and wait for its task 5 s at most."""
    server.should_exit = True
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
