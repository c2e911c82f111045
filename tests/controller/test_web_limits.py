"""The fleet page's limits (review M2): one render per change shared by every event stream, a cap
on streams and on connections, idle and slow clients dropped, what was turned away said in the
log at most once a minute. The server is real (uvicorn in an asyncio loop, as the daemon runs
it) on 127.0.0.1, an ephemeral port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from reconciler.controller.store import Store
from reconciler.controller.web.hub import SECTIONS, Hub, PageState
from reconciler.controller.web.server import PageServer, serve_page
from reconciler.controller.web.stream import Refusals, SharedEvents, Streams
from tests.page_load import SERVICES, populate

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.timeout(60)]


def small_hub() -> Hub:
    hub = Hub()
    hub.run_started("a" * 40, "push", {"gpu-1": SimpleNamespace(ssh=SimpleNamespace(address="127.0.0.50"), labels={},
                                                                 services={"sglang": None})}, None)
    return hub


class Counting:
    """A render that counts its calls and says which sections it was asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, snap: PageState, sections: tuple[str, ...]) -> dict[str, str]:
        self.calls.append(sections)
        return {s: f"<p>{s} v{snap.versions[s]}</p>" for s in sections}


def test_one_render_per_change_is_shared_by_every_stream():
    hub, render = small_hub(), Counting()

    async def main() -> None:
        shared = SharedEvents(hub, render, ThreadPoolExecutor(1), min_gap=0)
        got = await asyncio.gather(*(shared.latest() for _ in range(200)))
        assert render.calls == [SECTIONS]                        # 200 streams, one render
        assert all(g[1]["grid"] is got[0][1]["grid"] for g in got)  # the very same bytes
        assert got[0][1]["live"].startswith(b"event: live\nid: ")
        hub.phase("gpu-1", "sglang", "loading", 1.0, 60)         # changes live and grid, not commits
        await asyncio.gather(*(shared.latest() for _ in range(200)))
        assert render.calls == [SECTIONS, ("live", "grid")]
        await shared.latest()                                    # nothing changed: nothing rendered
        assert shared.renders == 2

    asyncio.run(main())


def test_a_stream_sends_what_changed_and_a_heartbeat_when_idle():
    hub, render = small_hub(), Counting()

    async def main() -> list[bytes]:
        shared = SharedEvents(hub, render, ThreadPoolExecutor(1), min_gap=0)
        streams = Streams(hub, shared, Refusals(), keepalive=0, min_gap=0)
        v = hub.current_versions()
        gen = streams.events({**v, "grid": -1})                  # the client's grid is behind
        out = [await anext(gen), await anext(gen), await anext(gen)]
        hub.phase("gpu-1", "sglang", "loading", 1.0, 60)
        out.append(await anext(gen))
        await gen.aclose()
        return out

    retry, grid, idle, changed = asyncio.run(main())
    assert retry == b"retry: 2000\n\n" and idle == b": idle\n\n"
    assert grid.startswith(b"event: grid\n") and b"event: live" not in grid
    assert changed.count(b"event: ") == 2 and b"event: live\n" in changed and b"event: grid\n" in changed


def test_what_was_turned_away_is_said_at_most_once_a_minute(capsys):
    now = [0.0]
    r = Refusals(clock=lambda: now[0])
    r.note("event streams over the cap of 32")
    for _ in range(99):
        now[0] += 0.1
        r.note("event streams over the cap of 32")
    r.note("clients that did not read")
    now[0] = 61.0
    r.note("clients that did not read")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "reconciler: fleet page turned away 1 event streams over the cap of 32 (said at most once a minute; "
        "deploys go on)",
        "reconciler: fleet page turned away 2 clients that did not read, 99 event streams over the cap of 32 (said "
        "at most once a minute; deploys go on)"]
    assert r.total == {"event streams over the cap of 32": 100, "clients that did not read": 2}


