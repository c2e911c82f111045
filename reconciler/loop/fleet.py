"""The fleet: every host surveyed and planned first, then converged, with the hosts that share a
service definition rolled out in waves (canary first, at most max_unavailable at once, halting
at the first failure). Each host's own work is loop.host.reconcile_host.

The fleet run (run_fleet) in passes, never two at once on one host:

    survey      connect, observe, plan every selected host (what a dry-run shows); a host with
                anything to do is then locked and observed again under its lock
    quarantine  a group whose rollout halted earlier stays halted (rollout.quarantine_cover)
    waves       rollout.plan_rollouts: per group, which hosts restart together
    free pass   every host converges, leaving its waved services to the waves (deferred)
    wave pass   per group, wave by wave: the wave's hosts converge that one service; a failure
                halts the group and quarantines the change on every host it left untouched

One host failing never stops the others: every host ends with a HostResult.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Mapping
from typing import Any

from ..desired.spec import DesiredState, HostSpec
from ..desired.trust import rewind_problem
from ..errors import HostError, ReconcilerError, SourceError
from ..host import lock
from ..host.transport import Transport
from ..plan.actions import starting
from ..plan.model import Kind
from ..plan.records import Quarantine, Result, halt_where
from ..plan.rollout import (
    Halt,
    HostOutcome,
    RolloutResult,
    Wave,
    excuses_on_record,
    group_members,
    judge_wave,
    natural_key,
    plan_rollouts,
    quarantine_cover,
)
from .host import lock_and_observe, observe, reconcile_host, ssh_connector
from .options import RunIO, RunOptions
from .results import Event, FleetResult, HostResult, merge_result, running_after
from .revision import Revision


def restarting(r: HostResult) -> set[str]:
    """Services a surveyed host would restart or start with their desired version (not those
    swapped for last good, which are repairs, not a rollout)."""
    if r.plan is None:
        return set()
    return {n for n, tg in starting(r.plan).items() if not tg.rollback}


def writes(r: HostResult) -> bool:
    """Whether a host's surveyed plan would write anything there (a hold alone does not)."""
    return r.plan is not None and any(a.kind is not Kind.HOLD for a in r.plan.actions)


