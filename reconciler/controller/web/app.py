"""The fleet page's server: a starlette app, served by uvicorn inside the daemon's event loop.

Imported only when the page is on (`web` in the controller config, `reconcile watch --web`), so
no other `reconcile` run loads starlette, uvicorn or Jinja2.

    GET /               the page: the live rollout, hosts x services, commits; ?label=K=V&q=TEXT filter it
    GET /hosts/{name}   one host: its services and every attempt (durations, reasons, journal lines)
    GET /events         server-sent events: the page's sections re-rendered when the hub says they changed
    GET /static/...     the CSS and the script (package data: the page needs no internet)

Read-only: there is no other method and no route that changes anything. The data comes from the
state store (a connection per request: the store is SQLite, and the daemon writes it) and the
hub; every model passes through redact (view.redacted) and Jinja2 escapes it. A Host header
other than the loopback names is refused while the page listens on loopback (a DNS-rebinding
page in the operator's browser cannot read it), and the responses forbid framing and scripts
from anywhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import jinja2
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...redact import redact
from ..store import Store
from . import view
from .hub import SECTIONS, Hub, Snapshot
from .view import CommitInfo, Commits

KEEPALIVE = 15.0        # seconds between comments on an idle event stream (proxies, dead peers)
MIN_GAP = 0.25          # at most four renders a second per stream while a rollout reports phases
HEADERS = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
           (b"x-frame-options", b"DENY"),
           (b"content-security-policy", b"default-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                                        b"form-action 'self'")]
LOOPBACK_NAMES = ["localhost", "127.0.0.1", "[::1]"]


class GitCommits:
    """Commit subjects and times from the deploy repo (pygit2), cached: commits never change.

    The repo's path comes from the hub (the daemon sets it each run); a revision git does not
    know (yet) has no subject and is asked again next time."""

    def __init__(self, path: Callable[[], str | None], limit: int = 4096):
        self.path, self.limit = path, limit
        self.cache: dict[str, CommitInfo] = {}
        self._repo: Any = None
        self._repo_path: str | None = None

    def __call__(self, rev: str) -> CommitInfo | None:
        if rev in self.cache:
            return self.cache[rev]
        path = self.path()
        if not path:
            return None
        import pygit2
        try:
            if self._repo is None or self._repo_path != path:
                self._repo, self._repo_path = pygit2.Repository(path), path
            obj = self._repo.get(rev)
        except (pygit2.GitError, ValueError, KeyError):
            return None
        if not isinstance(obj, pygit2.Commit):
            return None
        lines = (obj.message or "").strip().splitlines()
        # masked before it is cut: a token cut in half would no longer look like one
        info = CommitInfo(redact(lines[0])[:120] if lines else "", float(obj.commit_time))
        if len(self.cache) >= self.limit:
            self.cache.clear()
        self.cache[rev] = info
        return info


class _SecurityHeaders:
    """Add HEADERS to every response (pages, the event stream, static files)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *HEADERS]
            await send(message)
        await self.app(scope, receive, send_with)


class Page:
    """Renders the page and its sections from the store, the hub and the repo."""

    def __init__(self, hub: Hub, state_dir: Path, commits: Commits, *, repo: str, branch: str):
        self.hub, self.state_dir, self.commits = hub, state_dir, commits
        self.about = {"repo": repo, "branch": branch}
        self.env = jinja2.Environment(loader=jinja2.PackageLoader("reconciler.controller.web", "templates"),
                                      autoescape=True, trim_blocks=True, lstrip_blocks=True)

    def rows(self) -> list[dict[str, Any]]:
        store = Store(self.state_dir)
        try:
            return store.status()
        finally:
            store.close()

    def model(self, snap: Snapshot, sections: tuple[str, ...], rows: list[dict[str, Any]] | None = None,
              **filters: str) -> dict[str, Any]:
        """The redacted model of the sections asked for (one store read for all of them)."""
        need_rows = rows is None and ("grid" in sections or "commits" in sections)
        rows = self.rows() if need_rows else rows or []
        m: dict[str, Any] = {"about": self.about, "versions": snap.versions}
        if "live" in sections:
            m["live"] = view.live(snap, self.commits)
        if "grid" in sections:
            m["grid"] = view.grid(rows, snap, self.commits, **filters)
        if "commits" in sections:
            m["commits"] = view.commits(rows, self.commits, snap.wall)
        return view.redacted(m)

    def render(self, template: str, model: dict[str, Any]) -> str:
        return self.env.get_template(template).render(**model)

    async def index(self, request: Request) -> Response:
        label, q = request.query_params.get("label", ""), request.query_params.get("q", "")
        m = self.model(self.hub.snapshot(), SECTIONS, label=label, q=q)
        m.update(view.redacted({"label": label, "q": q}))
        return HTMLResponse(self.render("index.html", m))

    async def host(self, request: Request) -> Response:
        name = request.path_params["name"]
        snap = self.hub.snapshot()
        store = Store(self.state_dir)
        try:
            attempts, rows = store.history(name, limit=200), store.status()
        finally:
            store.close()
        if not attempts and name not in snap.fleet and not any(r["host"] == name for r in rows):
            m = view.redacted({"about": self.about, "name": name})
            return HTMLResponse(self.render("missing.html", m), status_code=404)
        m = view.redacted({"about": self.about, "h": view.history(name, attempts, rows, snap, self.commits)})
        return HTMLResponse(self.render("host.html", m))

    async def events(self, request: Request) -> Response:
        """Server-sent events: one event per section (live, grid, commits) whose version moved
        since what the client has (?live=N&grid=N&commits=N); its data is the section's HTML."""
        seen: dict[str, int] = {}
        for s in SECTIONS:
            with contextlib.suppress(ValueError):
                seen[s] = int(request.query_params.get(s, ""))

        async def stream() -> AsyncIterator[str]:
            nonlocal seen
            yield "retry: 2000\n\n"
            while not self.hub.closed:
                snap = self.hub.snapshot()
                changed = tuple(s for s in SECTIONS if snap.versions[s] != seen.get(s))
                if not changed:
                    await self.hub.wait(seen, KEEPALIVE)
                    if self.hub.snapshot().versions == seen:
                        yield ": idle\n\n"
                    continue
                m = self.model(snap, changed)
                for s in changed:
                    yield sse(s, self.render(f"_{s}.html", m), snap.versions[s])
                seen = snap.versions
                await asyncio.sleep(MIN_GAP)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})


