"""Health: systemd state, crash-loop detection, the HTTP health endpoint, journal forensics.

Pure judges (`judge_systemd`, `explain`) plus one watcher (`watch_service`) that polls a host
through the Transport. A crash loop fails fast (NRestarts above the baseline, SubState
auto-restart, ActiveState failed), long before the start-up timeout; the HTTP check is probed
from the host itself through the SSH connection, so the server need not be exposed.

The watches of one host share one `SystemdWatch`: every SYSTEMD_POLL seconds, one `systemctl
show` of all the units being watched there (one round trip per host per tick, however many
services restarted); the journal is read only for a verdict of failure. The first reading comes
with the apply script itself (its last command, `SystemdWatch.seed`): a unit that is up by
then is judged without a round trip of its own.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .facts import parse_show
from .spec import HealthSpec
from .transport import Completed, Transport

WATCH_PROPS = ("Id,LoadState,ActiveState,SubState,Result,NRestarts,ExecMainCode,ExecMainStatus,InvocationID,"
               "ActiveEnterTimestampMonotonic,Job")
SYSTEMD_POLL = 0.5   # seconds between systemd polls: a crash shows within about a second
# The first gaps after a watch's first reading are shorter: a start whose job outlasted the apply
# script's wait (apply.JOB_WAIT) and is done a moment later is seen then, not half a second
# later; a few cheap reads more.
SYSTEMD_RAMP = (0.1, 0.1, 0.2, 0.3)


@dataclass(frozen=True)
class Verdict:
    """What systemd says about a unit right now."""

    state: str            # "running" | "starting" | "crashed" | "not-loaded" | "exited" | "refused"
    reason: str = ""      # CamelCase when not fine
    detail: str = ""


def judge_systemd(props: dict[str, str], baseline_restarts: int, *, baseline_invocation: str = "",
                  baseline_active_enter: str = "") -> Verdict:
    """Sort one `systemctl show` reading (pure). See ../shared/SYSTEMD.md for the states.

    baseline_invocation: the InvocationID before our start (whose job may outlast the apply);
    while it is unchanged the start has not begun and the old process's state says nothing about
    the new.
    baseline_active_enter: ActiveEnterTimestampMonotonic before our start; a unit that fails
    without ever entering `active` since then failed to *start* (ExecStartPre=, a Type=notify or
    oneshot start that failed or timed out): reason StartFailed, not CrashLoop.
    """
    load = props.get("LoadState", "")
    active, sub = props.get("ActiveState", ""), props.get("SubState", "")
    result = props.get("Result", "")
    try:
        restarts = int(props.get("NRestarts", "0") or 0)
    except ValueError:
        restarts = 0
    summary = f"ActiveState={active} SubState={sub} Result={result} NRestarts={restarts}"
    if load and load != "loaded":
        return Verdict("not-loaded", "UnitNotLoaded", f"LoadState={load}: the unit file is invalid")
    if baseline_invocation and props.get("InvocationID", "") == baseline_invocation:
        if active == "failed" and props.get("Job", "") in ("", "0"):
            # systemd refused our start (more starts than StartLimitBurst= within
            # StartLimitIntervalSec=): no job left and no new invocation, so none will begin.
            # Result= says start-limit-hit only where the unit had not already failed: a restart
            # of a unit in its crash loop (auto-restart) keeps that crash's exit-code.
            return Verdict("refused", "StartLimitHit", f"systemd refused the start: start limit hit ({summary})")
        return Verdict("starting", detail=f"waiting for the start to begin: {summary}")
    entered = props.get("ActiveEnterTimestampMonotonic")     # absent: unknown, judged a crash
    never_active = entered == "0" or (bool(baseline_active_enter) and entered == baseline_active_enter)
    crash = "StartFailed" if never_active else "CrashLoop"
    if active == "failed":
        why = "start limit hit" if result == "start-limit-hit" else f"Result={result}"
        what = "start failed" if never_active else "unit failed"
        return Verdict("crashed", crash, f"{what} ({why}, NRestarts={restarts})")
    if sub.startswith("auto-restart") or restarts > baseline_restarts:
        what = "start keeps failing" if never_active else "crash loop"
        return Verdict("crashed", crash, f"{what}: {summary}")
    if active == "active" and sub in ("running", "exited", "reload"):
        return Verdict("running", detail=summary)
    if active in ("inactive", "deactivating"):
        if props.get("Job", "") not in ("", "0"):
            # a job is queued (our start, still waiting): nothing is judged before it runs
            return Verdict("starting", detail=f"waiting for the start job {props['Job']}: {summary}")
        if never_active:   # e.g. a start timeout: systemd is stopping what never came up
            return Verdict("crashed", "StartFailed", f"start failed: {summary}")
        return Verdict("exited", "Exited", f"process ended: {summary}")
    return Verdict("starting", detail=summary)


# Lines that explain a failure, best first. Matching is case-sensitive where case carries meaning.
_EXPLAIN = [
    re.compile(r"\bneeds\b.*--|\brequires?\b.*--"),
    re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.I),
    re.compile(r"NCCL (error|WARN)|ncclSystemError|ncclInternalError|NCCL.*(failed|error)", re.I),
    re.compile(r"[Aa]ddress already in use"),
    re.compile(r"^\w*(Error|Exception)\b.*:"),
    re.compile(r"\b(error|fatal|FATAL|ERROR)\b"),
    re.compile(r"Failed to (locate|execute)|No such file or directory|Permission denied"),
    re.compile(r"\b(not found|missing|cannot|can't|unable to|timed out|refused)\b", re.I),
]
_SYSTEMD_NOISE = re.compile(
    r"^(Started|Stopped|Stopping|Starting|Scheduled restart job|Consumed|Deactivated successfully)|"
    r"Main process exited|Failed with result|Start request repeated too quickly|\.service: Scheduled|"
    r"^Failed to start |Control process exited|Failed to kill control group")


def explain(lines: list[tuple[str, bool]]) -> str | None:
    """Pick the journal line that explains a failure (pure).

    `lines` are (message, from_service) in journal order; the service's own lines win over
    systemd's. The best pattern wins; among equals, the last line (closest to the crash).
    """
    for own in (True, False):
        cands = [m.strip() for m, o in lines if o == own and m.strip() and not _SYSTEMD_NOISE.search(m)]
        for pat in _EXPLAIN:
            hits = [m for m in cands if pat.search(m)]
            if hits:
                return hits[-1]
    own_lines = [m.strip() for m, o in lines if o and m.strip()]
    return own_lines[-1] if own_lines else None


def journal_command(unit: str, since_epoch: float, lines: int = 200) -> str:
    return (f"journalctl -u {shlex.quote(unit)} --since @{int(since_epoch)} -o json --no-pager "
            f"-n {lines} 2>/dev/null || true")


def parse_journal(stdout: str) -> list[tuple[str, bool]]:
    """journalctl -o json -> [(message, from_service)]; systemd's own lines have _PID 1."""
    out: list[tuple[str, bool]] = []
    for line in stdout.splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        msg = e.get("MESSAGE", "")
        if isinstance(msg, list):  # non-UTF-8 messages come as byte arrays
            msg = bytes(msg).decode(errors="replace")
        from_systemd = e.get("_PID") == "1" or e.get("SYSLOG_IDENTIFIER") == "systemd"
        for part in str(msg).splitlines():
            out.append((part, not from_systemd))
    return out


