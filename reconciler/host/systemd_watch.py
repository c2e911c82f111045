"""The systemd side of every health watch on one host (health.py re-exports it): one
`systemctl show` per tick for all, with the journal read of the services still loading
(progress.LoadFollower)."""

from __future__ import annotations

import asyncio

from ..clock import REAL, Clock
from ..plan.facts.show import UnitShow
from . import programs
from .progress import LoadFollower
from .transport import LOST_AFTER, Transport

WATCH_PROPS = ("Id,LoadState,ActiveState,SubState,Result,NRestarts,ExecMainCode,ExecMainStatus,InvocationID,"
               "ActiveEnterTimestampMonotonic,Job")
# A read of the watched units (a systemctl show, a journal tail) that takes longer has failed; a
# connection that went meanwhile is found first (LOST_AFTER), and its loss is what the run reports.
TICK_TIMEOUT = LOST_AFTER + 10
SYSTEMD_POLL = 0.5   # seconds between systemd polls: a crash shows within about a second
# The first gaps after a watch's first reading are shorter: a start whose job outlasted the apply
# script's wait (apply.JOB_WAIT) and is done a moment later is seen then, not half a second
# later; a few cheap reads more.
SYSTEMD_RAMP = (0.1, 0.1, 0.2, 0.3)

class SystemdWatch:
    """The systemd side of every health watch on one host: one round trip per tick for all.

    Each watch asks for its unit's next reading (`read`); a tick starts at once when none ran in
    the last `poll` seconds (so a watch's first reading is immediate), else `poll` seconds after
    the last one (SYSTEMD_RAMP's shorter gaps after the first few), and answers everyone who
    asked since with one `systemctl show` of all their units. A watch that is busy in between
    (an HTTP probe) gets the next tick's reading, so readings stay `poll` apart as with a poll
    of its own. A failed round trip fails every reading of that tick, as it would have failed
    each watch's own. `clock` paces the ticks (the machine's; a test's virtual one).
    """

    def __init__(self, t: Transport, poll: float = SYSTEMD_POLL, clock: Clock = REAL):
        self.t, self.poll, self.clock = t, poll, clock
        self._asked: dict[str, list[asyncio.Future[dict[str, str]]]] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._last = float("-inf")
        self._ticks = 0
        self._seeded: dict[str, dict[str, str]] = {}
        self.loads = LoadFollower()         # the services loading here: their journal, read with the tick

    def seed(self, shown: dict[str, dict[str, str]], at: float) -> None:
        """A reading taken elsewhere (the apply script's last command, at `at` on this watch's
        clock: time.monotonic() for the real one) counts as a tick: each of its units' next read
        gets it at once, and the next tick keeps the usual gap after it."""
        self._seeded = dict(shown)          # an older apply's reading is never handed out
        if shown:
            self._last, self._ticks = at, max(self._ticks, 1)

    async def read(self, unit: str) -> dict[str, str]:
        """The unit's properties (WATCH_PROPS) at the next tick; {} when systemd names no such unit."""
        seeded = self._seeded.pop(unit, None)
        if seeded is not None:
            return seeded
        fut: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
        self._asked.setdefault(unit, []).append(fut)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick())
        return await fut

    async def _tick(self) -> None:
        asked: dict[str, list[asyncio.Future[dict[str, str]]]] = {}
        try:
            while self._asked:
                gap = min(self.poll, SYSTEMD_RAMP[self._ticks - 1]) if 0 < self._ticks <= len(SYSTEMD_RAMP) \
                    else self.poll
                await self.clock.sleep(max(0.0, self._last + gap - self.clock.now()))
                asked, self._asked = self._asked, {}
                units = sorted(u for u, futs in asked.items() if any(not f.done() for f in futs))
                if not units:
                    continue
                self._last = self.clock.now()
                self._ticks += 1
                try:
                    shown = await self._show(units)
                except Exception as e:     # each watch of the tick meets it (and contains it)
                    _answer(asked, error=e)
                    continue
                for unit, futs in asked.items():
                    _answer({unit: futs}, shown.get(unit, {}))
        finally:          # cancelled with the run: nobody is left waiting
            _answer(asked)
            _answer(self._asked)
            self._asked = {}

    async def _show(self, units: list[str]) -> dict[str, dict[str, str]]:
        """One `systemctl show` of all the units (blocks keyed by Id: plan/facts/show.py), after
        the journal read of those loading, when one is due (its answer goes to `loads`): one
        round trip."""
        journal = self.loads.command(self.clock.now(), units)
        show = UnitShow(units, WATCH_PROPS)
        *tail, shown = await programs.run_all(self.t, [show] if journal is None else [journal, show],
                                              timeout=TICK_TIMEOUT, what="health", check=False)
        if tail:
            self.loads.take(tail[0])
        return shown


def _answer(asked: dict[str, list[asyncio.Future[dict[str, str]]]], props: dict[str, str] | None = None,
            error: Exception | None = None) -> None:
    """Resolve the futures still waiting: with the reading, the error, or (neither) cancelled."""
    for futs in asked.values():
        for f in futs:
            if f.done():
                continue
            if error is not None:
                f.set_exception(error)
            elif props is not None:
                f.set_result(props)
            else:
                f.cancel()
