"""L10 of the 2026-12-02 review: a URL repo's fetch (source.open_repo) runs in a thread, so a
stalled remote never freezes the daemon's event loop; and libgit2's network timeouts end it."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pygit2
import pytest

from reconciler.controller.config import ControllerConfig
from reconciler.controller.daemon import Daemon
from reconciler.desired import source
from reconciler.errors import SourceError

URL = "https://git.example.invalid/fleet.git"


def make(tmp_path) -> Daemon:
    return Daemon(ControllerConfig(repo=URL, state_dir=str(tmp_path / "state"), metrics="", web=""), interval=3600)


class Stall:
    """A blocking stand-in for a fetch: it returns once the event loop releases it (True), or
    after `limit` seconds if the loop never could (False)."""

    def __init__(self, result: object, limit: float = 20):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.freed_by_loop: list[bool] = []
        self.result, self.limit = result, limit

    def __call__(self, *_a: object, **_k: object) -> object:
        self.entered.set()
        self.freed_by_loop.append(self.release.wait(self.limit))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_a_stalled_fetch_at_the_start_of_a_run_leaves_the_loop_free(tmp_path, monkeypatch, capsys):
    d = make(tmp_path)
    stall = Stall(SourceError(f"cannot fetch {URL}: timed out"))
    monkeypatch.setattr(source, "open_repo", stall)

    async def scenario() -> int:
        run = asyncio.create_task(d.run_once())
        await asyncio.to_thread(stall.entered.wait, 20)
        stall.release.set()             # only possible while the fetch hangs if the loop is free
        return await run

    assert asyncio.run(scenario()) == 1
    assert stall.freed_by_loop == [True]
    assert f"run failed: SourceError: cannot fetch {URL}: timed out" in capsys.readouterr().out


def test_a_push_during_a_run_reads_the_head_off_the_loop_and_supersedes(tmp_path, monkeypatch):
    d = make(tmp_path)
    stall = Stall("b" * 40)
    monkeypatch.setattr(d, "head", stall)
    d.running, d.ran = True, "a" * 40

    async def scenario() -> None:
        d.ask("push")                   # returns at once: the head is read in a thread
        await asyncio.to_thread(stall.entered.wait, 20)
        assert not d.supersede.is_set()
        stall.release.set()
        await asyncio.wait_for(d.supersede.wait(), 20)

    asyncio.run(scenario())
    assert stall.freed_by_loop == [True]


def test_a_head_read_for_a_run_that_ended_meanwhile_supersedes_nothing(tmp_path, monkeypatch):
    d = make(tmp_path)
    stall = Stall("b" * 40)
    monkeypatch.setattr(d, "head", stall)
    d.running, d.ran = True, "a" * 40

    async def scenario() -> None:
        d.ask("push")
        await asyncio.to_thread(stall.entered.wait, 20)
        d.running = False               # the run ended while the head was read
        stall.release.set()
        await asyncio.gather(*d._checks)

    asyncio.run(scenario())
    assert not d.supersede.is_set()


@pytest.fixture
def timeouts() -> Iterator[None]:
    """libgit2's process-wide timeouts back at "unset" around a test, as a fresh process has them."""
    saved = (pygit2.settings.server_connect_timeout, pygit2.settings.server_timeout)
    pygit2.settings.server_connect_timeout = 0
    pygit2.settings.server_timeout = 0
    yield
    pygit2.settings.server_connect_timeout, pygit2.settings.server_timeout = saved


def test_a_url_fetch_gets_network_timeouts(tmp_path, timeouts):
    with socket.socket() as s:          # a port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SourceError):
        source.open_repo(f"http://127.0.0.1:{port}/fleet.git", tmp_path / "cache")
    assert (pygit2.settings.server_connect_timeout, pygit2.settings.server_timeout) == (
        source.CONNECT_TIMEOUT_MS, source.SERVER_TIMEOUT_MS)


def test_a_remote_that_accepts_and_stalls_ends_the_fetch(tmp_path, timeouts):
    pygit2.settings.server_timeout = 300        # the process's own choice is kept (short, for the test)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        with pytest.raises(SourceError) as e:
            source.open_repo(f"http://127.0.0.1:{srv.getsockname()[1]}/fleet.git", tmp_path / "cache")
    assert pygit2.settings.server_timeout == 300
    assert str(e.value).endswith("/fleet.git: could not read from socket: timed out"), e.value