def sse(event: str, html: str, version: int) -> str:
    """One server-sent event: its name, an id, and the section's HTML (rendered from a redacted
    model, like the page) as data lines."""
    data = "".join(f"data: {line}\n" for line in html.splitlines() or [""])
    return f"event: {event}\nid: {version}\n{data}\n"


def allowed_hosts(bind: str) -> list[str]:
    """The Host header names the page answers: the loopback names while it listens on loopback."""
    try:
        loopback = ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        loopback = bind == "localhost"
    if not loopback:
        return ["*"]
    named = f"[{bind}]" if ":" in bind and not bind.startswith("[") else bind
    return sorted({*LOOPBACK_NAMES, named})


def create_app(hub: Hub, state_dir: Path, *, repo: str = "", branch: str = "", commits: Commits | None = None,
               bind: str = "127.0.0.1") -> Starlette:
    """The page's ASGI app. commits: the subject and time of a revision (default: the repo the
    hub names, via pygit2). bind: the address it listens on (which Host headers it answers)."""
    page = Page(hub, state_dir, commits or GitCommits(lambda: hub.repo_path), repo=repo, branch=branch)
    static = StaticFiles(packages=[("reconciler.controller.web", "static")])
    return Starlette(
        routes=[Route("/", page.index), Route("/hosts/{name}", page.host), Route("/events", page.events),
                Mount("/static", app=static, name="static")],
        middleware=[Middleware(_SecurityHeaders), Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(bind))])


class _Server(uvicorn.Server):
    """uvicorn inside the daemon's loop: the daemon owns SIGTERM and SIGINT, not the server."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


def parse_address(address: str) -> tuple[str, int]:
    """host:port, [v6]:port or :port (loopback) -> (host, port). ValueError names what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"web = {address!r}: expected host:port, e.g. 127.0.0.1:9188")
    return host.strip("[]") or "127.0.0.1", int(port)


class PageServer:
    """The page listening on its socket, served by a task in the daemon's loop."""

    def __init__(self, server: _Server, task: asyncio.Task[None], url: str):
        self.server, self.task, self.url = server, task, url

    async def stop(self, hub: Hub) -> None:
        hub.close()                      # event streams end, so the shutdown waits for nothing
        self.server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self.task, 5)


async def serve_page(address: str, hub: Hub, state_dir: Path, *, repo: str = "", branch: str = "") -> PageServer | None:
    """Listen on `address` and serve the page from the running loop. A page that cannot listen
    (address in use, bad address) is said once and left off: deploys never wait on it."""
    try:
        host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family)
    except (ValueError, OSError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(redact(f"reconciler: fleet page off: cannot listen on {address}: {why}"), flush=True)
        return None
    app = create_app(hub, state_dir, repo=repo, branch=branch, bind=host)
    config = uvicorn.Config(app, lifespan="off", http="h11", ws="none", log_config=None, access_log=False,
                            server_header=False, proxy_headers=False, timeout_graceful_shutdown=2)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/"
    print(f"reconciler: fleet page on {url}", flush=True)
    return PageServer(server, task, url)
