"""The fleet page's live feed: what the daemon's fleet run is doing right now, in memory.

The daemon feeds it (daemon.py: the run's start and end, fleet.py's rollout events, the health
phases of reconcile.py through `on_phase`); the page's server-sent events read it. It holds
plain data only, and a version per section of the page (live, grid, commits): a change bumps
the versions and wakes every stream, which renders what changed. Level-based, like the daemon:
a stream that falls behind renders the latest state once, never a backlog of events.

No web library is imported here: the daemon holds a Hub only when the page is on, and even
then it costs a few dicts. Every entry point is guarded: a bug in the page's bookkeeping is
printed once and never reaches the fleet run that called it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from ...redact import redact

if TYPE_CHECKING:
    from ...desired.spec import HostSpec
    from ...host.progress import LoadProgress
    from ...loop.results import FleetResult, HostResult
    from ...plan.rollout import RolloutResult

SECTIONS = ("live", "grid", "commits")
DEPLOYING = "deploying"                  # planned, applying: before its health wait reports
F = TypeVar("F", bound=Callable[..., Any])


class HostInfo(msgspec.Struct):
    """A host as the desired state of the last run declares it."""

    address: str
    labels: dict[str, str]
    services: tuple[str, ...]


class PhaseInfo(msgspec.Struct):
    """One service's phase on one host during a run (health.py's phases, then the verdict)."""

    phase: str                       # starting, loading, healthy ..., failed: CrashLoop, fetching ...
    elapsed: float                   # seconds into the health wait when it was reported
    timeout: float
    at: float                        # monotonic clock of the report
    failure: str | None = None       # the first "failed: Reason" of this run: later phases are the rollback's
    final: str | None = None         # after the run: healthy, rolled back, rollback failed, quarantined ...
    quote: str | None = None         # the journal line that explains a failure (after the run)
    progress: dict[str, Any] | None = None   # the engine's load progress while it loads (LoadProgress.to_json)


class RunInfo(msgspec.Struct):
    """One fleet run of the daemon, as the page shows it."""

    revision: str
    why: str
    started: float                   # wall clock
    started_mono: float
    finished: float | None = None    # wall clock
    seconds: float = 0.0
    code: int | None = None          # the run's exit code
    phases: dict[tuple[str, str], PhaseInfo] = msgspec.field(default_factory=dict)
    # "service/definition" -> RolloutResult json
    rollouts: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    hosts: dict[str, dict[str, str | None]] = msgspec.field(default_factory=dict)  # host -> status, reason, message


class PageState(msgspec.Struct):
    """A copy of the hub's state for one render (the daemon keeps changing the original)."""

    fleet: dict[str, HostInfo]
    run: RunInfo | None
    last_rollout_run: RunInfo | None
    repo_path: str | None
    versions: dict[str, int]
    mono: float                      # the monotonic clock when it was taken
    wall: float


