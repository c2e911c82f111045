"""A real load balancer for the drain tests (issue 42): Debian's HAProxy, in a test host of its
own, in front of test hosts that serve one model.

The balancer host is a container booted like the others (tests/fleet.py) from the same root
filesystem (HAProxy is in its package list, off at boot), with one directory of this machine
bound at /run/lb inside it: HAProxy's runtime API socket lands there, so the controller (this
machine, as the reconciler's controller would) speaks to it over a Unix socket, as an operator
does with `socat`: `set server models/h1 state drain|ready|maint`, `show stat`. Its frontend
listens on the balancer host's own loopback address; every backend is a test host's
address and port. Only 127.0.0.0/8, as every test host.

    lb = start("egl", "127.0.0.132", [("eg122", "127.0.0.122", 30000), ...])
    lb.command("set server models/eg122 state drain")
    lb.ready()            # how many servers HAProxy sends traffic to now
    stop(lb)
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from reconciler.plan.drain import ServerStat, parse_show_stat
from tests import fleet as fleetlib

if TYPE_CHECKING:
    from tests.conftest import Fleet

BACKEND = "models"
PORT = 8080
SOCKET_DIR = "/run/lb"               # inside the balancer host; bound to a directory of this machine
CONFIG = "/etc/haproxy/haproxy.cfg"


def config(servers: Sequence[tuple[str, str, int]], frontend: str, *, health: str = "/health",
           check_ms: int = 200) -> str:
    """haproxy.cfg for one model behind `frontend` ("127.0.0.132:8080"): one backend, a server
    per (name, address, port), checked with GET `health` every `check_ms` (down after 2
    failures, up after 1 success). A connection refused is retried on another server (retries,
    redispatch), as operators configure it; a request already sent to a server is never retried."""
    lines = [
        "global",
        f"    stats socket {SOCKET_DIR}/admin.sock mode 600 level admin",
        "    stats timeout 30s",
        "    maxconn 4000",
        "",
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        "    timeout client 120s",
        "    timeout server 120s",
        "    retries 3",
        "    option redispatch",
        "",
        f"frontend {BACKEND}",
        f"    bind {frontend}",
        f"    default_backend {BACKEND}",
        "",
        f"backend {BACKEND}",
        "    balance roundrobin",
        "    option httpchk",
        f"    http-check send meth GET uri {health}",
        f"    default-server inter {check_ms}ms fall 2 rise 1",
    ]
    lines += [f"    server {name} {address}:{port} check" for name, address, port in servers]
    return "\n".join(lines) + "\n"


@dataclass
class Balancer:
    """A running HAProxy: its host, the runtime API socket on this machine, its frontend."""

    host: fleetlib.Host
    socket: Path
    frontend: str

    @property
    def url(self) -> str:
        return f"http://{self.frontend}"

    def command(self, line: str, timeout: float = 5.0) -> str:
        """One runtime API command; what HAProxy answered."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(self.socket))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def stats(self) -> dict[str, ServerStat]:
        """'models/<server>' -> status and sessions, from `show stat`."""
        return parse_show_stat(self.command("show stat"))

    def served(self) -> dict[str, int]:
        """Requests each server has been sent so far (`show stat` stot), by server name."""
        text = self.command("show stat")
        header = text.splitlines()[0][2:].split(",")
        sv, total = header.index("svname"), header.index("stot")
        return {row[sv]: int(row[total]) for row in (line.split(",") for line in text.splitlines()[1:])
                if len(row) > total and row[sv] not in ("FRONTEND", "BACKEND") and row[total].isdigit()}

    def ready(self) -> int:
        """How many servers HAProxy sends traffic to now (UP: not DOWN, DRAIN or MAINT)."""
        return sum(1 for s in self.stats().values() if s.serving)

    def state(self, server: str, state: str) -> None:
        """`set server models/<server> state <state>`; HAProxy answers nothing when it took it."""
        said = self.command(f"set server {BACKEND}/{server} state {state}").strip()
        if said:
            raise AssertionError(f"HAProxy refused 'state {state}' for {server}: {said}")


def start(name: str, address: str, servers: Sequence[tuple[str, str, int]], *, health: str = "/health",
          timeout: float = 60.0) -> Balancer:
    """Boot the balancer host `name` on `address`, write its haproxy.cfg and start HAProxy
    (Debian's unit); return once the runtime API answers."""
    sock_dir = fleetlib.RUN_DIR / f"{name}-lb"
    sock_dir.mkdir(parents=True, exist_ok=True)
    (sock_dir / "admin.sock").unlink(missing_ok=True)
    host = fleetlib.boot(name, address, binds=[f"--bind={sock_dir}:{SOCKET_DIR}"])
    fleetlib.wait_ready([host], timeout=timeout)
    known = fleetlib.write_known_hosts([host], fleetlib.RUN_DIR / f"known_hosts.{name}")
    text = config(servers, f"{address}:{PORT}", health=health)
    script = (f"cat > {CONFIG} <<'EOF'\n{text}EOF\n"
              f"haproxy -c -q -f {CONFIG} && systemctl restart haproxy && systemctl is-active haproxy")
    res = subprocess.run([*fleetlib.ssh_base(address, known), script], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise fleetlib.FleetError(f"HAProxy did not start on {name}: {res.stdout}{res.stderr}")
    lb = Balancer(host, sock_dir / "admin.sock", f"{address}:{PORT}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            lb.command("show info")
            return lb
        except OSError as e:
            if time.monotonic() > deadline:
                raise fleetlib.FleetError(f"HAProxy's runtime API on {lb.socket} did not answer: {e}") from None
            time.sleep(0.1)


def stop(lb: Balancer) -> None:
    """Stop the balancer host (its HAProxy with it)."""
    fleetlib.stop(lb.host.name)


def fixtures(count: int, port: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A drain test module's two fixtures, `lb_host, lb = balancer.fixtures(3, PORT)`: `lb_host`,
    HAProxy on a host of its own after the fleet's addresses, in front of the fleet's first
    `count` hosts at `port` (booted once per module); `lb`, the same with each of those servers
    back in rotation (a test may have drained one)."""
    from tests.conftest import FLEET_FIRST, FLEET_PREFIX, FLEET_SIZE

    @pytest.fixture(scope="module")
    def lb_host(fleet_session: Fleet) -> Iterator[Balancer]:
        backends = [(h.name, h.address, port) for h in fleet_session.hosts[:count]]
        try:
            lb = start(f"{FLEET_PREFIX}lb", f"127.0.0.{FLEET_FIRST + FLEET_SIZE}", backends)
        except fleetlib.FleetError as e:
            pytest.fail(f"the balancer could not start (run .ci/setup as root): {e}", pytrace=False)
        yield lb
        stop(lb)

    @pytest.fixture
    def lb(lb_host: Balancer, fleet: Fleet) -> Balancer:
        for h in fleet.hosts[:count]:
            lb_host.state(h.name, "ready")
        return lb_host

    return lb_host, lb
