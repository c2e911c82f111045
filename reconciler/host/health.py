"""Health: systemd state, crash-loop detection, the HTTP health endpoint, journal forensics.

Pure judges (`judge_systemd`, `explain`) plus one watcher (`watch_service`) that polls a host
through the Transport. A crash loop fails fast (NRestarts above the baseline, SubState
auto-restart, ActiveState failed), long before the start-up timeout; the HTTP check is probed
from the host itself through the SSH connection, so the server need not be exposed.

The watches of one host share one `SystemdWatch`: every SYSTEMD_POLL seconds, one `systemctl
show` of all the units being watched there (one round trip per host per tick, however many
services restarted); the journal has a round trip of its own only for a verdict of failure.
The first reading comes with the apply script itself (its last command, `SystemdWatch.seed`):
a unit that is up by then is judged without a round trip of its own. While a service loads, the same tick reads what
its engine wrote since the last look (progress.LoadFollower: shards, CUDA graphs, ready), at
most every PROGRESS_EVERY seconds, and the watch shows it as its phase (`on_progress`).
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..clock import REAL, Clock
from ..desired.spec import HealthSpec
from ..plan.facts import parse_show
from ..plan.records import INCONCLUSIVE, NO_VERDICT, START_LIMIT_HIT, SUPERSEDED
from .progress import LoadFollower, LoadProgress, Progressed
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


@dataclass(frozen=True)
class Entry:
    """One journal line of a unit: what it says, whether the service's own processes said it
    (not systemd), the invocation it belongs to, and, on systemd's "Main process exited" line,
    how the process ended (EXIT_CODE exited | killed | dumped, EXIT_STATUS)."""

    message: str
    own: bool
    invocation: str = ""
    exit_code: str = ""
    exit_status: str = ""


def explain(lines: Sequence[Entry]) -> str | None:
    """Pick the journal line that explains a failure (pure).

    The service's own lines win over systemd's. The best pattern wins; among equals, the last
    line (closest to the crash).
    """
    for own in (True, False):
        cands = [e.message.strip() for e in lines if e.own == own and e.message.strip()
                 and not _SYSTEMD_NOISE.search(e.message)]
        for pat in _EXPLAIN:
            hits = [m for m in cands if pat.search(m)]
            if hits:
                return hits[-1]
    own_lines = [e.message.strip() for e in lines if e.own and e.message.strip()]
    return own_lines[-1] if own_lines else None


def journal_command(unit: str, since_epoch: float, lines: int = 200) -> str:
    return (f"journalctl -u {shlex.quote(unit)} --since @{int(since_epoch)} -o json --no-pager "
            f"-n {lines} 2>/dev/null || true")


def parse_journal(stdout: str) -> list[Entry]:
    """journalctl -o json -> entries in journal order; systemd's own lines have _PID 1."""
    out: list[Entry] = []
    for line in stdout.splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(e, dict):
            continue
        msg = e.get("MESSAGE", "")
        if isinstance(msg, list):  # non-UTF-8 messages come as byte arrays
            msg = bytes(msg).decode(errors="replace")
        from_systemd = e.get("_PID") == "1" or e.get("SYSLOG_IDENTIFIER") == "systemd"
        invocation = str(e.get("INVOCATION_ID" if from_systemd else "_SYSTEMD_INVOCATION_ID") or "")
        code, status = (str(e.get("EXIT_CODE") or ""), str(e.get("EXIT_STATUS") or "")) if from_systemd else ("", "")
        for part in str(msg).splitlines():
            out.append(Entry(part, not from_systemd, invocation, code, status))
    return out


# systemd's own exit statuses for a process whose set-up failed before the service's command
# ran, for a cause outside the unit (systemd.exec(5), "Process Exit Codes"): it could not be put
# into the unit's cgroup, or memory ran out while it was set up. Others in 200-245 (203/EXEC
# a missing binary, 217/USER an unknown user, ...) are the unit's own mistakes and count.
SPAWN_FAILURES = {"204": "MEMORY", "219": "CGROUP"}


