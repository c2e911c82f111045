"""Who a page connection belongs to (web/peer.py): the kernel's answer read purely, a remote peer
by its address, a loopback one by the uid owning its socket (asked of this machine's kernel)."""

from __future__ import annotations

import socket
import struct
import subprocess

from reconciler.controller.web import peer

NOBODY = 65534


def answer(kind: int = peer.SOCK_DIAG_BY_FAMILY, uid: int = 1000, inode: int = 4242, cut: int = 0) -> bytes:
    """A sock_diag answer as the kernel frames it: nlmsghdr, then inet_diag_msg."""
    body = struct.pack("=BBBB", socket.AF_INET, 1, 0, 0) + b"\0" * 48 + struct.pack("=IIIII", 0, 0, 0, uid, inode)
    data = peer._HEADER.pack(peer._HEADER.size + len(body), kind, 0, 1, 0) + body
    return data[:len(data) - cut]


def test_reading_the_kernels_answer():
    assert peer.parse_owner(answer()) == 1000
    assert peer.parse_owner(answer(uid=0)) == 0
    assert peer.parse_owner(answer(inode=0)) is None            # closed by its process: nobody's
    assert peer.parse_owner(answer(kind=peer.NLMSG_ERROR)) is None
    assert peer.parse_owner(answer(cut=1)) is None


class Remote:
    """An accepted socket from a peer beyond loopback (no such address may be used here)."""

    family = socket.AF_INET

    def getpeername(self) -> tuple[str, int]:
        return ("203.0.113.7", 51000)

    def getsockname(self) -> tuple[str, int]:
        return ("198.51.100.1", 9188)


def test_a_remote_peer_is_its_address_and_nothing_is_a_client_not_told_apart():
    owners = peer.SocketOwners()
    assert peer.client_of(Remote(), owners) == "203.0.113.7"    # type: ignore[arg-type]
    assert peer.client_of(None, owners) is None
    a, b = socket.socketpair()
    assert peer.client_of(a, owners) is None                    # not TCP: not told apart
    a.close(), b.close()


def test_a_loopback_peer_is_the_uid_that_owns_its_socket():
    owners = peer.SocketOwners()
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    child = subprocess.Popen(["/usr/bin/python3", "-c", f"import socket, sys; s = socket.create_connection("
                              f"('127.0.0.1', {port})); print('ok', flush=True); sys.stdin.read()"],
                             user=NOBODY, cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    theirs, _ = srv.accept()
    assert child.stdout is not None and child.stdout.readline() == "ok\n"
    mine = socket.create_connection(("127.0.0.1", port))
    ours, _ = srv.accept()
    assert peer.client_of(theirs, owners) == f"uid {NOBODY}"
    assert peer.client_of(ours, owners) == "uid 0"
    assert child.stdin is not None
    child.stdin.close()
    child.wait()
    mine.close()
    for s in (theirs, ours, srv):
        s.close()
    owners.close()