@dataclass
class Outcome:
    """The result of watching one service after a (re)start."""

    service: str
    healthy: bool
    reason: str                     # Healthy | CrashLoop | StartTimeout | Unstable | UnitNotLoaded | Exited ...
    message: str
    quote: str | None = None        # the journal line that explains a failure
    journal: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"service": self.service, "healthy": self.healthy, "reason": self.reason,
                "message": self.message, "quote": self.quote, "journal": self.journal[-20:],
                "seconds": round(self.seconds, 2)}


async def http_probe(t: Transport, url: str, timeout: float = 5.0, ca_pem: str | None = None) -> tuple[int | None, str]:
    """GET url from the host itself (through the SSH connection): (status, body) or (None, why).

    httpx over the SSH channel (reconciler/probe.py), imported on first use: a run that
    restarts nothing never pays for it."""
    from .probe import http_probe as probe
    return await probe(t, url, timeout=timeout, ca_pem=ca_pem)


Phase = Callable[[str, str, float, float], None]   # (service, phase, elapsed, timeout)


class SystemdWatch:
    """The systemd side of every health watch on one host: one round trip per tick for all.

    Each watch asks for its unit's next reading (`read`); a tick starts at once when none ran in
    the last `poll` seconds (so a watch's first reading is immediate), else `poll` seconds after
    the last one (SYSTEMD_RAMP's shorter gaps after the first few), and answers everyone who
    asked since with one `systemctl show` of all their units. A watch that is busy in between
    (an HTTP probe) gets the next tick's reading, so readings stay `poll` apart as with a poll
    of its own. A failed round trip fails every reading of that tick, as it would have failed
    each watch's own.
    """

    def __init__(self, t: Transport, poll: float = SYSTEMD_POLL):
        self.t, self.poll = t, poll
        self._asked: dict[str, list[asyncio.Future[dict[str, str]]]] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._last = float("-inf")
        self._ticks = 0
        self._seeded: dict[str, dict[str, str]] = {}

    def seed(self, shown: dict[str, dict[str, str]], at: float) -> None:
        """A reading taken elsewhere (the apply script's last command, at time.monotonic() `at`)
        counts as a tick: each of its units' next read gets it at once, and the next tick keeps
        the usual gap after it."""
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
                await asyncio.sleep(max(0.0, self._last + gap - time.monotonic()))
                asked, self._asked = self._asked, {}
                units = sorted(u for u, futs in asked.items() if any(not f.done() for f in futs))
                if not units:
                    continue
                self._last = time.monotonic()
                self._ticks += 1
                try:
                    res = await self._show(units)
                except Exception as e:
                    _answer(asked, error=e)
                    continue
                shown = parse_show(res.stdout)
                for unit, futs in asked.items():
                    _answer({unit: futs}, shown.get(unit, {}))
        finally:          # cancelled with the run: nobody is left waiting
            _answer(asked)
            _answer(self._asked)
            self._asked = {}

    async def _show(self, units: list[str]) -> Completed:
        """One `systemctl show` of all the units (blocks keyed by Id, facts.parse_show)."""
        names = " ".join(shlex.quote(u) for u in units)
        return await self.t.run(f"systemctl show -p {WATCH_PROPS} {names}", timeout=20, what="health")


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


