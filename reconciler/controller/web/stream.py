"""The page's server-sent events (`GET /events`), cheap for the daemon's loop however many watch.

The loop that serves the page also pings the systemd watchdog and keeps the host locks' heartbeats
going during a deploy: a page that stalls it for seconds gets the daemon killed mid-deploy. So:

- One render per change, shared: SharedEvents renders the sections whose version moved once (in
  the page's own thread, not on the loop; at most one render per MIN_GAP) and every stream sends
  the same bytes (500 viewers each rendering on the loop stalled it for seconds at each phase of
  a rollout: bench/page_streams.py).
- Caps: at most `cap` streams at once (MAX_STREAMS), and `cap_per_client` of one client (peer.py;
  one not told apart meets the global cap only), so one local user cannot hold every stream
  (review N10); the next one is answered 503 with a Retry-After (the page's script tries again
  later), and the count is said in the log (Refusals).
- Level-based, no backlog: a stream holds only the versions it sent. What a client has not read
  yet waits in its socket (the server's send blocks above the transport's 64 KiB high-water
  mark, so that is one event at most beyond it), and a client that does not read for SLOW_CLIENT
  seconds is dropped (server.py): one slow reader costs a bounded buffer, never the others' time.
- A stream with nothing to send for KEEPALIVE seconds sends a comment (proxies, dead peers).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor

from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from .hub import SECTIONS, Hub, PageState
from .peer import Clients

KEEPALIVE = 15.0        # seconds between comments on an idle event stream (proxies, dead peers)
MIN_GAP = 0.25          # at most four renders a second, and four sends a second per stream
MAX_STREAMS = 32        # event streams open at once; the next is answered 503
MAX_STREAMS_PER_CLIENT = 4   # of one client (a stream per open tab of the page)
RETRY_AFTER = 30        # seconds a refused stream is asked to wait (the page's script does)
SAY_EVERY = 60.0        # seconds between the log lines about what the page turned away

# The HTML of the sections asked for, from a snapshot of the hub (Page.sections).
Render = Callable[[PageState, tuple[str, ...]], dict[str, str]]


def sse(event: str, html: str, version: int) -> str:
    """One server-sent event: its name, an id, and the section's HTML (rendered from a redacted
    model, like the page) as data lines."""
    data = "".join(f"data: {line}\n" for line in html.splitlines() or [""])
    return f"event: {event}\nid: {version}\n{data}\n"


class Refusals:
    """What the page turned away or dropped (streams or connections over their caps, idle or slow
    clients), said in the daemon's log: the first at once, then at most one line per SAY_EVERY
    with the counts since the last line (a flood must not flood the journal too)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, every: float = SAY_EVERY,
                 name: str = "fleet page"):
        self.clock, self.every, self.name = clock, every, name
        self.counts: Counter[str] = Counter()
        self.total: Counter[str] = Counter()
        self.said: float | None = None

    def note(self, what: str) -> None:
        """One more of `what` (e.g. "event streams over the cap of 32")."""
        self.counts[what] += 1
        self.total[what] += 1
        now = self.clock()
        if self.said is not None and now - self.said < self.every:
            return
        self.said = now
        told = ", ".join(f"{n} {w}" for w, n in sorted(self.counts.items()))
        self.counts.clear()
        print(f"reconciler: {self.name} turned away {told} (said at most once a minute; deploys go on)", flush=True)


