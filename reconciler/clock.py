"""The clock that code which waits on time is given: monotonic seconds and an async sleep.

Whatever paces itself or gives up after a while (the health watch's ticks and time-outs, the
daemon's retry back-off, the GPU gate's polls) takes a `Clock` instead of calling
time.monotonic() and asyncio.sleep() itself. In production it is `REAL` (those two, unchanged);
a test passes a virtual one (tests/clock.py) whose time moves only when everything waits, so a
30 s time-out passes at once and the test asserts on what happened, never on how long it took.

Standard library only: host/gpu.py, which uses it, runs under a GPU machine's bare python3.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic time in seconds, and a sleep measured on the same time."""

    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once `seconds` have passed on this clock (at once for 0 or less)."""
        ...


class RealClock:
    """The machine's clock: time.monotonic() and asyncio.sleep()."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


REAL: Clock = RealClock()