class _FleetRun:
    """One fleet run: the open connections, the per-host results and locks, the rollouts."""

    def __init__(self, rev: Revision, opts: RunOptions, io: RunIO, hosts: list[HostSpec]):
        self.rev, self.opts, self.io = rev, opts, io
        self.state, self.dry_run, self.retry = rev.state, opts.dry_run, opts.retry
        self.connect = io.connect or ssh_connector(opts.identity)
        self.sem = asyncio.Semaphore(opts.concurrency or rev.state.settings.concurrency)
        self.hosts = hosts
        self.transports: dict[str, Transport] = {}
        self.locks: dict[str, lock.HostLock] = {}
        self.raw: dict[str, Transport] = {}        # a locked host's own connection (under the holder's session)
        self.busy: dict[str, float] = {}           # another run held its lock at the first try: when its survey began
        self.results: dict[str, HostResult] = {}
        self.passes = {h.name: asyncio.Lock() for h in self.hosts}
        self.fleet_q: dict[str, dict[str, Quarantine]] = {}   # host -> service -> fleet-wide quarantine
        self.passed: set[str] = set()                      # hosts whose result is a pass's, not the survey's
        self.notifier = io.notifier
        if self.notifier is None and not opts.dry_run and rev.state.settings.notify is not None:
            from ..host.notify import Notifier
            self.notifier = Notifier(rev.state.settings.notify)

    async def host_pass(self, h: HostSpec, **kw: Any) -> HostResult:
        """reconcile_host for one of this run's passes: this run's revision, options and io."""
        return await reconcile_host(h, self.rev, self.opts, self.io, **kw)

    async def run(self) -> FleetResult:
        rollouts: list[RolloutResult] = []
        try:
            await asyncio.gather(*(self._survey(h) for h in self.hosts))
            if self.busy:
                await self._lock_in_order()
            if not self.retry:
                await self._apply_halts()
            restarts = {n: restarting(r) for n, r in self.results.items()}
            rollouts = [RolloutResult(p) for p in plan_rollouts(self.state, restarts)]
            if not self.dry_run:
                waved: dict[str, set[str]] = {}
                for ro in rollouts:
                    for h in ro.plan.pending:
                        waved.setdefault(h, set()).add(ro.plan.group.service)
                await asyncio.gather(
                    *(self._pass(h, hold=frozenset(waved.get(h.name, ())), fresh=False)
                      for h in self.hosts if h.name in self.transports),
                    *(self._rollout(ro) for ro in rollouts))
        finally:
            await asyncio.gather(*(held.release() for held in self.locks.values()))
            await asyncio.gather(*(self._close(t) for t in self.transports.values()))
        res = FleetResult(self.state.revision, self.dry_run, [self.results[h.name] for h in self.hosts],
                          rollouts)
        if self.notifier is not None:
            await self.notifier.close()
            res.warnings.extend(self.notifier.failures)
        return res

    @staticmethod
    async def _close(t: Transport) -> None:
        with contextlib.suppress(Exception):   # a connection that already broke has nothing left to close
            await t.close()

    # -- survey --

    async def _survey(self, h: HostSpec) -> None:
        """Connect, observe and plan one host (a dry-run pass); keep the connection open."""
        async with self.sem:
            t0 = time.monotonic()
            try:
                t = await self.connect(h)
            except ReconcilerError as e:
                reason = e.reason if isinstance(e, HostError) else "Failed"
                message = e.message if isinstance(e, HostError) else str(e)
                self.results[h.name] = HostResult(h.name, h.ssh.address, Result.FAILED, reason=reason,
                                                  message=message, seconds=time.monotonic() - t0)
                return
            self.transports[h.name] = t
            # A dry run shows this plan, pre-flight included; a real run's first look only
            # decides whether the host needs its lock (pre-flight runs on the look under it).
            # A host expected to change (last left in sync with another revision) is locked at
            # once: its first look would only say what is expected.
            ahead = not self.dry_run and h.name in self.io.expect_changes
            r = None if ahead else await self.host_pass(h, dry_run=True, transport=t, check=self.dry_run)
            if r is None or (not self.dry_run and writes(r)):
                # One reconcile of a host at a time: a host with anything to do is locked, then
                # observed again under the lock where another run may have changed it since the
                # look above (one held the lock then, or has taken it since: the lock's holder
                # knows by its count, and reads the host in the same round trip), and planned
                # from that; the lock is held until the last verdict. A host in sync is read,
                # never locked: a no-change round costs one observation per host.
                # The first try never waits: a run waits for a lock only in _lock_in_order, holding
                # none but locks of hosts named before it (two runs never wait for each other).
                locked = await self._lock(h, t, r, t0, wait=0, first=True)
                if locked is None:
                    return
                r, t = locked
            await self._surveyed(h, t, r)

    async def _surveyed(self, h: HostSpec, t: Transport, r: HostResult) -> None:
        """The survey's result for a host: its plan, or why it takes no part in the passes."""
        self.results[h.name] = r
        applied = r.facts.record.applied_revision if r.facts and r.facts.record else None
        if applied and self.rev.descends is not None and not self.opts.allow_rewind:
            problem = rewind_problem(self.state.revision, applied,
                                     self.rev.descends(self.state.revision, applied), f"host {h.name}")
            if problem:
                # The host is the truth about what runs there: a rewind changes nothing on it.
                self.results[h.name] = HostResult(h.name, h.ssh.address, Result.FAILED, reason="NotDescendant",
                                                  message=problem, seconds=r.seconds, facts=r.facts)
        if self.results[h.name].plan is None and self.results[h.name].status is Result.FAILED:
            # It could not even be observed: report it, and leave it out of every pass.
            self.transports.pop(h.name, None)
            await self._close(t)

    async def _lock(self, h: HostSpec, t: Transport, r: HostResult | None, t0: float, wait: float,
                    first: bool = False) -> tuple[HostResult, Transport] | None:
        """Take the host's lock, observe and plan it under the lock: the plan and the transport
        that now runs through the holder's session. None when it is not locked: the host's
        result says why, or, at the first try (wait 0), it waits in self.busy for its turn."""
        try:
            held, locked = await lock_and_observe(t, h, wait, look=r.facts if r else None)
        except HostError as e:
            if first and isinstance(e, lock.LockedError):
                self.busy[h.name] = t0
                return None
            self.results[h.name] = HostResult(h.name, h.ssh.address, Result.FAILED, reason=e.reason,
                                              message=e.message, seconds=time.monotonic() - t0)
            self.transports.pop(h.name, None)
            await self._close(t)
            return None
        # From here on, the host's commands go through the holder's shell (session.py)
        self.raw[h.name] = t
        self.locks[h.name], t = held, held.over(t)
        self.transports[h.name] = t
        r = await self.host_pass(h, dry_run=True, transport=t, facts=locked)
        r.seconds = time.monotonic() - t0
        return r, t

    async def _lock_in_order(self) -> None:
        """Another run held a host's lock at the first try. Let go of every lock this run took,
        then take each again, one at a time in the order of the hosts' names, waiting for it
        (lock_wait in all): a run that waits holds only locks of names before the one it waits
        for, and a run at its first try waits for nothing, so two runs never wait for each other
        in a circle (each would give up after lock_wait, both having changed nothing)."""
        names = sorted(set(self.busy) | set(self.locks), key=natural_key)
        started = self.busy | {n: time.monotonic() for n in self.locks}
        await asyncio.gather(*(held.release() for held in self.locks.values()))
        for n in self.locks:
            self.transports[n] = self.raw.pop(n)
        self.locks.clear()
        self.busy.clear()
        by_name = {h.name: h for h in self.hosts}
        deadline = time.monotonic() + self.opts.lock_wait
        for n in names:
            h = by_name[n]
            wait = max(0, math.ceil(deadline - time.monotonic()))
            locked = await self._lock(h, self.transports[n], None, started[n], wait=wait)
            if locked is not None:
                r, t = locked
                await self._surveyed(h, t, r)

    def _unlocked(self, h: HostSpec) -> bool:
        """A host surveyed in sync and so never locked: no pass may write to it."""
        return not self.dry_run and h.name not in self.locks

    async def _apply_halts(self) -> None:
        """Keep halted rollouts halted: extend each group's live halt to members that hold no
        record of it (rollout.quarantine_cover), and re-plan those members with it."""
        for key, members in group_members(self.state).items():
            svc = key.service
            desired, halts = {}, []
            for h in members:
                r = self.results.get(h)
                if r is None or r.facts is None:
                    continue
                want = self.state.hosts[h].services[svc].content_hash()
                f = r.facts.services.get(svc)
                q = f.record.quarantine if f is not None and f.record is not None else None
                if q is not None and q.hash == want:
                    halts.append(Halt(h, q.to_json()))
                elif svc in restarting(r):
                    desired[h] = want
            if not halts or not desired:
                continue
            for h, cover in quarantine_cover(key, desired, halts, self.state.revision, self._hash_at).items():
                fq = Quarantine.from_json(cover)
                if fq is not None:
                    self.fleet_q.setdefault(h, {})[svc] = fq
        for name, qs in self.fleet_q.items():
            if name not in self.transports:
                continue        # refused or unreachable: nothing is planned there
            host, old = self.state.hosts[name], self.results[name]
            r = await self.host_pass(host, dry_run=True, quarantine=qs, transport=self.transports[name],
                                     facts=old.facts, checked=old.checked)
            r.seconds += old.seconds
            self.results[name] = r

    def _hash_at(self, revision: str, host: str, service: str) -> str | None:
        state = self.rev.render_at(revision) if self.rev.render_at is not None else None
        h = state.hosts.get(host) if state is not None else None
        spec = h.services.get(service) if h is not None else None
        return spec.content_hash() if spec is not None else None

    # -- passes --

    async def _pass(self, h: HostSpec, *, hold: frozenset[str], fresh: bool,
                    quarantine: Mapping[str, Quarantine] | None = None) -> HostResult:
        """One converge pass on one host, never two at once on it; folded into its result."""
        async with self.passes[h.name]:
            async with self.sem:
                t = self.transports[h.name]
                before = self.results[h.name]
                qs = {**self.fleet_q.get(h.name, {}), **(quarantine or {})}
                # A host surveyed in sync was never locked: it is planned again from the survey's
                # look and never written to (only hosts with something to do are locked).
                unlocked = self._unlocked(h)
                r = await self.host_pass(h, dry_run=unlocked, hold=hold, quarantine=qs, transport=t,
                                         facts=None if fresh and not unlocked else before.facts,
                                         checked=before.checked)
                if unlocked and r.plan is not None and r.facts is not None:
                    r.running = {n: running_after(r.plan, r.facts, n) for n in h.services}
            if h.name not in self.passed:
                # The survey's result was a plan, not an outcome: the first pass replaces it.
                self.passed.add(h.name)
                r.seconds += before.seconds
                self.results[h.name] = r
            else:
                merge_result(before, r)
            self._notify_failures(h.name, r)
            return r

    def _notify_failures(self, host: str, r: HostResult) -> None:
        if self.notifier is None:
            return
        for i, e in enumerate(r.events):
            if e.action == Event.ROLLBACK or e.outcome is None or e.outcome.healthy:
                continue
            rb = next((x for x in r.events[i + 1:] if x.service == e.service and x.action == Event.ROLLBACK), None)
            ok = rb is not None and rb.outcome is not None and rb.outcome.healthy
            self.notifier.send("rollback", host=host, service=e.service, revision=e.revision, short=e.revision[:7],
                               reason=e.outcome.reason, message=e.outcome.message, journal_line=e.outcome.quote,
                               result="rolled-back" if ok else "failed",
                               rolled_back_to=rb.revision if rb is not None and ok else None)

    # -- rollouts --

    async def _rollout(self, ro: RolloutResult) -> None:
        """Run one group's waves; after each, rollout.judge_wave says whether it halts there."""
        p, t0 = ro.plan, time.monotonic()
        svc = p.group.service
        ro.status = "running"
        self._send("rollout.start", ro, hosts=list(p.pending), waves=[w.to_json() for w in p.waves])
        self._tell("start", ro)
        by_name = {h.name: h for h in self.hosts}
        # Starts of this revision that failed with sick GPUs in an earlier run count here too
        faulted = excuses_on_record(svc, self.state.revision, {
            h: r.facts.gpu_fault for h in p.members if (r := self.results.get(h)) is not None and r.facts is not None})

        def outcome(h: str, r: HostResult) -> HostOutcome:
            bad = next((e.outcome for e in r.events if e.service == svc and e.action == Event.DEPLOY
                        and e.outcome is not None and not e.outcome.healthy), None)
            if bad is not None:
                return HostOutcome(h, bad.reason, bad.message, bad.quote, started=True)
            if r.status is Result.FAILED:
                return HostOutcome(h, r.reason or "Failed", r.message or "", observed=r.plan is not None)
            return HostOutcome(h)

        for wave in p.waves:
            if self.io.supersede is not None and self.io.supersede.is_set():
                ro.status = "superseded"      # a newer revision rolls out instead
                ro.seconds = time.monotonic() - t0
                self._tell("superseded", ro)
                return
            self._tell("wave", ro)
            others = {h: frozenset(by_name[h].services) - {svc} for h in wave.hosts}
            results = await asyncio.gather(*(self._pass(by_name[h], hold=others[h], fresh=True) for h in wave.hosts))
            verdict = judge_wave(wave, (outcome(h, r) for h, r in zip(wave.hosts, results, strict=True)), faulted)
            ro.excused += verdict.excused
            ro.skipped += verdict.skipped
            faulted += verdict.faulted
            ro.waves_done = wave.number
            if verdict.halt:
                await self._halt(ro, wave, [(o.host, o.reason or "Failed", o.message, o.quote) for o in verdict.halt])
                ro.seconds = time.monotonic() - t0
                self._tell("halted", ro)
                return
        ro.status = "done"
        ro.seconds = time.monotonic() - t0
        self._send("rollout.finish", ro, hosts=list(p.pending), seconds=round(ro.seconds, 2))
        self._tell("done", ro)

    async def _halt(self, ro: RolloutResult, wave: Wave, failed: list[tuple[str, str, str, str | None]]) -> None:
        """Stop the group: quarantine this revision's content of the service on the failed hosts
        (marking where it halted) and on every host of the later waves, which stay untouched."""
        p, svc, rev = ro.plan, ro.plan.group.service, self.state.revision
        host, reason, message, quote = failed[0]
        ro.status, ro.halted_at, ro.halted_wave = "halted", host, wave.number
        ro.reason, ro.message, ro.quote = reason, message, quote
        ro.untouched = p.after(wave)
        by_name = {h.name: h for h in self.hosts}
        where = halt_where(host, wave.canary, wave.number)
        left = f"{len(ro.untouched)} host{'s' * (len(ro.untouched) != 1)} left untouched"

        async def mark(name: str, is_failed: bool) -> None:
            spec = by_name[name]
            q = Quarantine(hash=spec.services[svc].content_hash(), revision=rev,
                           reason=reason if is_failed else "RolloutHalted", quote=quote, at=int(time.time()),
                           halted_at=host, canary=wave.canary, wave=wave.number, cause=reason)
            hold = frozenset(spec.services) - {svc}
            r = await self._pass(spec, hold=hold, fresh=True, quarantine={svc: q})
            res = self.results[name]
            if is_failed:
                res.message = (res.message + "; " if res.message else "") + f"rollout halted here, {left}"
            elif r.status is Result.QUARANTINED and r.message and res.message and r.message in res.message:
                # Say it in the rollout's words; the journal line is in the event (status shows
                # it as the quote), not repeated here. Other services' messages stay.
                res.reason = "RolloutHalted" if res.reason in ("Quarantined", None) else res.reason
                res.message = res.message.replace(
                    r.message, f"{svc}: rollout halted at {where}: {reason}; not restarted, "
                               f"still running {str(res.running.get(svc) or '?')[:7]}")

        await asyncio.gather(*(mark(h, True) for h, *_ in failed), *(mark(h, False) for h in ro.untouched))
        self._send("rollout.halt", ro, host=host, wave=wave.number, in_canary=wave.canary, reason=reason,
                   message=message, journal_line=quote, untouched=list(ro.untouched),
                   failed=[h for h, *_ in failed])

    def _tell(self, event: str, ro: RolloutResult) -> None:
        if self.io.on_rollout is not None:
            self.io.on_rollout(event, ro)

    def _send(self, event: str, ro: RolloutResult, **fields: object) -> None:
        if self.notifier is not None:
            p = ro.plan
            self.notifier.send(event, service=p.group.service, definition=p.group.definition,
                               revision=self.state.revision, short=self.state.revision[:7],
                               policy={"canary": p.policy.canary, "max_unavailable": p.policy.max_unavailable,
                                       "bound": p.bound}, **fields)