@contextlib.asynccontextmanager
async def page_on(tmp_path: Path, hub: Hub, **limits: float) -> AsyncIterator[tuple[PageServer, int]]:
    """The page served as the daemon serves it, with the limits given."""
    Store(tmp_path / "state").close()
    page = await serve_page("127.0.0.1:0", hub, tmp_path / "state", **limits)  # type: ignore[arg-type]
    assert page is not None
    try:
        yield page, int(page.url.rsplit(":", 1)[1].strip("/"))
    finally:
        await page.stop(hub)


async def status_of(port: int, request: bytes | None = b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                    ) -> tuple[bytes, asyncio.StreamWriter]:
    """Open a connection, send `request`, read the status line. The caller closes the writer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if request:
        writer.write(request)
    line = await asyncio.wait_for(reader.readline(), 10)
    return line, writer


async def until(what: str, check, timeout: float = 10) -> None:
    """Wait (on the loop, so the server goes on serving) until check() holds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_streams_over_the_cap_get_503_and_a_closed_one_frees_its_slot(tmp_path):
    async def main() -> None:
        async with page_on(tmp_path, small_hub(), max_streams=2) as (page, port):
            first, w1 = await status_of(port)
            second, w2 = await status_of(port)
            third, w3 = await status_of(port)
            assert (first, second, third) == (b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\n",
                                              b"HTTP/1.1 503 Service Unavailable\r\n")
            assert page.streams.open == 2 and page.refusals.total == {"event streams over the cap of 2": 1}
            w1.close()
            await until("the server to see the first stream go", lambda: page.streams.open == 1)
            again, w4 = await status_of(port)
            assert again == b"HTTP/1.1 200 OK\r\n" and page.streams.open == 2
            page_line, w5 = await status_of(port, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert page_line == b"HTTP/1.1 200 OK\r\n"            # the page itself is not a stream
            for w in (w2, w3, w4, w5):
                w.close()

    asyncio.run(main())


def test_connections_over_the_cap_are_answered_503_at_once(tmp_path):
    async def main() -> None:
        async with page_on(tmp_path, small_hub(), max_connections=3) as (page, port):
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]   # send nothing
            line, w = await status_of(port, None)          # answered before it even asks
            assert line == b"HTTP/1.1 503 Service Unavailable\r\n"
            assert page.refusals.total == {"connections over the cap of 3": 1}
            w.close()
            for _, writer in idle:
                writer.close()

    asyncio.run(main())


