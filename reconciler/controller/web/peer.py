"""Who is on the other end of a connection to the page, so that its caps hold per client (review
N10): who counts as one client is in docs/web.md ("Limits, per client"). A loopback peer's user
is asked of the kernel's socket table (NETLINK_SOCK_DIAG: one exact lookup by the connection's
four addresses, as `ss -e` does; no privilege needed); the kernel may not say (the peer is gone
already, another network namespace, no sock_diag), and then only the page's global caps apply.

A client is a string: "uid 1000", "203.0.113.7".
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
from collections import Counter
from typing import Any

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
NO_COOKIE = 0xFFFFFFFF
ALL_STATES = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")            # nlmsghdr
_REQUEST = struct.Struct("=BBBxI")          # inet_diag_req_v2 before its sockid
_UID_AT = _HEADER.size + 4 + 48 + 12       # inet_diag_msg: family..retrans, sockid, expires/rqueue/wqueue


def _address(family: int, host: str) -> bytes:
    """An address as inet_diag_sockid holds it: 16 bytes, IPv4 in the first four."""
    return socket.inet_pton(family, host).ljust(16, b"\0")


class SocketOwners:
    """Asks the kernel's socket table who owns a TCP socket on this machine, over one netlink
    socket kept open (about 11 us an answer here, against 85 us with a socket per question)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._seq = 0

    def uid(self, family: int, peer: tuple[Any, ...], local: tuple[Any, ...]) -> int | None:
        """The uid owning the socket that connects from `peer` to `local` (our accepted
        connection's two ends), or None when the kernel does not say (gone, closing, unknown)."""
        sockid = (struct.pack("!HH", int(peer[1]), int(local[1])) + _address(family, peer[0])
                  + _address(family, local[0]) + struct.pack("=III", 0, NO_COOKIE, NO_COOKIE))
        body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, ALL_STATES) + sockid
        self._seq = self._seq % 0xFFFFFFFF + 1
        message = _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, self._seq, 0) + body
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                                           NETLINK_SOCK_DIAG)
            self._sock.sendto(message, (0, 0))
            while True:        # the answer is queued before sendto returns; never wait for one
                reply = self._sock.recv(8192, socket.MSG_DONTWAIT)
                if len(reply) >= _HEADER.size and _HEADER.unpack_from(reply)[3] == self._seq:
                    break
        except (OSError, ValueError):
            self.close()
            return None
        return parse_owner(reply)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def parse_owner(reply: bytes) -> int | None:
    """PURE: the uid in a sock_diag answer, or None: an error (no such socket), a short answer, or
    a socket no process holds any more (closed by its owner, TIME_WAIT: the kernel then reports
    uid 0 and inode 0)."""
    if len(reply) < _UID_AT + 8:
        return None
    kind = _HEADER.unpack_from(reply)[1]
    uid, inode = struct.unpack_from("=II", reply, _UID_AT)
    if kind != SOCK_DIAG_BY_FAMILY or inode == 0:
        return None
    return int(uid)


def client_of(sock: socket.socket | None, owners: SocketOwners) -> str | None:
    """The client an accepted connection belongs to (see the module docstring), or None."""
    if sock is None:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        family = sock.family
        if family not in (socket.AF_INET, socket.AF_INET6):
            return None
        peer, local = sock.getpeername(), sock.getsockname()
        if not ipaddress.ip_address(peer[0]).is_loopback:
            return str(peer[0])
        uid = owners.uid(family, peer, local)
        return f"uid {uid}" if uid is not None else None
    return None


class Clients:
    """The page's open connections by client: which client each connection (its peer's address
    and port, as the request's scope names it) belongs to, and how many each client holds."""

    def __init__(self, owners: SocketOwners | None = None):
        self.owners = owners or SocketOwners()
        self.by_peer: dict[tuple[str, int], str | None] = {}
        self.connections: Counter[str] = Counter()

    def opened(self, sock: socket.socket | None, peer: tuple[Any, ...] | None) -> str | None:
        """A connection was accepted: its client (None: not told apart), counted."""
        client = client_of(sock, self.owners)
        if peer is not None:
            self.by_peer[(str(peer[0]), int(peer[1]))] = client
        if client is not None:
            self.connections[client] += 1
        return client

    def closed(self, peer: tuple[Any, ...] | None, client: str | None) -> None:
        if peer is not None:
            self.by_peer.pop((str(peer[0]), int(peer[1])), None)
        if client is not None:
            self.connections -= Counter({client: 1})      # in place; a client at zero is dropped

    def of(self, peer: tuple[Any, ...] | list[Any] | None) -> str | None:
        """The client of the connection a request came on (its scope's "client"), or None."""
        if not peer or len(peer) < 2:
            return None
        return self.by_peer.get((str(peer[0]), int(peer[1])))