async def run_fleet(rev: Revision, opts: RunOptions, io: RunIO = RunIO()) -> FleetResult:
    """The one fleet run every door calls (the CLI, `status --live`, the daemon, pull mode):
    reconcile every selected host (at most `opts.concurrency` at once), rolling shared services
    out in waves; with `opts.dry_run`, only survey and plan them (the waves included); with
    `opts.look`, only read each host's records (no plan, no lock, nothing written).

    Raises SourceError for a host selection that matches nothing (before any host is contacted).
    """
    hosts = list(selected(rev.state, opts).values())
    if opts.look:
        return await _look(rev, opts, io, hosts)
    return await _FleetRun(rev, opts, io, hosts).run()


async def _look(rev: Revision, opts: RunOptions, io: RunIO, hosts: list[HostSpec]) -> FleetResult:
    """Read every host's records and systemd's state, read-only: the observation without the
    keyed hashes of secret files (the one part that writes: the host's key), no lock."""
    connect = io.connect or ssh_connector(opts.identity)
    sem = asyncio.Semaphore(opts.concurrency or rev.state.settings.concurrency)

    async def one(h: HostSpec) -> HostResult:
        t0 = time.monotonic()
        async with sem:
            try:
                t = await connect(h)
            except ReconcilerError as e:
                return _unreachable(h, e, t0)
            try:
                facts = await observe(t, h, secrets=False)
            except ReconcilerError as e:
                return _unreachable(h, e, t0)
            finally:
                with contextlib.suppress(Exception):
                    await t.close()
        return HostResult(h.name, h.ssh.address, facts=facts, seconds=time.monotonic() - t0)
    return FleetResult(rev.revision, True, list(await asyncio.gather(*(one(h) for h in hosts))))