def test_a_connection_that_never_finishes_its_request_is_dropped(tmp_path):
    async def main() -> bytes:
        async with page_on(tmp_path, small_hub(), head_timeout=0.2) as (page, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHo")                 # and then nothing (slowloris)
            got = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert page.refusals.total == {"idle connections (no request)": 1}
            return got

    assert asyncio.run(main()) == b""                             # closed by the server, no answer


def test_a_client_that_does_not_read_is_dropped_and_frees_its_stream(tmp_path):
    hub = populate(tmp_path / "state", tmp_path / "repo", 30)    # 30 hosts: tens of KiB per event

    async def main() -> None:
        async with page_on(tmp_path, hub, slow_client=0.3, send_buffer=16384) as (page, port):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)    # a small window, never read
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            sock.send(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await until("the stream to open", lambda: page.streams.open == 1)
            n = 0
            while not page.refusals.total:                        # a rollout goes on: more to send
                hub.phase(sorted(hub.fleet)[n % 30], SERVICES[0], "loading", float(n), 60)
                n += 1
                await asyncio.sleep(0.1)
                assert n < 200, "the slow client was never dropped"
            assert page.refusals.total == {"clients that did not read": 1}
            await until("its stream slot to be free", lambda: page.streams.open == 0)
            sock.close()

    asyncio.run(main())


# ---- the caps per client (review N10): a local user is told apart by the uid owning its socket --------

HOLDER = r"""
import socket, sys
port, n, request = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].encode().decode("unicode_escape").encode()
held = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    if request:
        s.sendall(request)
    f = s.makefile("rb")
    if request or i == n - 1:       # an idle one asks nothing, so only the last is read: refused or not?
        print(f.readline().decode().strip() or "(closed)", flush=True)
    else:
        print("(connected)", flush=True)
    held.append((s, f))
sys.stdin.read()          # hold every connection until the test lets go
"""


async def as_nobody(port: int, n: int, request: str) -> tuple[asyncio.subprocess.Process, list[str]]:
    """Another local user (uid nobody, through the system python it may run) opens `n`
    connections, sends `request` on each, and holds them open; the status lines it read."""
    proc = await asyncio.create_subprocess_exec("/usr/bin/python3", "-c", HOLDER, str(port), str(n), request,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                user=NOBODY, cwd="/")
    assert proc.stdout is not None
    lines = [(await asyncio.wait_for(proc.stdout.readline(), 10)).decode().strip() for _ in range(n)]
    return proc, lines


async def let_go(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    await proc.wait()


NOBODY = 65534
EVENTS = "GET /events HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n\\r\\n"


def test_one_local_user_cannot_take_every_stream_from_the_others(tmp_path):
    async def main() -> None:
        async with page_on(tmp_path, small_hub(), max_streams=6, max_streams_per_client=2) as (page, port):
            proc, lines = await as_nobody(port, 3, EVENTS)
            assert lines == ["HTTP/1.1 200 OK", "HTTP/1.1 200 OK", "HTTP/1.1 503 Service Unavailable"]
            assert page.streams.by_client == {f"uid {NOBODY}": 2}
            mine = [await status_of(port) for _ in range(2)]          # the operator (uid 0) still gets in
            assert [line for line, _ in mine] == [b"HTTP/1.1 200 OK\r\n"] * 2
            assert page.streams.by_client == {f"uid {NOBODY}": 2, "uid 0": 2}
            assert page.refusals.total == {"event streams over the cap of 2 per client": 1}
            await let_go(proc)
            await until("nobody's streams to close", lambda: page.streams.by_client == {"uid 0": 2})
            for _, w in mine:
                w.close()

    asyncio.run(main())


def test_one_local_user_cannot_take_every_connection_from_the_others(tmp_path):
    async def main() -> None:
        async with page_on(tmp_path, small_hub(), max_connections=10, max_connections_per_client=3) as (page, port):
            proc, lines = await as_nobody(port, 4, "")                # idle sockets: they never ask anything
            assert lines == ["(connected)"] * 3 + ["HTTP/1.1 503 Service Unavailable"]
            await until("the refused one to be closed", lambda: page.clients.connections == {f"uid {NOBODY}": 3})
            line, w = await status_of(port, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert line == b"HTTP/1.1 200 OK\r\n"
            assert page.refusals.total == {"connections over the cap of 3 per client": 1}
            w.close()
            await let_go(proc)
            await until("every connection to be gone", lambda: not page.clients.connections)
            assert page.clients.by_peer == {}

    asyncio.run(main())


def test_the_global_caps_still_hold_for_clients_not_told_apart(tmp_path):
    """Over the caps a client is refused whoever it is: per-client caps only add to them."""
    async def main() -> None:
        async with page_on(tmp_path, small_hub(), max_streams=2, max_streams_per_client=2) as (page, port):
            proc, lines = await as_nobody(port, 1, EVENTS)
            first, w1 = await status_of(port)
            second, w2 = await status_of(port)
            assert (lines, first, second) == (["HTTP/1.1 200 OK"], b"HTTP/1.1 200 OK\r\n",
                                              b"HTTP/1.1 503 Service Unavailable\r\n")
            assert page.refusals.total == {"event streams over the cap of 2": 1}
            await let_go(proc)
            for w in (w1, w2):
                w.close()

    asyncio.run(main())