async def watch_service(t: Transport, name: str, health: HealthSpec, *, baseline_restarts: int,
                        since_epoch: float, on_phase: Phase | None = None,
                        systemd_poll: float = SYSTEMD_POLL, baseline_invocation: str = "",
                        baseline_active_enter: str = "", start_error: str | None = None,
                        cancel: asyncio.Event | None = None, systemd: SystemdWatch | None = None) -> Outcome:
    """Watch a service after a (re)start until healthy and stable, or failed.

    Healthy = systemd running, the HTTP check (if any) answered as expected, and nothing crashed
    during `stable_for` after that. Any crash sign fails at once. `start_error`: systemctl
    refused the start itself (its message): that is a StartFailed verdict at once. `cancel`: set
    when a newer revision arrives; the watch then ends at once with the verdict Superseded.
    `systemd`: the host's shared SystemdWatch (one round trip per tick for all its watches);
    None: one of its own, polling every `systemd_poll` seconds.
    """
    unit = f"{name}.service"
    systemd = systemd if systemd is not None else SystemdWatch(t, systemd_poll)
    t0 = time.monotonic()
    first_ok: float | None = None
    next_http = 0.0
    phase = "starting"

    def report(p: str) -> None:
        if on_phase:
            on_phase(name, p, time.monotonic() - t0, health.startup_timeout)

    async def fail(reason: str, message: str) -> Outcome:
        res = await t.run(journal_command(unit, since_epoch), timeout=20, what="journal")
        lines = parse_journal(res.stdout)
        quote = explain(lines)
        report(f"failed: {reason}")
        return Outcome(name, False, reason, message, quote, [m for m, _ in lines][-40:], time.monotonic() - t0)

    retried = False
    report(phase)
    if start_error is not None:
        out = await fail("StartFailed", f"systemctl could not start it: {start_error}")
        if start_error and not out.quote:
            out.quote = start_error.splitlines()[-1]
        return out
    while True:
        props = await _next_reading(systemd, unit, cancel)
        if props is None:
            report("superseded")
            return Outcome(name, False, "Superseded", "a newer revision arrived during the health wait",
                           seconds=time.monotonic() - t0)
        now = time.monotonic()
        v = judge_systemd(props, baseline_restarts, baseline_invocation=baseline_invocation,
                          baseline_active_enter=baseline_active_enter)
        if v.state == "refused":
            # Our own starts in quick succession (deploys, a rollback) hit systemd's start limit:
            # the new revision never ran, so it is not judged. As an operator would: reset the
            # counter (NRestarts with it) and start it once more; refused again, it failed.
            if retried:
                return await fail("StartFailed", f"{v.detail}, again after systemctl reset-failed")
            retried = True
            report("start limit hit: reset-failed, starting again")
            u = shlex.quote(unit)
            res = await t.run(f"systemctl reset-failed {u} 2>/dev/null; systemctl start --no-block {u}",
                              timeout=30, what="start again")
            if not res.ok:
                return await fail("StartFailed", f"systemctl could not start it again: {res.stderr.strip()}")
            baseline_restarts = 0
            continue
        if v.state in ("crashed", "not-loaded", "exited"):
            if first_ok is not None and v.state == "crashed":
                return await fail("Unstable", f"crashed {now - first_ok:.1f}s after becoming healthy: {v.detail}")
            return await fail(v.reason, v.detail)
        if v.state == "running" and now >= next_http:
            next_http = now + health.interval
            if health.http:
                status, body = await http_probe(t, health.http, ca_pem=health.ca_pem)
                ok = status == health.expect_status and (not health.body_contains or health.body_contains in body)
            else:
                ok = True
            if ok and first_ok is None:
                first_ok = now
                if health.stable_for > 0:      # with none to wait, "healthy" comes next
                    phase = f"healthy, checking it stays stable for {health.stable_for:g}s"
                    report(phase)
            elif not ok and first_ok is not None:
                got = status if status is not None else body
                return await fail("Unstable", f"{health.http} failed ({got}) {now - first_ok:.1f}s after "
                                              f"becoming healthy")
            elif not ok and phase != "loading":
                phase = "loading"
                report(phase)
        if first_ok is not None and now - first_ok >= health.stable_for:
            report("healthy")
            return Outcome(name, True, "Healthy", f"healthy after {now - t0:.1f}s", seconds=now - t0)
        if first_ok is None and now - t0 >= health.startup_timeout:
            what = f"{health.http} never answered {health.expect_status}" if health.http else "never ran"
            return await fail("StartTimeout",
                              f"not healthy within startup_timeout={health.startup_timeout:.0f}s: {what}")


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