def _unreachable(h: HostSpec, e: ReconcilerError, t0: float) -> HostResult:
    reason = e.reason if isinstance(e, HostError) else "Failed"
    message = e.message if isinstance(e, HostError) else str(e)
    return HostResult(h.name, h.ssh.address, Result.FAILED, reason=reason, message=message,
                      seconds=time.monotonic() - t0)


def selected(state: DesiredState, opts: RunOptions) -> dict[str, HostSpec]:
    """The hosts a run is limited to, in natural order (every host without --host or --label)."""
    names = select_hosts(state, list(opts.hosts) or None, list(opts.labels) or None)
    return {n: h for n, h in sorted(state.hosts.items(), key=lambda kv: natural_key(kv[0]))
            if names is None or n in names}


def select_hosts(state: DesiredState, names: list[str] | None, labels: list[str] | None) -> list[str] | None:
    """The hosts a run is limited to: any of `names` (--host) and, of those, the ones carrying
    every label KEY=VALUE (--label, repeatable: AND). None: no selector, every host.

    Raises SourceError (exit 1, nothing applied) for an unknown name, a malformed label or a
    selection that matches no host, so a typo never turns into "nothing to do".
    """
    if not names and not labels:
        return None
    from ..desired.schema import LABEL
    unknown = sorted(set(names or []) - set(state.hosts))
    if unknown:
        raise SourceError(f"unknown host(s) {', '.join(unknown)} at {state.short} "
                          f"(known: {', '.join(sorted(state.hosts, key=natural_key))})")
    wanted: dict[str, str] = {}
    for item in labels or []:
        key, sep, value = item.partition("=")
        if not sep or not LABEL.match(key) or not LABEL.match(value):
            raise SourceError(f"--label expects KEY=VALUE (letters, digits, '_', '.', '-'), got {item!r}")
        if wanted.get(key, value) != value:
            raise SourceError(f"--label {key}= given twice with different values: no host can match both")
        wanted[key] = value
    chosen = [n for n, h in sorted(state.hosts.items(), key=lambda kv: natural_key(kv[0]))
              if (not names or n in names) and all(h.labels.get(k) == v for k, v in wanted.items())]
    if not chosen:
        have = sorted({f"{k}={v}" for h in state.hosts.values() for k, v in h.labels.items()})
        raise SourceError(f"no host matches {' '.join('--label ' + k + '=' + v for k, v in wanted.items())}"
                          + (f" among {', '.join(sorted(names or []))}" if names else "")
                          + f" at {state.short} (labels in use: {', '.join(have) or 'none'})")
    return chosen
