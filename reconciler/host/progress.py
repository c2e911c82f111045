"""Load progress while a service starts, read with the health watch's own round trip.

`LoadFollower` keeps, per host, the journal cursor of every service being started, and adds
the bounded read of what is new (plan/facts/progress.py's JournalTail, reconciler/sh/progress.sh)
to the health watch's `systemctl show` tick (watch.SystemdWatch): no round trip of its own, at
most every PROGRESS_EVERY seconds, only the service's own lines of its current invocation. What
the lines say is plan/facts/progress.py's (`advance`, pure).

Its lines are data (review N5, N6): a line is redacted whole before anything cuts it (`take`);
an exception in reading one unit's lines all the same is kept for that unit
(`LoadFollower.failed`), and its health watch ends in no verdict, never the run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import msgspec

from .. import faults, redact
from ..plan.facts.progress import (
    COUNT_DIGITS,
    LINE_MAX,
    LINES,
    JournalTail,
    LoadProgress,
    Tail,
    advance,
)
from ..values import replace

PROGRESS_EVERY = 1.0      # seconds between journal reads of one host (piggy-backed on a systemd tick)
_INVOCATION = re.compile(r"[0-9a-f]{32}")


class _Followed(msgspec.Struct):
    baseline: str                  # the invocation before our start: its lines are not this start's
    invocation: str = ""           # the invocation whose lines are read (systemd's latest reading)
    cursor: str | None = None
    progress: LoadProgress | None = None
    error: Exception | None = None     # reading its lines raised: its watch ends in no verdict


class LoadFollower(msgspec.Struct):
    """The services of one host whose start-up is followed: their invocations, journal cursors
    and progress. Not I/O itself: the health watch's tick asks it for the command to prepend
    (`command`) and hands it the answer (`take`)."""

    every: float = PROGRESS_EVERY
    units: dict[str, _Followed] = msgspec.field(default_factory=dict)
    last: float = float("-inf")

    def follow(self, unit: str, baseline_invocation: str = "") -> None:
        self.units[unit] = _Followed(baseline_invocation)

    def unfollow(self, unit: str) -> None:
        self.units.pop(unit, None)

    def saw(self, unit: str, props: Mapping[str, str]) -> None:
        """A systemd reading of `unit`: a new invocation (our start began, or systemd restarted
        it) is read from its first line, with nothing known of its progress."""
        f = self.units.get(unit)
        inv = props.get("InvocationID", "")
        if f is not None and _INVOCATION.fullmatch(inv) and inv not in (f.baseline, f.invocation):
            self.units[unit] = _Followed(f.baseline, inv)

    def command(self, now: float, units: Iterable[str]) -> JournalTail | None:
        """The journal read to run before this tick's `systemctl show` of `units`: None when none
        of them is followed with a known invocation, or the last read was under `every` ago."""
        reads = [(f.invocation, f.cursor) for u in units if (f := self.units.get(u)) is not None and f.invocation]
        if not reads or now - self.last < self.every:
            return None
        self.last = now
        return JournalTail(tuple(reads))

    def take(self, sections: Tail) -> None:
        """Read the journal's answer into each unit's progress. An exception in reading one
        unit's lines is that unit's alone (`failed`): the others' are read, and the tick's
        `systemctl show` reading stands."""
        for f in self.units.values():
            if f.invocation not in sections or f.error is not None:
                continue
            lines, cursor = sections[f.invocation]
            try:
                f.progress = _read(f.progress, lines)
            except Exception as e:      # a bug, or a line nothing expected: its watch says so
                f.error = e
            f.cursor = cursor or f.cursor

    def progress(self, unit: str) -> LoadProgress | None:
        f = self.units.get(unit)
        return f.progress if f is not None else None

    def failed(self, unit: str) -> Exception | None:
        """What reading the unit's lines raised, if it did (its watch then comes to no verdict)."""
        f = self.units.get(unit)
        return f.error if f is not None else None


# RECONCILER_FAULT=progress-raises (reconciler/faults.py, for the tests only): reading a line with
# a count longer than COUNT_DIGITS raises, as reading E4's line did before counts were bounded, so
# a test on real hosts reaches the health watch's containment of an exception.
_OVERLONG = re.compile(rf"[0-9]{{{COUNT_DIGITS + 1},}}/[0-9]")


def _read(before: LoadProgress | None, lines: list[str]) -> LoadProgress | None:
    """The progress after one read's lines of a unit: at most LINES of them, each redacted whole,
    then cut to its last LINE_MAX characters (as progress.sh cuts), before `advance` reads and
    quotes them; the quote's control characters shown as escapes."""
    clean = [redact.clip(x, LINE_MAX, tail=True) for x in lines[-LINES:]]
    if faults.armed("progress-raises") and any(_OVERLONG.search(x) for x in clean):
        raise OverflowError("injected fault progress-raises: a count longer than the parser takes")
    got = advance(before, clean)
    if got is not None and got is not before:
        got = replace(got, line=redact.escape_controls(got.line))
    return got

