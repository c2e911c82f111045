"""The metrics endpoint's server (review M2, L2): a port someone else holds is said and the
metrics stay off (the daemon still starts); at most MAX_SCRAPES connections at once, idle clients
dropped. prometheus-client's ASGI app in the running event loop, on a real socket, 127.0.0.1, an
ephemeral port: on a server of its own, or at the fleet page's /metrics when both share an address."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from reconciler.controller import metrics as metrics_mod
from reconciler.controller.metrics import Metrics, on_the_page
from reconciler.controller.web.hub import Hub
from reconciler.controller.web.server import serve_page

pytestmark = pytest.mark.timeout(60)


async def get(port: int, path: str = "/metrics") -> tuple[int, str]:
    """One GET on a fresh connection: (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def test_metrics_on_a_taken_port_are_said_and_left_off(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:      # another process got there first
        port = taken.getsockname()[1]
        assert asyncio.run(Metrics().serve(f"127.0.0.1:{port}")) is None
    assert (f"reconciler: metrics off: cannot listen on 127.0.0.1:{port}: Address already in use: another process "
            "listens there") in capsys.readouterr().out


def test_metrics_serve_a_few_at_once_and_drop_idle_clients():
    async def main() -> str:
        server = await Metrics().serve("127.0.0.1:0", head_timeout=0.5)
        assert server is not None
        try:
            idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(metrics_mod.MAX_SCRAPES)]
            status, _ = await get(server.port)                       # every slot holds an idle client
            assert status == 503
            for reader, writer in idle:                              # dropped by the server after 0.5 s
                assert await asyncio.wait_for(reader.read(100), 10) == b""
                writer.close()
            while server.gated.open:                                 # the slots free as the server sees them go
                await asyncio.sleep(0.01)
            status, body = await get(server.port)
            assert status == 200
            assert server.gated.refusals.total == {"connections over the cap of 8": 1,
                                                   "idle connections (no request)": metrics_mod.MAX_SCRAPES}
            return body
        finally:
            await server.stop()
    assert "reconciler_runs_total" in asyncio.run(main())


def test_metrics_on_the_pages_address_are_served_by_the_page(tmp_path: Path, capsys):
    assert on_the_page("127.0.0.1:9188", "127.0.0.1:9188") and not on_the_page("127.0.0.1:9187", "127.0.0.1:9188")
    assert not on_the_page("127.0.0.1:0", "127.0.0.1:0")          # two ephemeral ports are two

    async def main() -> tuple[tuple[int, str], tuple[int, str]]:
        hub = Hub()
        m = Metrics()
        m.runs.labels("ok").inc()
        page = await serve_page("127.0.0.1:0", hub, tmp_path / "state", metrics=m.app())
        assert page is not None
        port = int(page.url.rsplit(":", 1)[1].strip("/"))
        try:
            return await get(port), await get(port, "/")
        finally:
            await page.stop(hub)
    (status, body), (front, _page) = asyncio.run(main())
    assert status == 200 and 'reconciler_runs_total{result="ok"} 1.0' in body
    assert front == 200
    out = capsys.readouterr().out
    assert "reconciler: metrics on http://127.0.0.1:" in out and out.count("/metrics") == 1
