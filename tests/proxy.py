"""A TCP proxy for fault injection in the end-to-end tests (stdlib only; loopback only).

It sits between the controller and one test host's sshd and forwards bytes both ways until told
otherwise:

    cut()        every open connection is closed on both sides with an RST (SO_LINGER 0), as a
                 crashed middlebox or a rebooted peer would; new connections are reset at once
                 until heal()
    blackhole()  nothing is forwarded either way, but every socket stays open: a partition
                 with no RST and no FIN. Bytes that arrive meanwhile are held, not dropped (TCP
                 would retransmit them), and new connections are accepted but go nowhere
    heal()       forwarding resumes; held bytes (and a FIN that arrived during a blackhole)
                 are delivered in order, as they would be when a partition ends

The proxy runs its own asyncio loop on a daemon thread, so a synchronous test drives it with
plain calls; each call returns once the proxy has acted. Usage::

    with Proxy(("127.0.0.20", 22)) as p:      # listens on 127.0.0.1:<p.port>
        ...; p.blackhole(); ...; p.heal()
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

_LINGER_RST = struct.pack("ii", 1, 0)     # SO_LINGER on, 0 s: close() sends an RST


def _loopback(host: str) -> str:
    if not ipaddress.ip_address(host).is_loopback or ipaddress.ip_address(host).version != 4:
        raise ValueError(f"{host}: the test proxy only binds to and connects to 127.0.0.0/8")
    return host


def _reset(w: asyncio.StreamWriter | None) -> None:
    """Close a connection with an RST (never a FIN)."""
    if w is None or w.transport.is_closing():
        return
    sock = w.transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    w.transport.abort()


@dataclass(eq=False)          # hashed by identity: kept in a set
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


@dataclass
class Stats:
    """What went through the proxy (for test diagnostics)."""

    accepted: int = 0
    reset: int = 0                 # connections closed with an RST by cut() (or refused while cut)
    to_upstream: int = 0           # bytes forwarded client -> host
    to_client: int = 0             # bytes forwarded host -> client


class Proxy:
    """Forwards 127.0.0.1:<port> to `upstream` until cut or blackholed; see the module docstring."""

    def __init__(self, upstream: tuple[str, int], listen: str = "127.0.0.1"):
        self.upstream = (_loopback(upstream[0]), upstream[1])
        self.listen = _loopback(listen)
        self.port = 0
        self.stats = Stats()
        self.mode = "forward"                      # forward | blackhole | cut
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-proxy", daemon=True)
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Conn] = set()

    # ---- the test's side (any thread) ----

    def start(self) -> Proxy:
        self._thread.start()
        self._call(self._start())
        return self

    def cut(self) -> None:
        """Reset every open connection (RST both sides); refuse new ones until heal()."""
        self._call(self._cut())

    def blackhole(self) -> None:
        """Stop forwarding both ways; keep every socket open (no RST, no FIN)."""
        self._call(self._set("blackhole"))

    def heal(self) -> None:
        """Forward again: what was held is delivered, new connections go through."""
        self._call(self._set("forward"))

    def open_connections(self) -> int:
        return self._call(self._count())

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # ---- the proxy's loop ----

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._handle, self.listen, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _set(self, mode: str) -> None:
        assert self._flowing is not None
        self.mode = mode
        if mode == "forward":
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _cut(self) -> None:
        await self._set("cut")
        for c in list(self._conns):
            self.stats.reset += 1
            _reset(c.client)
            _reset(c.upstream)
        await asyncio.sleep(0)

    async def _count(self) -> int:
        return len(self._conns)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            _reset(c.client)
            _reset(c.upstream)
            for t in c.tasks:
                t.cancel()
        await asyncio.sleep(0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        self.stats.accepted += 1
        if self.mode == "cut":
            self.stats.reset += 1
            _reset(writer)
            return
        conn = _Conn(writer)
        self._conns.add(conn)
        try:
            await self._flowing.wait()             # blackholed: accepted, but nothing behind it
            if self.mode == "cut" or writer.transport.is_closing():
                _reset(writer)
                return
            try:
                up_r, up_w = await asyncio.open_connection(*self.upstream)
            except OSError:
                _reset(writer)
                return
            conn.upstream = up_w
            conn.tasks = [asyncio.create_task(self._pump(reader, up_w, conn, "to_upstream")),
                          asyncio.create_task(self._pump(up_r, writer, conn, "to_client"))]
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            for w in (writer, conn.upstream):
                if w is not None and not w.transport.is_closing():
                    w.close()

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: _Conn, counter: str) -> None:
        assert self._flowing is not None
        try:
            while True:
                await self._flowing.wait()
                data = await r.read(65536)
                await self._flowing.wait()         # what arrived during a blackhole is held here
                if self.mode == "cut":
                    return
                if not data:                       # a FIN: pass it on (half-close), keep the other way
                    if w.can_write_eof() and not w.transport.is_closing():
                        w.write_eof()
                    return
                w.write(data)
                await w.drain()
                setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
        except (ConnectionError, OSError):
            # One side reset: so does the other (a peer whose connection is gone answers with RST).
            _reset(conn.client)
            _reset(conn.upstream)
