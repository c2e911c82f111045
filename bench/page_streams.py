"""The daemon's event-loop lag while many browsers follow the fleet page's event stream (prints figures).

    .venv/bin/python -m bench.page_streams [--streams 100,250,500] [--seconds 6] [--hosts 30] [--cap N]

The page is served the way `reconcile watch` serves it (web/server.py's serve_page: uvicorn in the
running asyncio loop, on 127.0.0.1, an ephemeral port), from a store and a hub as bench/web_load.py
fills them (30 hosts x 2 services, a rollout in progress). In that same loop a rollout reports a
health phase every 0.1 s (each one changes the page's live and grid sections, so every open
stream has something to send) and a probe sleeps 0.05 s again and again and records how late it
wakes: the lag that the systemd watchdog pings and the host-lock heartbeats would see. N clients
in a child process (tests/page_load.py) open `GET /events` at once and read for `--seconds`.

Printed per N: what the clients got (200: a stream, 503: refused), the events the served streams
received, and the loop's lag (max, p99, median). `--cap N` sets the page's stream cap where the
page has one, and its connection cap above it (to see what serving N streams costs, not only
refusing them). Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.web_load import SERVICES, populate
from tests.page_load import Lag, clients_result, rollout_phases, start_clients


async def one(n: int, seconds: float, hosts: int, cap: int | None) -> dict[str, object]:
    """Serve the page, open n streams for `seconds` while a rollout reports phases; the figures."""
    try:
        from reconciler.controller.web.server import serve_page
    except ImportError:         # before the page's limits (main at 23f9f9a): serve_page lived in app.py
        from reconciler.controller.web.app import serve_page  # type: ignore[no-redef]
    with tempfile.TemporaryDirectory(prefix="page-streams-") as tmp:
        hub = populate(Path(tmp) / "state", Path(tmp) / "repo", hosts)
        extra: dict[str, int] = {}
        params = inspect.signature(serve_page).parameters
        if cap is not None and "max_streams" in params:
            extra = {"max_streams": cap, "max_connections": cap + 16}     # room for the streams' sockets
        if "max_streams_per_client" in params:
            # The clients are one user here: the caps per client are the global ones, so the figures
            # are the page's load as before the caps per client (web/peer.py).
            from reconciler.controller.web.server import MAX_CONNECTIONS, MAX_STREAMS
            extra["max_streams_per_client"] = extra.get("max_streams", MAX_STREAMS)
            extra["max_connections_per_client"] = extra.get("max_connections", MAX_CONNECTIONS)
        page = await serve_page("127.0.0.1:0", hub, Path(tmp) / "state", repo="/srv/git/fleet.git", branch="main",
                                **extra)
        assert page is not None
        port = int(page.url.rsplit(":", 1)[1].strip("/"))
        stop, lag = asyncio.Event(), Lag()
        probe = asyncio.create_task(lag.run(stop))
        phases = asyncio.create_task(rollout_phases(hub, sorted(hub.fleet), SERVICES[0], stop, 0.1))
        t0 = time.monotonic()
        proc = start_clients(port, n, seconds)
        try:
            got = await asyncio.to_thread(clients_result, proc, seconds + 120)
        finally:
            wall = time.monotonic() - t0
            stop.set()
            await asyncio.gather(probe, phases)
            await page.stop(hub)
    events = got["events"]
    assert isinstance(events, list)
    return {"n": n, "outcomes": got["outcomes"], "events": events, "lag": lag.figures(), "wall": wall,
            "mib": float(got["bytes"]) / 2**20}  # type: ignore[arg-type]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="100,250,500", help="comma-separated client counts")
    ap.add_argument("--seconds", type=float, default=6.0, help="how long each client reads")
    ap.add_argument("--hosts", type=int, default=30)
    ap.add_argument("--cap", type=int, help="the page's event-stream cap, where it has one")
    args = ap.parse_args()
    print(f"fleet page event streams, {args.hosts} hosts x {len(SERVICES)} services, a phase every 0.1 s; "
          f"clients hold {args.seconds:.0f} s; {os.cpu_count()} CPU cores; cap {args.cap or 'default'}")
    for n in (int(x) for x in args.streams.split(",")):
        r = await one(n, args.seconds, args.hosts, args.cap)
        lag, events = r["lag"], r["events"]
        assert isinstance(lag, dict) and isinstance(events, list)
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(r["outcomes"].items()))  # type: ignore[attr-defined]
        per = f"median {statistics.median(events):.0f} events per stream" if events else "no stream served"
        print(f"  {n:4d} clients: {outcomes}; {per}, {r['mib']:.1f} MiB read; "
              f"loop lag max {lag['max'] * 1000:7.1f} ms, p99 {lag['p99'] * 1000:7.1f} ms, "
              f"median {lag['median'] * 1000:5.1f} ms ({lag['samples']:.0f} samples, {r['wall']:.1f} s)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