def _guarded(fn: F) -> F:
    """Never let the page's bookkeeping break the fleet run that feeds it: say it once, go on."""
    @functools.wraps(fn)
    def wrapper(self: Hub, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception:
            if not self.complained:
                self.complained = True
                print(redact("reconciler: fleet page: bookkeeping failed (the run goes on):\n"
                             + traceback.format_exc()), flush=True)
            return None
    return wrapper  # type: ignore[return-value]


class Hub:
    """The live state of the fleet for the page, and the wake-ups of its event streams."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.clock, self.wall = clock, wall
        self.lock = threading.Lock()        # the test client's server runs in another thread
        self.versions = dict.fromkeys(SECTIONS, 0)
        self.fleet: dict[str, HostInfo] = {}
        self.run: RunInfo | None = None
        self.last_rollout_run: RunInfo | None = None
        self.repo_path: str | None = None
        self.closed = False
        self.complained = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # -- fed by the daemon ----------------------------------------------------------------

    @_guarded
    def run_started(self, revision: str, why: str, hosts: Mapping[str, HostSpec], repo_path: str | None) -> None:
        """A run of `revision` begins: the fleet as it declares it, and a clean slate of phases."""
        with self.lock:
            self.fleet = {n: HostInfo(h.ssh.address, dict(h.labels), tuple(sorted(h.services)))
                          for n, h in hosts.items()}
            self.repo_path = repo_path
            self.run = RunInfo(revision, why, self.wall(), self.clock())
        self._bump("live", "grid")

    @_guarded
    def phase(self, host: str, service: str, phase: str, elapsed: float, timeout: float) -> None:
        """A health phase (reconcile.HostPhase): after a "failed: ..." the phases are the rollback's."""
        with self.lock:
            if self.run is None:
                return
            prev = self.run.phases.get((host, service))
            failure = prev.failure if prev is not None else None
            if failure is None and prev is not None and prev.phase.startswith("failed"):
                failure = prev.phase
            self.run.phases[(host, service)] = PhaseInfo(phase, elapsed, timeout, self.clock(), failure)
        self._bump("live", "grid")

    @_guarded
    def planned(self, r: HostResult) -> None:
        """A host's plan is about to be applied: what it (re)starts is "deploying" until its health
        wait reports."""
        from ...plan.actions import starting
        with self.lock:
            if self.run is None or r.plan is None:
                return
            for svc in starting(r.plan):
                self.run.phases.setdefault((r.host, svc), PhaseInfo(DEPLOYING, 0.0, 0.0, self.clock()))
        self._bump("live", "grid")

    @_guarded
    def progress(self, host: str, service: str, p: LoadProgress) -> None:
        """A loading engine's progress, by its own journal lines (RunIO.on_progress): shown with the
        phase it came with (the watch reports that phase first), until the next phase."""
        with self.lock:
            info = self.run.phases.get((host, service)) if self.run is not None else None
            if info is None:
                return
            info.progress = p.to_json()
        self._bump("live", "grid")

    def tee(self, view: Callable[[str, str, str, float, float], None]) -> PhaseTee:
        """An on_phase that tells both `view` (the daemon's log lines) and the page."""
        return PhaseTee(view, self)

    @_guarded
    def rollout(self, event: str, ro: RolloutResult) -> None:
        """A rollout event of fleet.py (start, wave, done, halted, superseded): its state now."""
        with self.lock:
            if self.run is None:
                return
            key = f"{ro.plan.group.service}/{ro.plan.group.definition}"
            self.run.rollouts[key] = {**ro.to_json(), "current_wave": ro.waves_done + 1 if event == "wave" else None}
        self._bump("live", "grid")

    @_guarded
    def run_finished(self, result: FleetResult) -> None:
        """The run's results (also in the store by now): final phases, journal lines, host outcomes."""
        from ...loop.results import Event
        with self.lock:
            run = self.run
            if run is None:
                return
            for ro in result.rollouts:
                key = f"{ro.plan.group.service}/{ro.plan.group.definition}"
                run.rollouts[key] = {**ro.to_json(), "current_wave": None}
            for r in result.hosts:
                run.hosts[r.host] = {"status": str(r.status), "reason": r.reason, "message": r.message}
                for e in r.events:
                    final = _final(e.action, e.outcome, Event)
                    if final is None:
                        continue
                    quote = e.quote if e.outcome is None else None if e.outcome.healthy else e.outcome.quote
                    p = run.phases.setdefault((r.host, e.service), PhaseInfo("", 0.0, 0.0, self.clock()))
                    if not (final == "quarantined" and p.final):     # "rolled back" says more
                        p.final = final
                    p.quote = quote or p.quote
            self._finish(run, result.exit_code())
        self._bump(*SECTIONS)

    @_guarded
    def run_ended(self, code: int) -> None:
        """The run is over, however it ended (a run that failed before any host was reached too)."""
        with self.lock:
            if self.run is None or self.run.finished is not None:
                return
            self._finish(self.run, code)
        self._bump(*SECTIONS)

    def _finish(self, run: RunInfo, code: int) -> None:
        run.finished, run.code, run.seconds = self.wall(), code, self.clock() - run.started_mono
        if run.rollouts:
            self.last_rollout_run = run

    def close(self) -> None:
        """The daemon is stopping: every event stream ends."""
        self.closed = True
        self._bump()

    # -- read by the page -----------------------------------------------------------------

    def snapshot(self) -> PageState:
        with self.lock:
            return PageState(copy.deepcopy(self.fleet), copy.deepcopy(self.run), copy.deepcopy(self.last_rollout_run),
                            self.repo_path, dict(self.versions), self.clock(), self.wall())

    def current_versions(self) -> dict[str, int]:
        """The sections' versions now: what an event stream compares with what it sent (cheap, no
        copy of the fleet: every stream asks at every wake-up)."""
        with self.lock:
            return dict(self.versions)

    async def wait(self, seen: Mapping[str, int], timeout: float) -> None:
        """Return when a section's version differs from `seen`, the hub closes, or after timeout."""
        ev = asyncio.Event()
        waiter = (asyncio.get_running_loop(), ev)
        with self.lock:
            if self.closed or any(self.versions[s] != seen.get(s) for s in SECTIONS):
                return
            self._waiters.append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), timeout)
        finally:
            with self.lock:             # timed out (or cancelled): no stale entry waits for the next bump
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _bump(self, *sections: str) -> None:
        with self.lock:
            for s in sections:
                self.versions[s] += 1
            waiters, self._waiters = self._waiters, []
        for loop, ev in waiters:
            with contextlib.suppress(RuntimeError):      # that stream's loop is gone: nothing to wake
                loop.call_soon_threadsafe(ev.set)


class PhaseTee:
    """The daemon's on_phase with the page on: the log view (report.PhaseView) and the hub are
    both told of every phase and of every plan about to be applied (reconcile.py asks an observer
    for `planned`)."""

    def __init__(self, view: Callable[[str, str, str, float, float], None], hub: Hub):
        self.view, self.hub = view, hub

    def __call__(self, host: str, service: str, phase: str, elapsed: float, timeout: float) -> None:
        self.view(host, service, phase, elapsed, timeout)
        self.hub.phase(host, service, phase, elapsed, timeout)

    def planned(self, r: HostResult) -> None:
        view_planned = getattr(self.view, "planned", None)
        if view_planned is not None:
            view_planned(r)
        self.hub.planned(r)


def _final(action: str, outcome: Any, event: Any) -> str | None:
    """What a service ended as in this run, in the page's words."""
    if outcome is not None:
        if outcome.reason == "Superseded":
            return "superseded"
        if action == event.ROLLBACK:
            return "rolled back" if outcome.healthy else "rollback failed"
        return "healthy" if outcome.healthy else f"failed: {outcome.reason}"
    return {event.QUARANTINED: "quarantined", event.HELD: "stopped (nothing to roll back to)",
            event.BLOCKED: "blocked", event.FOREIGN: "not ours"}.get(action)
