"""Connections kept open between runs: what makes a warm daemon round cheap.

`reconcile watch` reconciles the fleet every `interval` and on every push. Opening an SSH
connection costs a TCP handshake, a key exchange and an authentication on both sides (the
host's sshd forks, and PAM or not, that is most of a no-change run's host CPU). A `Pool` keeps
one connection per host across runs: a run *leases* it through `Pool.connector()` (a
`Connector`, like `reconcile.ssh_connector`), and the transport's close() gives it back instead
of closing it. A warm no-change round then costs the host lock and one observation per host.

What keeps it safe:
- A connection is keyed by the host's name *and* its SSH spec (address, port, user, pinned
  key, known_hosts): a commit that changes how a host is reached connects afresh, and its host
  key is verified again, never inherited from the old connection.
- A connection that broke (asyncssh closed it: keepalive found the peer gone, a reset) is
  dropped when it is next leased or given back, and a new one is opened then.
- The first command of a lease on a *reused* connection that fails because the connection is
  gone (ConnectError) is retried once on a fresh connection: that first command is the host
  lock or the observation, neither of which changed anything. A failure after that is the
  run's, as with a fresh connection (Unreachable), and the connection is dropped.
- Bounded: connections idle longer than `idle` seconds, and those of hosts that left the fleet
  (`retain`), are closed; a host that is leased twice at once gets a second, unpooled connection.
- `close()` closes them all (the daemon's SIGTERM).

A `standing` pool (the daemon's) also keeps a standing session on each reused connection
(session.py: the session loop in bash, no lock), started at its second lease: a run's commands
go through it while it is free, each a frame on a channel already open, where a channel of their
own costs the host an sshd session and a login shell, and the observation runs in that bash
itself. One that broke (a command timed out) is started again at the next lease; one that never
came up (no bash) is not, on that connection.

The pool is I/O glue: no decision of the planner depends on whether a connection was reused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import msgspec

from ..desired.spec import HostSpec, SSHSpec
from ..errors import ConnectError
from .session import HostSession, SessionTransport, stand
from .transport import Completed, Spawned, Transport, close_quietly

Connect = Callable[[HostSpec], Awaitable[Transport]]
_T = TypeVar("_T")
IDLE = 900.0          # seconds a connection may sit unused before the pool closes it
# Seconds of silence after which a standing session ends by itself: a backstop only (the pool
# closes the connection, and the session with it). A daemon's interval may be longer than the
# pool's own `idle` (a connection used at every run is kept), so it is not that.
STANDING_IDLE = 24 * 3600.0


class _Entry(msgspec.Struct):
    transport: Transport
    key: tuple[str, SSHSpec]
    leased: bool = False
    used: float = msgspec.field(default_factory=time.monotonic)
    session: HostSession | None = None      # its standing session (a standing pool's)

    def through(self, t: Transport) -> Transport:
        """Where a command on `t` goes: the standing session while it is up on this connection
        (it sends a command it cannot take to a channel of its own), else `t` itself."""
        s = self.session
        return SessionTransport(t, s) if s is not None and t is self.transport and not s.broken else t


def _alive(t: Transport) -> bool:
    """False when the connection under a transport is known to be closed (asyncssh says so)."""
    conn = getattr(t, "_conn", None)
    is_closed = getattr(conn, "is_closed", None)
    return not (callable(is_closed) and is_closed())


class Pool:
    """One open connection per host, leased to one run at a time."""

    def __init__(self, connect: Connect, *, idle: float = IDLE, clock: Callable[[], float] = time.monotonic,
                 standing: bool = False):
        self._connect, self.idle, self.clock, self.standing = connect, idle, clock, standing
        self._entries: dict[str, _Entry] = {}
        self.opened = 0          # connections opened since the pool started (for tests and metrics)
        self.reused = 0          # leases served by an open connection

    def __len__(self) -> int:
        return len(self._entries)

    def connector(self) -> Connect:
        """A Connector for one run: it leases pooled connections."""
        return self.lease

    async def lease(self, host: HostSpec) -> Transport:
        key = (host.name, host.ssh)
        e = self._entries.get(host.name)
        if e is not None and not e.leased:
            if e.key == key and _alive(e.transport):
                e.leased, e.used = True, self.clock()
                self.reused += 1
                if self.standing and (e.session is None or (e.session.broken and e.session.came_up)):
                    e.session = await stand(e.transport, STANDING_IDLE)
                return _Leased(self, e, host, reused=True)
            del self._entries[host.name]           # broken, or the host is now reached another way
            await close_quietly(e.transport)
            e = None
        t = await self._connect(host)
        self.opened += 1
        if e is not None:                           # leased already: a second, unpooled connection
            return t
        e = _Entry(t, key, leased=True, used=self.clock())
        self._entries[host.name] = e
        return _Leased(self, e, host, reused=False)

    async def _fresh(self, e: _Entry, host: HostSpec) -> Transport:
        """Replace a leased entry's dead connection with a new one (same lease)."""
        await close_quietly(e.transport)
        e.session = None
        e.transport = await self._connect(host)
        self.opened += 1
        return e.transport

    async def _give_back(self, e: _Entry, broken: bool) -> None:
        e.leased, e.used = False, self.clock()
        if broken or not _alive(e.transport):
            if self._entries.get(e.key[0]) is e:
                del self._entries[e.key[0]]
            await close_quietly(e.transport)

    async def retain(self, names: Iterable[str]) -> None:
        """Close the connections of hosts not in `names` and those idle for longer than `idle`."""
        keep, now = set(names), self.clock()
        gone = [n for n, e in self._entries.items()
                if not e.leased and (n not in keep or now - e.used > self.idle)]
        for n in gone:
            await close_quietly(self._entries.pop(n).transport)

    async def close(self) -> None:
        entries, self._entries = list(self._entries.values()), {}
        await asyncio.gather(*(close_quietly(e.transport) for e in entries))


class _Leased:
    """A pooled transport for one run: close() gives the connection back to the pool."""

    def __init__(self, pool: Pool, entry: _Entry, host: HostSpec, *, reused: bool):
        self._pool, self._entry, self._spec = pool, entry, host
        self.host = host.name
        self._retry = reused           # the first call on a reused connection may reconnect once
        self._broken = False
        self._closed = False

    async def _call(self, op: Callable[[Transport], Awaitable[_T]]) -> _T:
        try:
            try:
                out = await op(self._entry.transport)
            except ConnectError:
                if not self._retry:
                    raise
                self._retry = False
                out = await op(await self._pool._fresh(self._entry, self._spec))
        except ConnectError:        # the connection (or the fresh one) is gone: not given back
            self._broken = True
            raise
        self._retry = False
        return out

    async def run(self, cmd: str, *, input: str | None = None, check: bool = False,
                  timeout: float | None = 60.0, what: str = "command") -> Completed:
        return await self._call(lambda t: self._entry.through(t).run(cmd, input=input, check=check,
                                                                      timeout=timeout, what=what))

    async def open_connection(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await self._entry.transport.open_connection(host, port)
        except (OSError, ConnectionError):
            if not _alive(self._entry.transport):
                self._broken = True
            raise

    async def spawn(self, cmd: str) -> Spawned:
        return await self._call(lambda t: t.spawn(cmd))

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._pool._give_back(self._entry, self._broken)
