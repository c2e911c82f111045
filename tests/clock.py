"""A virtual clock for unit tests (a reconciler.clock.Clock): time moves only when everything waits.

`FakeClock.sleep(s)` parks the caller until virtual time reaches now + s. Virtual time never
moves while any task of the event loop can run: once nothing is ready (every task waits on a
sleep of this clock, a future, or I/O), it jumps to the earliest parked deadline and wakes the
sleepers due then, in the order they went to sleep. So a 30 s time-out passes at once, the same
way on every run, and a test asserts on what happened and at which virtual time (`now()`,
`slept`), never on the machine's clock.

A task that waits on real I/O (a subprocess) does not hold virtual time back: to the clock the
I/O simply took a while. Keep real I/O out of races that the test times with this clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

# Yields to the loop before virtual time moves, at most: a task that never stops yielding
# (asyncio.sleep(0) in a loop) does not keep time still for ever.
SETTLE_MAX = 10_000
# Where the loop does not show its queue of ready callbacks (not CPython's asyncio): this many
# yields stand for "everything else ran".
SETTLE_BLIND = 100


class FakeClock:
    """Virtual monotonic seconds, starting at `start`; see the module's docstring."""

    def __init__(self, start: float = 1000.0):
        self._now = start
        self.start = start
        self.slept: list[float] = []        # every sleep asked for, in order
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._driver: asyncio.Task[None] | None = None

    def now(self) -> float:
        """The virtual time."""
        return self._now

    def elapsed(self) -> float:
        """Virtual seconds since the clock was made."""
        return self._now - self.start

    async def sleep(self, seconds: float) -> None:
        """Park until virtual time reaches now + seconds (at least one turn of the loop for 0)."""
        loop = asyncio.get_running_loop()
        self.slept.append(seconds)
        fut: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._sleepers, (self._now + max(0.0, seconds), next(self._order), fut))
        if self._driver is None or self._driver.done() or self._driver.get_loop() is not loop:
            self._driver = loop.create_task(self._drive(), name="fake-clock")
        await fut

    async def _drive(self) -> None:
        """Move time to the next deadline whenever the loop has nothing else to run."""
        loop = asyncio.get_running_loop()
        while True:
            await _settle(loop)
            while self._sleepers and self._sleepers[0][2].done():   # cancelled sleepers
                heapq.heappop(self._sleepers)
            if not self._sleepers:
                return
            self._now = max(self._now, self._sleepers[0][0])
            while self._sleepers and self._sleepers[0][0] <= self._now:
                fut = heapq.heappop(self._sleepers)[2]
                if not fut.done():
                    fut.set_result(None)


async def _settle(loop: asyncio.AbstractEventLoop) -> None:
    """Yield until no other callback is ready to run (CPython's loop keeps them in `_ready`)."""
    ready = getattr(loop, "_ready", None)
    for _ in range(SETTLE_MAX if ready is not None else SETTLE_BLIND):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            return