class SharedEvents:
    """The sections' events at the hub's latest versions, rendered once per change and shared by
    every stream. One caller renders (in `executor`, off the loop); the others wait for it."""

    def __init__(self, hub: Hub, render: Render, executor: Executor, *, min_gap: float = MIN_GAP):
        self.hub, self.render, self.executor, self.min_gap = hub, render, executor, min_gap
        self.versions: dict[str, int] = {}
        self.events: dict[str, bytes] = {}
        self.renders = 0
        self._rendered_at = float("-inf")
        self._lock: asyncio.Lock | None = None

    async def latest(self) -> tuple[dict[str, int], dict[str, bytes]]:
        """(versions, section -> event) at the hub's versions now, rendering what changed."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.hub.current_versions() != self.versions:
                loop = asyncio.get_running_loop()
                wait = self._rendered_at + self.min_gap - loop.time()
                if wait > 0:                     # a rollout reports many phases a second
                    await asyncio.sleep(wait)
                versions, fresh = await loop.run_in_executor(self.executor, self._changed, self.versions)
                self.events = {**self.events, **fresh}
                self.versions = versions
                self._rendered_at = loop.time()
                self.renders += 1
            return self.versions, self.events

    def _changed(self, have: dict[str, int]) -> tuple[dict[str, int], dict[str, bytes]]:
        """In the executor: the hub's versions now and the events of the sections not at `have`
        (the snapshot's deep copy, the store's read and Jinja2 all stay off the loop)."""
        snap = self.hub.snapshot()
        stale = tuple(s for s in SECTIONS if snap.versions[s] != have.get(s))
        html = self.render(snap, stale) if stale else {}
        return dict(snap.versions), {s: sse(s, html[s], snap.versions[s]).encode() for s in stale}


class Streams:
    """The open event streams: at most `cap`, each sending the shared events it has not sent."""

    def __init__(self, hub: Hub, shared: SharedEvents, refusals: Refusals, *, cap: int = MAX_STREAMS,
                 keepalive: float = KEEPALIVE, min_gap: float = MIN_GAP, clients: Clients | None = None,
                 cap_per_client: int = MAX_STREAMS_PER_CLIENT):
        self.hub, self.shared, self.refusals = hub, shared, refusals
        self.cap, self.keepalive, self.min_gap = cap, keepalive, min_gap
        self.clients, self.cap_per_client = clients, cap_per_client    # clients: set by the server
        self.open = 0
        self.by_client: Counter[str] = Counter()

    def refused(self, client: str | None) -> str | None:
        """Why one more stream of `client` is over a cap, or None when it may open."""
        if self.open >= self.cap:
            return f"event streams over the cap of {self.cap}"
        if client is not None and self.by_client[client] >= self.cap_per_client:
            return f"event streams over the cap of {self.cap_per_client} per client"
        return None

    async def events(self, seen: dict[str, int]) -> AsyncIterator[bytes]:
        """The stream's bytes: every section whose version moved since `seen`, as the hub moves."""
        yield b"retry: 2000\n\n"
        while not self.hub.closed:
            if self.hub.current_versions() == seen:
                await self.hub.wait(seen, self.keepalive)
                if not self.hub.closed and self.hub.current_versions() == seen:
                    yield b": idle\n\n"
                continue
            versions, events = await self.shared.latest()
            out = b"".join(events[s] for s in SECTIONS if versions[s] != seen.get(s))
            seen = versions
            if out:
                yield out
            await asyncio.sleep(self.min_gap)


class EventStream(StreamingResponse):
    """An event stream that counts itself open (and its client's) while it runs; past a cap it is
    a 503 instead. The check and the count happen in one step of the loop (no await between them)."""

    def __init__(self, streams: Streams, seen: dict[str, int]):
        super().__init__(streams.events(seen), media_type="text/event-stream",
                         headers={"cache-control": "no-store", "x-accel-buffering": "no"})
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streams = self.streams
        client = streams.clients.of(scope.get("client")) if streams.clients is not None else None
        why = streams.refused(client)
        if why is not None:
            await self.body_iterator.aclose()      # type: ignore[attr-defined]
            streams.refusals.note(why)
            busy = PlainTextResponse("too many event streams open: try again later\n", status_code=503,
                                     headers={"retry-after": str(RETRY_AFTER), "cache-control": "no-store"})
            await busy(scope, receive, send)
            return
        streams.open += 1
        if client is not None:
            streams.by_client[client] += 1
        try:
            await super().__call__(scope, receive, send)
        finally:
            streams.open -= 1
            if client is not None:
                streams.by_client -= Counter({client: 1})     # in place; a client at zero is dropped
