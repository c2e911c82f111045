"""Health: systemd state, crash-loop detection, the engine's readiness reads, journal forensics.

Pure judges (judges.py: `judge_systemd`, `explain`, `parse_journal`) plus one watcher
(`watch_service`) that polls a host through the Transport. A crash loop fails fast (NRestarts
above the baseline, SubState auto-restart, ActiveState failed), long before the start-up
timeout. Ready is the engine's own reading where it has one (plan/ready.py: SGLang's /ready
from 0.5.20, vLLM's /health then /v1/models), else the service's health.http; every probe is
read from the host itself through the SSH connection, so the server need not be exposed.

The watches of one host share one `SystemdWatch` (systemd_watch.py): every SYSTEMD_POLL seconds, one `systemctl
show` of all the units being watched there (one round trip per host per tick, however many
services restarted); the journal has a round trip of its own only for a verdict of failure.
The first reading comes with the apply script itself (its last command, `SystemdWatch.seed`):
a unit that is up by then is judged without a round trip of its own. While a service loads,
the same tick reads what its engine wrote since the last look (progress.LoadFollower: shards, CUDA graphs, ready), at
most every PROGRESS_EVERY seconds, and the watch shows it as its phase (`on_progress`).

A watch that raises what nobody expected (a bug, or host output no parser foresaw: review N5)
ends in no verdict for its service (`Inconclusive`: neither last good nor quarantined; the
planner watches it again, at most records.MAX_UNJUDGED times, then leaves it as it is), never
in an exception that ends the run with other hosts mid-apply. An error of the host itself (a
lost connection: a ReconcilerError) stays the host run's. What a watch quotes of the journal is
redacted whole, then cut (QUOTE_MAX).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import PurePath

import msgspec

from .. import redact
from ..clock import REAL, Clock
from ..desired.spec import HealthSpec
from ..errors import ReconcilerError
from ..plan.facts.journal import Journal
from ..plan.facts.progress import LoadProgress, Progressed
from ..plan.judges import UnitReading, explain, judge_systemd, spawn_failure
from ..plan.ready import Probe, failed, readiness_probes
from ..plan.records import INCONCLUSIVE, NO_VERDICT, START_LIMIT_HIT, SUPERSEDED
from ..reasons import Reason
from . import programs
from .systemd_watch import SYSTEMD_POLL, SYSTEMD_RAMP, WATCH_PROPS, SystemdWatch
from .transport import Transport

__all__ = ["SYSTEMD_POLL", "SYSTEMD_RAMP", "WATCH_PROPS", "HttpGet", "Outcome", "Phase", "SystemdWatch",
           "first_miss", "http_probe", "inconclusive", "watch_service"]

QUOTE_MAX = 1000     # characters kept of a journal line an outcome quotes (redacted first)
JOURNAL_KEPT = 40    # journal lines an outcome keeps


class Outcome(msgspec.Struct):
    """The result of watching one service after a (re)start."""

    service: str
    healthy: bool
    reason: Reason                  # Healthy | CrashLoop | StartTimeout | Unstable | UnitNotLoaded | Exited ...
    message: str
    quote: str | None = None        # the journal line that explains a failure
    journal: list[str] = msgspec.field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {**msgspec.structs.asdict(self), "journal": self.journal[-20:], "seconds": round(self.seconds, 2)}


async def http_probe(t: Transport, url: str, ca_pem: str | None = None) -> tuple[int | None, str]:
    """GET url from the host itself (through the SSH connection), verified against `ca_pem`,
    within 5 s: (status, body) or (None, why).

    httpx over the SSH channel (reconciler/host/probe.py), imported on first use: a run that
    restarts nothing never pays for it."""
    from .probe import http_request
    return await http_request(t, url, ca_pem=ca_pem)


Phase = Callable[[str, str, float, float], None]   # (service, phase, elapsed, timeout)
HttpGet = Callable[[str], Awaitable[tuple[int | None, str]]]   # url -> (status, body) or (None, why)


async def watch_service(t: Transport, name: str, health: HealthSpec, *, baseline_restarts: int,
                        since_epoch: float, on_phase: Phase | None = None,
                        systemd_poll: float = SYSTEMD_POLL, baseline_invocation: str = "",
                        baseline_active_enter: str = "", start_error: str | None = None,
                        cancel: asyncio.Event | None = None, systemd: SystemdWatch | None = None,
                        clock: Clock | None = None, on_progress: Progressed | None = None,
                        probes: tuple[Probe, ...] | None = None, http: HttpGet | None = None) -> Outcome:
    """Watch a service after a (re)start until healthy and stable, or failed.

    Healthy = systemd running, every readiness probe answered as wanted, in order (`probes`:
    plan/ready.py's reads for its engine; None: the service's own health.http), and nothing
    crashed during `stable_for` after that. `http`: how a probe GETs a URL from the host (None:
    `http_probe` through `t` with health.ca_pem; a test gives its own). Any crash sign fails at
    once. `start_error`: systemctl refused the start itself (its message): that is a StartFailed
    verdict at once. `cancel`: set when a newer revision arrives; the watch then ends at once
    with the verdict Superseded.
    `systemd`: the host's shared SystemdWatch (one round trip per tick for all its watches);
    None: one of its own, polling every `systemd_poll` seconds. `clock`: what startup_timeout,
    stable_for and the HTTP interval are measured on (None: the shared watch's, else the
    machine's), so a test times a watch without waiting for it. Until the first healthy answer
    the engine's own progress lines are the phase, and `on_progress` is told each change.
    """
    if systemd is None:
        systemd = SystemdWatch(t, systemd_poll, clock if clock is not None else REAL)
    w = _Watch(t, name, health, systemd, clock if clock is not None else systemd.clock, on_phase, since_epoch,
               baseline_invocation, on_progress,
               probes if probes is not None else readiness_probes(None, None, health),
               http if http is not None else functools.partial(http_probe, t, ca_pem=health.ca_pem))
    try:
        return await _watch(w, baseline_restarts, baseline_active_enter, start_error, cancel)
    except ReconcilerError:
        raise               # the host's own failure (a lost connection): the host run reports it
    except Exception as e:  # a bug, or host output nothing expected: no verdict, never the run's end
        systemd.loads.unfollow(w.unit)
        return w.unexpected(e)


async def _watch(w: _Watch, baseline_restarts: int, baseline_active_enter: str, start_error: str | None,
                 cancel: asyncio.Event | None) -> Outcome:
    """watch_service's watch itself, to its verdict."""
    name, systemd, baseline_invocation = w.name, w.systemd, w.baseline_invocation
    w.report(w.phase)
    if start_error is not None:
        out = await w.fail(Reason.START_FAILED, f"systemctl could not start it: {redact.clip(start_error, QUOTE_MAX)}")
        if start_error and not out.quote:
            out.quote = redact.clip(start_error.splitlines()[-1], QUOTE_MAX)
        return out
    systemd.loads.follow(w.unit, baseline_invocation)    # read with the ticks that this watch asks for
    while True:
        props = await _next_reading(systemd, w.unit, cancel)
        if props is None:
            w.report("superseded")
            return Outcome(name, False, SUPERSEDED, "a newer revision arrived during the health wait",
                           seconds=w.elapsed())
        w.progressed(props)
        v = judge_systemd(props, baseline_restarts, baseline_invocation=baseline_invocation,
                          baseline_active_enter=baseline_active_enter)
        verdict = await w.judged(v, props)
        if verdict is not None:
            return verdict


class _Watch:
    """One service's health watch: its clock, its phase, what the HTTP check said, its verdicts."""

    def __init__(self, t: Transport, name: str, health: HealthSpec, systemd: SystemdWatch, clock: Clock,
                 on_phase: Phase | None, since_epoch: float, baseline_invocation: str, on_progress: Progressed | None,
                 probes: tuple[Probe, ...], http: HttpGet):
        self.t, self.name, self.health, self.systemd, self.clock = t, name, health, systemd, clock
        self.unit = f"{name}.service"
        self.on_phase, self.since_epoch, self.baseline_invocation = on_phase, since_epoch, baseline_invocation
        self.t0 = clock.now()
        self.first_ok: float | None = None
        self.next_http = 0.0
        self.phase, self.on_progress = "starting", on_progress
        self.load: LoadProgress | None = None
        self.probes, self.http = probes, http      # the readiness reads, and how one GETs a URL
        self.last_miss: str | None = None       # why the last probe round was not a pass

    def progressed(self, props: dict[str, str]) -> None:
        """A systemd reading: the engine's latest progress (read with the ticks) becomes the phase
        while the service loads; after its first healthy answer the journal is no longer read."""
        loads = self.systemd.loads
        loads.saw(self.unit, props)
        error = loads.failed(self.unit)
        if error is not None:
            raise error          # reading its engine's lines raised: no verdict (watch_service)
        p = loads.progress(self.unit)
        if self.first_ok is not None:
            loads.unfollow(self.unit)
        elif p is not None and p != self.load:
            self.load, self.phase = p, p.text()
            self.report(self.phase)
            if self.on_progress:
                self.on_progress(self.name, p)

    def elapsed(self) -> float:
        return self.clock.now() - self.t0

    def report(self, p: str) -> None:
        if self.on_phase:
            self.on_phase(self.name, p, self.elapsed(), self.health.startup_timeout)

    async def fail(self, reason: Reason, message: str, props: dict[str, str] | None = None) -> Outcome:
        """The failed verdict, with the journal line that explains it; with `props` (a crash
        sign), a verdict only with evidence that the service itself failed."""
        lines = await programs.run(self.t, Journal(self.unit, int(self.since_epoch)), timeout=20, what="journal",
                                   check=False)
        quote = explain(lines)
        if props is not None:
            why = spawn_failure(props, lines, self.baseline_invocation)
            if why is not None:
                reason, message = INCONCLUSIVE, f"no verdict: {why} ({message})"
        self.report(f"failed: {reason}" if reason not in NO_VERDICT else f"no verdict: {reason}")
        return Outcome(self.name, False, reason, message, redact.clip(quote, QUOTE_MAX) if quote is not None else None,
                       [redact.clip(e.message, QUOTE_MAX) for e in lines[-JOURNAL_KEPT:]], self.elapsed())

    def unexpected(self, e: Exception) -> Outcome:
        """No verdict: the watch itself raised (see `inconclusive`)."""
        with contextlib.suppress(Exception):        # the phase callback may be what raised
            self.report(f"no verdict: {INCONCLUSIVE}")
        return inconclusive(self.name, "the health watch", e, self.elapsed())

    async def judged(self, v: UnitReading, props: dict[str, str]) -> Outcome | None:
        """What one systemd reading comes to: a verdict (the watch ends), or None (watch on)."""
        now = self.clock.now()
        if v.state == "refused":
            # Our own starts in quick succession (deploys, a rollback) hit systemd's start limit:
            # the new revision never ran, so this is no verdict. The planner starts it again
            # (reset-failed first, as an operator would); records.judge decides a second refusal.
            return await self.fail(START_LIMIT_HIT, v.detail)
        if v.state in ("crashed", "not-loaded", "exited"):
            if self.first_ok is not None and v.state == "crashed":
                return await self.fail(Reason.UNSTABLE, f"crashed {now - self.first_ok:.1f}s after becoming healthy: "
                                                          f"{v.detail}", props)
            return await self.fail(v.reason or Reason.FAILED, v.detail, props if v.state != "not-loaded" else None)
        if v.state == "running" and now >= self.next_http:
            out = await self.probed(now)
            if out is not None:
                return out
        if self.first_ok is not None and now - self.first_ok >= self.health.stable_for:
            self.report("healthy")
            took = now - self.t0
            return Outcome(self.name, True, Reason.HEALTHY, f"healthy after {took:.1f}s", seconds=took)
        if self.first_ok is None and now - self.t0 >= self.health.startup_timeout:
            what = self.last_miss or ("never answered" if self.probes else "never ran")
            return await self.fail(Reason.START_TIMEOUT,
                                   f"not healthy within startup_timeout={self.health.startup_timeout:.0f}s: {what}")
        return None

    async def probed(self, now: float) -> Outcome | None:
        """The readiness probes (systemd says it runs), in order, the first miss ending the round:
        healthy from the first round that all pass; a miss after it is Unstable; before it, the
        server is still loading."""
        h = self.health
        self.next_http = now + h.interval
        miss = await self.missed()
        if miss is None and self.first_ok is None:
            self.first_ok = now
            if h.stable_for > 0:      # with none to wait, "healthy" comes next
                self.phase = f"healthy, checking it stays stable for {h.stable_for:g}s"
                self.report(self.phase)
        elif miss is not None and self.first_ok is not None:
            return await self.fail(Reason.UNSTABLE, f"{miss}, {now - self.first_ok:.1f}s after becoming healthy")
        elif miss is not None and self.phase != "loading" and self.load is None:
            self.phase = "loading"
            self.report(self.phase)
        return None

    async def missed(self) -> str | None:
        """One round of the probes (first_miss), its miss redacted and cut."""
        why = await first_miss(self.probes, self.http)
        if why is not None:
            self.last_miss = redact.clip(why, QUOTE_MAX)
        return None if why is None else self.last_miss


async def first_miss(probes: Sequence[Probe], get: HttpGet) -> str | None:
    """One round of readiness probes, in order: why the first that did not pass did not
    (plan/ready.failed), or None when all passed (or there are none). The health watch's round,
    and the budget's read of a member (loop/waves.py)."""
    for p in probes:
        status, body = await get(p.url)
        if (why := failed(p, status, body)) is not None:
            return why
    return None


def inconclusive(service: str, what: str, e: Exception, seconds: float = 0.0) -> Outcome:
    """No verdict on the version, because `what` raised an exception nobody expected (a bug, or
    host output no parser foresaw): `Inconclusive`, which records.judge keeps as the pending
    deploy's `unjudged`: not last good, not quarantined, nothing rolled back; the planner
    watches it again (or starts it again when it is not up), at most MAX_UNJUDGED times."""
    return Outcome(service, False, INCONCLUSIVE, f"no verdict: {what} failed ({_what(e)})", seconds=seconds)


def _what(e: Exception) -> str:
    """An exception in words, for a message: its type, where it was raised (file and line of the
    package, never a path) and what it says, redacted, then cut."""
    try:
        said = str(e)
    except Exception:           # its __str__ raised too
        said = ""
    frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ is not None else []
    where = f" at {PurePath(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}{where}" + (f": {redact.clip(said, 200)}" if said else "")


async def _next_reading(systemd: SystemdWatch, unit: str, cancel: asyncio.Event | None) -> dict[str, str] | None:
    """The unit's next systemd reading (the shared tick paces the watch), or None as soon as
    `cancel` is set (a newer revision arrived)."""
    if cancel is None:
        return await systemd.read(unit)
    if cancel.is_set():
        return None
    reading = asyncio.ensure_future(systemd.read(unit))
    stop = asyncio.ensure_future(cancel.wait())
    try:
        await asyncio.wait({reading, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not reading.done():
            reading.cancel()
    if cancel.is_set():
        if reading.done() and not reading.cancelled():
            reading.exception()        # retrieved: a failed reading no longer matters
        return None
    return reading.result()
