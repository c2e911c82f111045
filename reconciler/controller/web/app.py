"""The fleet page's ASGI app (starlette), imported only when the page is on (web/__init__.py).

    GET /               the page: the live rollout, hosts x services, commits; ?label=K=V&q=TEXT filter it
    GET /hosts/{name}   one host: its services and every attempt (durations, reasons, journal lines)
    GET /events         server-sent events: the page's sections re-rendered when the hub says they changed
    GET /static/...     the CSS and the script (package data: the page needs no internet)

Read-only: there is no other method and no route that changes anything. The data comes from the
state store (a connection per request: the store is SQLite, and the daemon writes it) and the
hub; every model passes through redact (view.redacted) and Jinja2 escapes it. Rendering (the
store's read, the view, Jinja2) runs in the page's own thread, one render at a time, never on the
daemon's loop (stream.py: the event streams share one render per change). A Host header other
than the loopback names is refused while the page listens on loopback (a DNS-rebinding page in the
operator's browser cannot read it), and the responses forbid framing and scripts from anywhere
else.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...redact import redact
from ..config import is_loopback
from ..store import Store
from . import hosts, view
from .hub import SECTIONS, Hub, PageState
from .stream import MAX_STREAMS, EventStream, Refusals, SharedEvents, Streams
from .view import CommitInfo, Commits

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
    """Renders the page and its sections from the store, the hub and the repo: in `executor` (one
    thread: one render at a time, and the repo's pygit2 handle is only ever used there)."""

    def __init__(self, hub: Hub, state_dir: Path, commits: Commits, *, repo: str, branch: str,
                 executor: Executor, refusals: Refusals, max_streams: int = MAX_STREAMS):
        self.hub, self.state_dir, self.commits, self.executor = hub, state_dir, commits, executor
        self.about = {"repo": repo, "branch": branch}
        self.env = jinja2.Environment(loader=jinja2.PackageLoader("reconciler.controller.web", "templates"),
                                      autoescape=True, trim_blocks=True, lstrip_blocks=True)
        self.streams = Streams(hub, SharedEvents(hub, self.sections, executor), refusals, cap=max_streams)

    def rows(self) -> list[dict[str, Any]]:
        """The store's status rows, each with its service's last measured restart cost."""
        with contextlib.closing(Store(self.state_dir)) as store:
            return hosts.with_costs(store.status(), store.costs())

    def model(self, snap: PageState, sections: tuple[str, ...], rows: list[dict[str, Any]] | None = None,
              **filters: str) -> dict[str, Any]:
        """The redacted model of the sections asked for (one store read for all of them)."""
        need_rows = rows is None and ("grid" in sections or "commits" in sections)
        rows = self.rows() if need_rows else rows or []
        m: dict[str, Any] = {"about": self.about, "versions": snap.versions}
        if "live" in sections:
            m["live"] = view.live(snap, self.commits)
        if "grid" in sections:
            m["grid"] = hosts.grid(rows, snap, self.commits, **filters)
        if "commits" in sections:
            m["commits"] = view.commits(rows, self.commits, snap.wall)
        return view.redacted(m)

    def render(self, template: str, model: dict[str, Any]) -> str:
        return self.env.get_template(template).render(**model)

    def sections(self, snap: PageState, sections: tuple[str, ...]) -> dict[str, str]:
        """The HTML of `sections` at `snap` (what the event streams send), from one model."""
        m = self.model(snap, sections)
        return {s: self.render(f"_{s}.html", m) for s in sections}

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def index(self, request: Request) -> Response:
        label, q = request.query_params.get("label", ""), request.query_params.get("q", "")
        return HTMLResponse(await self._off_loop(self._index, label, q))

    def _index(self, label: str, q: str) -> str:
        m = self.model(self.hub.snapshot(), SECTIONS, label=label, q=q)
        m.update(view.redacted({"label": label, "q": q}))
        return self.render("index.html", m)

    async def host(self, request: Request) -> Response:
        html, found = await self._off_loop(self._host, request.path_params["name"])
        return HTMLResponse(html, status_code=200 if found else 404)

    def _host(self, name: str) -> tuple[str, bool]:
        snap = self.hub.snapshot()
        with contextlib.closing(Store(self.state_dir)) as store:
            attempts, rows = store.history(name, limit=200), hosts.with_costs(store.status(), store.costs())
        if not attempts and name not in snap.fleet and not any(r["host"] == name for r in rows):
            return self.render("missing.html", view.redacted({"about": self.about, "name": name})), False
        m = view.redacted({"about": self.about, "h": hosts.history(name, attempts, rows, snap, self.commits)})
        return self.render("host.html", m), True

    async def events(self, request: Request) -> Response:
        """Server-sent events: one event per section (live, grid, commits) whose version moved
        since what the client has (?live=N&grid=N&commits=N); its data is the section's HTML."""
        seen: dict[str, int] = {}
        for s in SECTIONS:
            with contextlib.suppress(ValueError):
                seen[s] = int(request.query_params.get(s, ""))
        return EventStream(self.streams, seen)


def allowed_hosts(bind: str) -> list[str]:
    """The Host header names the page answers: the loopback names while it listens on loopback."""
    if not is_loopback(bind.strip("[]")):
        return ["*"]
    named = f"[{bind}]" if ":" in bind and not bind.startswith("[") else bind
    return sorted({*LOOPBACK_NAMES, named})


def create_app(hub: Hub, state_dir: Path, *, repo: str = "", branch: str = "", commits: Commits | None = None,
               bind: str = "127.0.0.1", executor: Executor | None = None, refusals: Refusals | None = None,
               max_streams: int = MAX_STREAMS) -> Starlette:
    """The page's ASGI app. commits: the subject and time of a revision (default: the repo the
    hub names, via pygit2). bind: the address it listens on (which Host headers it answers).
    executor: where pages are rendered (default: a thread of its own); refusals: where what the
    page turns away is counted and said; max_streams: the cap on open event streams."""
    page = Page(hub, state_dir, commits or GitCommits(lambda: hub.repo_path), repo=repo, branch=branch,
                executor=executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-page"),
                refusals=refusals or Refusals(), max_streams=max_streams)
    static = StaticFiles(packages=[("reconciler.controller.web", "static")])
    app = Starlette(
        routes=[Route("/", page.index), Route("/hosts/{name}", page.host), Route("/events", page.events),
                Mount("/static", app=static, name="static")],
        middleware=[Middleware(_SecurityHeaders), Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(bind))])
    app.state.page = page
    return app
