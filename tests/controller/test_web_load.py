"""500 browsers on the fleet page's event stream must not stall the daemon's loop (review M2).

That loop pings the systemd watchdog and keeps the host locks' heartbeats going during a deploy,
so its lag is a safety property, asserted here: the page served as `reconcile watch` serves it
(real uvicorn in this loop, 127.0.0.1, an ephemeral port), 30 hosts x 2 services and a rollout
reporting a phase every 0.1 s (each one changes what every stream shows), 500 clients in a child
process opening `GET /events` at once and reading for 5 s, and a task on the loop that sleeps
0.05 s again and again and records how late it wakes. Before the page's limits (main 23f9f9a)
the same load stalled the loop for 6 to 10 s (bench/results/page_streams.txt).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from reconciler.controller.web.server import MAX_CONNECTIONS, serve_page
from reconciler.controller.web.stream import MAX_STREAMS, MIN_GAP
from tests.page_load import SERVICES, Lag, clients_result, populate, rollout_phases, start_clients

CLIENTS = 500
HOLD = 5.0                 # seconds each client reads its stream
MAX_LAG = 0.5              # seconds: far below the watchdog's 15 s pings, and the heartbeats'


@pytest.mark.timeout(90)
def test_500_event_stream_clients_never_stall_the_loop(tmp_path: Path) -> None:
    hub = populate(tmp_path / "state", tmp_path / "repo", 30)

    async def main() -> tuple[dict[str, object], dict[str, float], int, int]:
        # The 500 clients are one local user here, standing for 500 browsers: the caps per client are
        # the global ones (test_web_limits.py tests those caps with a second user).
        page = await serve_page("127.0.0.1:0", hub, tmp_path / "state", repo="/srv/git/fleet.git", branch="main",
                                max_streams_per_client=MAX_STREAMS, max_connections_per_client=MAX_CONNECTIONS)
        assert page is not None
        port = int(page.url.rsplit(":", 1)[1].strip("/"))
        stop, lag = asyncio.Event(), Lag(0.05)
        probe = asyncio.create_task(lag.run(stop))
        phases = asyncio.create_task(rollout_phases(hub, sorted(hub.fleet), SERVICES[0], stop, 0.1))
        try:
            got = await asyncio.to_thread(clients_result, start_clients(port, CLIENTS, HOLD), HOLD + 60)
        finally:
            stop.set()
            reported = (await asyncio.gather(probe, phases))[1]
            renders = page.streams.shared.renders
            await page.stop(hub)
        return got, lag.figures(), renders, reported

    got, lag, renders, phases = asyncio.run(main())
    events = got["events"]
    assert isinstance(events, list)
    print(f"\n{CLIENTS} event-stream clients for {HOLD:.0f} s, {phases} phases reported: {got['outcomes']}; "
          f"{renders} renders shared by the {len(events)} streams served (events per stream: min {min(events)}, "
          f"max {max(events)}); loop lag max {lag['max'] * 1000:.1f} ms, p99 {lag['p99'] * 1000:.1f} ms, "
          f"median {lag['median'] * 1000:.1f} ms over {lag['samples']:.0f} samples")
    assert got["outcomes"] == {"200": MAX_STREAMS, "503": CLIENTS - MAX_STREAMS}
    assert min(events) >= 10                     # the served streams followed the rollout live
    assert renders <= phases                     # one render per change at most, whatever the client count
    assert renders <= (HOLD + 10) / MIN_GAP       # and at most one per MIN_GAP
    assert lag["max"] < MAX_LAG, f"the loop stalled for {lag['max']:.3f} s"
