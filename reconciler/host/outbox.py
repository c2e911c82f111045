"""Outbound HTTP that must never hold up a deploy (webhooks: notify.py; forge commit statuses:
controller/forge.py), on httpx's async client in the caller's own event loop.

A sender is a subclass of `Outbox` that says how to send one item (`_deliver`), and in what
words a failure (`_failed`) or a dropped item (`_dropped`) is told. `put` queues one request and
returns at once; one task of the running loop sends them in order through one
`httpx.AsyncClient`, each bounded by the client's timeouts. The queue is bounded too: at most
`max_pending` wait, and a request put under a key still queued replaces it (the forge keeps
only the newest status per commit and context); past the bound the oldest is dropped and that
is said. Every warning is redacted, kept in `failures` (the newest KEEP) and told by `_say`;
`Outbox` never raises into the caller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from ..redact import redact

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("reconciler.host.outbox")
T = TypeVar("T")
KEEP = 100          # warnings kept in `failures` (a daemon's outbox lives for days)


class Outbox(Generic[T]):
    """A bounded queue of requests, sent one at a time by a task of the running loop."""

    logger: ClassVar[logging.Logger] = log      # where `_say` tells a warning: a sender names its own

    def __init__(self, client: Callable[[], httpx.AsyncClient], *, max_pending: int):
        self._client_of, self.max_pending = client, max_pending
        self.failures: list[str] = []
        self._pending: collections.OrderedDict[Hashable, T] = collections.OrderedDict()
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.sent = 0

    @property
    def pending(self) -> int:
        """Requests queued and not yet taken up (the one being sent is not counted)."""
        return len(self._pending)

    def put(self, key: Hashable, item: T) -> None:
        """Queue `item` (replacing one queued under the same key); returns at once. Call it from
        the loop that is to send it."""
        self._pending.pop(key, None)
        self._pending[key] = item
        while len(self._pending) > self.max_pending:
            _key, old = self._pending.popitem(last=False)
            self.warn(self._dropped(old))
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="reconciler-outbox")

    async def drain(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds until every queued request went out or failed."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Drop whatever is still queued or being sent, and close the client."""
        self._pending.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self._idle.set()

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            _key, item = self._pending.popitem(last=False)
            try:
                if self._client is None:
                    self._client = self._client_of()
                await self._deliver(self._client, item)
                self.sent += 1
            except Exception as e:      # any failure of the other end is only a warning
                self.warn(self._failed(item, e))

    def warn(self, msg: str) -> None:
        """Tell a warning (redacted) and keep it in `failures`."""
        msg = redact(msg)
        self.failures.append(msg)
        del self.failures[:-KEEP]
        self._say(msg)

    async def _deliver(self, client: httpx.AsyncClient, item: T) -> None:
        """Send one queued item with the outbox's client; raise on any failure."""
        raise NotImplementedError

    def _failed(self, item: T, e: Exception) -> str:
        """The warning for an item that could not be delivered."""
        return f"{item!r} not delivered: {type(e).__name__}"

    def _dropped(self, item: T) -> str:
        """The warning for an item dropped from a full queue."""
        return f"dropped {item!r}"

    def _say(self, msg: str) -> None:
        """Where a warning goes: the sender's logger (the daemon prints to its journal instead)."""
        self.logger.warning("%s", msg)
