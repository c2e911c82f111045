"""The virtual clock the unit tests pass for reconciler.clock.Clock (tests/clock.py), and the real one."""

from __future__ import annotations

import asyncio

from reconciler.clock import REAL, Clock, RealClock
from tests.clock import FakeClock


def test_sleepers_wake_in_deadline_order_and_time_jumps_only_to_deadlines() -> None:
    clock = FakeClock()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.elapsed()))

    async def main() -> None:
        await asyncio.gather(sleeper("30 s", 30), sleeper("1 s", 1), sleeper("also 1 s", 1), sleeper("0", 0))

    asyncio.run(main())
    assert woke == [("0", 0), ("1 s", 1), ("also 1 s", 1), ("30 s", 30)]
    assert clock.slept == [30, 1, 1, 0]


def test_time_stands_still_while_any_task_can_run() -> None:
    clock = FakeClock()
    seen: list[float] = []

    async def busy() -> None:
        for _ in range(200):               # runnable all along: no virtual time passes meanwhile
            seen.append(clock.elapsed())
            await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(busy(), clock.sleep(5))

    asyncio.run(main())
    assert set(seen) == {0} and clock.elapsed() == 5


def test_a_cancelled_sleep_does_not_move_time() -> None:
    clock = FakeClock()

    async def main() -> float:
        long = asyncio.create_task(clock.sleep(100))
        await clock.sleep(0)
        long.cancel()
        await clock.sleep(2)
        return clock.elapsed()

    assert asyncio.run(main()) == 2


def test_one_clock_serves_one_event_loop_after_another() -> None:
    clock = FakeClock()
    asyncio.run(clock.sleep(1))
    asyncio.run(clock.sleep(2))
    assert clock.elapsed() == 3


def test_both_clocks_are_clocks_and_the_real_one_is_the_machines() -> None:
    clocks: list[Clock] = [REAL, FakeClock()]
    assert isinstance(REAL, RealClock) and len(clocks) == 2
    before = REAL.now()
    asyncio.run(REAL.sleep(0))
    assert REAL.now() >= before