def spawn_failure(props: dict[str, str], entries: Sequence[Entry], baseline_invocation: str = "") -> str | None:
    """PURE: when a crash sign has no evidence that the *service* failed, what happened instead.

    Evidence is a line from the service's own processes, or an end of its process that is not
    systemd's failure to set it up (an exit status of its own, a signal), in an invocation since
    ours began (`baseline_invocation`'s lines are the process that ran before our start). When
    every end seen is such a set-up failure (SPAWN_FAILURES, or Result=resources: systemd could
    not fork or set up what the unit needs) and the service said nothing, the service never ran:
    that is no verdict on its version (returns why, for the message). None: the crash stands."""
    mine = [e for e in entries if not baseline_invocation or e.invocation != baseline_invocation]
    if any(e.own and e.message.strip() for e in mine):
        return None
    ends = [(e.exit_code, e.exit_status) for e in mine if e.exit_code]
    if props.get("ExecMainCode") == "1" and props.get("ExecMainStatus") in SPAWN_FAILURES:
        ends.append(("exited", props["ExecMainStatus"]))
    setup = [s for c, s in ends if c == "exited" and s in SPAWN_FAILURES]
    if any(not (c == "exited" and s in SPAWN_FAILURES) for c, s in ends):
        return None
    if setup:
        names = ", ".join(dict.fromkeys(f"{s}/{SPAWN_FAILURES[s]}" for s in setup))
        return f"systemd could not start its process (exit status {names}): the service itself never ran"
    if props.get("Result") == "resources":
        return "systemd could not set up its process (Result=resources): the service itself never ran"
    return None


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

    httpx over the SSH channel (reconciler/host/probe.py), imported on first use: a run that
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
        """One `systemctl show` of all the units (blocks keyed by Id, facts.parse_show), after
        the journal read of those loading, when one is due (its answer goes to `loads`)."""
        names = " ".join(shlex.quote(u) for u in units)
        journal = self.loads.command(self.clock.now(), units)
        show = f"systemctl show -p {WATCH_PROPS} {names}"
        res = await self.t.run(f"{journal}; {show}" if journal else show, timeout=20, what="health")
        return Completed(res.exit_status, self.loads.take(res.stdout), res.stderr) if journal else res


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
                        cancel: asyncio.Event | None = None, systemd: SystemdWatch | None = None,
                        clock: Clock | None = None, on_progress: Progressed | None = None) -> Outcome:
    """Watch a service after a (re)start until healthy and stable, or failed.

    Healthy = systemd running, the HTTP check (if any) answered as expected, and nothing crashed
    during `stable_for` after that. Any crash sign fails at once. `start_error`: systemctl
    refused the start itself (its message): that is a StartFailed verdict at once. `cancel`: set
    when a newer revision arrives; the watch then ends at once with the verdict Superseded.
    `systemd`: the host's shared SystemdWatch (one round trip per tick for all its watches);
    None: one of its own, polling every `systemd_poll` seconds. `clock`: what startup_timeout,
    stable_for and the HTTP interval are measured on (None: the shared watch's, else the
    machine's), so a test times a watch without waiting for it. Until the first healthy answer
    the engine's own progress lines are the phase, and `on_progress` is told each change.
    """
    if systemd is None:
        systemd = SystemdWatch(t, systemd_poll, clock if clock is not None else REAL)
    w = _Watch(t, name, health, systemd, clock if clock is not None else systemd.clock, on_phase, since_epoch,
               baseline_invocation, on_progress)
    w.report(w.phase)
    if start_error is not None:
        out = await w.fail("StartFailed", f"systemctl could not start it: {start_error}")
        if start_error and not out.quote:
            out.quote = start_error.splitlines()[-1]
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
                 on_phase: Phase | None, since_epoch: float, baseline_invocation: str, on_progress: Progressed | None):
        self.t, self.name, self.health, self.systemd, self.clock = t, name, health, systemd, clock
        self.unit = f"{name}.service"
        self.on_phase, self.since_epoch, self.baseline_invocation = on_phase, since_epoch, baseline_invocation
        self.t0 = clock.now()
        self.first_ok: float | None = None
        self.next_http = 0.0
        self.phase, self.on_progress = "starting", on_progress
        self.load: LoadProgress | None = None

    def progressed(self, props: dict[str, str]) -> None:
        """A systemd reading: the engine's latest progress (read with the ticks) becomes the phase
        while the service loads; after its first healthy answer the journal is no longer read."""
        loads = self.systemd.loads
        loads.saw(self.unit, props)
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

    async def fail(self, reason: str, message: str, props: dict[str, str] | None = None) -> Outcome:
        """The failed verdict, with the journal line that explains it; with `props` (a crash
        sign), a verdict only with evidence that the service itself failed."""
        res = await self.t.run(journal_command(self.unit, self.since_epoch), timeout=20, what="journal")
        lines = parse_journal(res.stdout)
        quote = explain(lines)
        if props is not None:
            why = spawn_failure(props, lines, self.baseline_invocation)
            if why is not None:
                reason, message = INCONCLUSIVE, f"no verdict: {why} ({message})"
        self.report(f"failed: {reason}" if reason not in NO_VERDICT else f"no verdict: {reason}")
        return Outcome(self.name, False, reason, message, quote, [e.message for e in lines][-40:], self.elapsed())

    async def judged(self, v: Verdict, props: dict[str, str]) -> Outcome | None:
        """What one systemd reading comes to: a verdict (the watch ends), or None (watch on)."""
        now = self.clock.now()
        if v.state == "refused":
            # Our own starts in quick succession (deploys, a rollback) hit systemd's start limit:
            # the new revision never ran, so this is no verdict. The planner starts it again
            # (reset-failed first, as an operator would); records.judge decides a second refusal.
            return await self.fail(START_LIMIT_HIT, v.detail)
        if v.state in ("crashed", "not-loaded", "exited"):
            if self.first_ok is not None and v.state == "crashed":
                return await self.fail("Unstable", f"crashed {now - self.first_ok:.1f}s after becoming healthy: "
                                                   f"{v.detail}", props)
            return await self.fail(v.reason, v.detail, props if v.state != "not-loaded" else None)
        if v.state == "running" and now >= self.next_http:
            out = await self.probed(now)
            if out is not None:
                return out
        if self.first_ok is not None and now - self.first_ok >= self.health.stable_for:
            self.report("healthy")
            return Outcome(self.name, True, "Healthy", f"healthy after {now - self.t0:.1f}s", seconds=now - self.t0)
        if self.first_ok is None and now - self.t0 >= self.health.startup_timeout:
            h = self.health
            what = f"{h.http} never answered {h.expect_status}" if h.http else "never ran"
            return await self.fail("StartTimeout", f"not healthy within startup_timeout={h.startup_timeout:.0f}s: "
                                                   f"{what}")
        return None

    async def probed(self, now: float) -> Outcome | None:
        """The HTTP check (systemd says it runs): healthy from the first success; a failure
        after it is Unstable; before it, the server is still loading."""
        h = self.health
        self.next_http = now + h.interval
        status: int | None = None
        body = ""
        if h.http:
            status, body = await http_probe(self.t, h.http, ca_pem=h.ca_pem)
            ok = status == h.expect_status and (not h.body_contains or h.body_contains in body)
        else:
            ok = True
        if ok and self.first_ok is None:
            self.first_ok = now
            if h.stable_for > 0:      # with none to wait, "healthy" comes next
                self.phase = f"healthy, checking it stays stable for {h.stable_for:g}s"
                self.report(self.phase)
        elif not ok and self.first_ok is not None:
            got = status if status is not None else body
            return await self.fail("Unstable", f"{h.http} failed ({got}) {now - self.first_ok:.1f}s after "
                                               f"becoming healthy")
        elif not ok and self.phase != "loading" and self.load is None:
            self.phase = "loading"
            self.report(self.phase)
        return None


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
