"""The fleet: every host surveyed and planned first, then converged, with the hosts that share a
service definition rolled out in waves (canary first, at most max_unavailable at once, halting
at the first failure). Each host's own work is loop.host_run.reconcile_host, one Pass at a time.

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
import math
import time
from collections.abc import Callable, Mapping

from ..desired.spec import HostSpec
from ..desired.trust import rewind_problem
from ..errors import HostError, ReconcilerError
from ..host import lock
from ..host.transport import Transport, close_quietly
from ..plan.records import Quarantine, Result
from ..plan.rollout import (
    RolloutPlan,
    RolloutResult,
    RolloutStatus,
    Stop,
    excuses_on_record,
    halt,
    halted_reason,
    judge_wave,
    natural_key,
    plan_rollouts,
)
from ..reasons import Reason
from ..values import replace
from .host_run import Pass, lock_and_observe, reconcile_host, ssh_connector
from .live import look
from .options import RunIO, RunOptions
from .results import (
    FleetResult,
    HostResult,
    blocked,
    failed_result,
    fleet_quarantines,
    merge_result,
    restarting,
    rollback_notices,
    running_after,
    wave_outcome,
    writes,
)
from .revision import Revision
from .select import selected
from .waves import ReadMembers, Waves, foresee, members_reader, waits


class _FleetRun:
    """One fleet run: the open connections, the per-host results and locks, the rollouts."""

    def __init__(self, rev: Revision, opts: RunOptions, io: RunIO, hosts: list[HostSpec]):
        self.rev, self.opts, self.io = rev, opts, io
        self.state, self.dry_run, self.retry = rev.state, opts.dry_run, opts.retry
        self.connect = io.connect or ssh_connector(opts.identity)
        self.sem = asyncio.Semaphore(opts.concurrency or rev.state.settings.concurrency)
        self.hosts = hosts
        self.by_name = {h.name: h for h in hosts}
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

    async def host_pass(self, h: HostSpec, p: Pass) -> HostResult:
        """reconcile_host for one of this run's passes: this run's revision, options and io."""
        return await reconcile_host(h, self.rev, self.opts, self.io, p)

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
            if self.dry_run:       # the budget's waves as they would go from what serves now
                await asyncio.gather(*(foresee(ro, self._read(ro.plan)) for ro in rollouts))
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
            await asyncio.gather(*(close_quietly(t) for t in self.transports.values()))
        res = FleetResult(self.state.revision, self.dry_run, [self.results[h.name] for h in self.hosts],
                          rollouts)
        if self.notifier is not None:
            await self.notifier.close()
            res.warnings.extend(self.notifier.failures)
        return res

    # -- survey --

    async def _survey(self, h: HostSpec) -> None:
        """Connect, observe and plan one host (a dry-run pass); keep the connection open."""
        async with self.sem:
            t0 = time.monotonic()
            try:
                t = await self.connect(h)
            except ReconcilerError as e:
                self.results[h.name] = failed_result(h.name, h.ssh.address, e, time.monotonic() - t0)
                return
            self.transports[h.name] = t
            # A dry run shows this plan, pre-flight included; a real run's first look only
            # decides whether the host needs its lock (pre-flight runs on the look under it).
            # A host expected to change (last left in sync with another revision) is locked at
            # once: its first look would only say what is expected.
            ahead = not self.dry_run and h.name in self.io.expect_changes
            r = None if ahead else await self.host_pass(h, Pass(t, dry_run=True, preflight=self.dry_run))
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
        if applied and not self.opts.allow_rewind:
            problem = rewind_problem(self.state.revision, applied,
                                     self.rev.descends(self.state.revision, applied), f"host {h.name}")
            if problem:
                # The host is the truth about what runs there: a rewind changes nothing on it.
                self.results[h.name] = HostResult(h.name, h.ssh.address, Result.FAILED, reason=Reason.NOT_DESCENDANT,
                                                  message=problem, seconds=r.seconds, facts=r.facts)
        if self.results[h.name].plan is None and self.results[h.name].status is Result.FAILED:
            # It could not even be observed: report it, and leave it out of every pass.
            self.transports.pop(h.name, None)
            await close_quietly(t)

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
            self.results[h.name] = failed_result(h.name, h.ssh.address, e, time.monotonic() - t0)
            self.transports.pop(h.name, None)
            await close_quietly(t)
            return None
        # From here on, the host's commands go through the holder's shell (session.py)
        self.raw[h.name] = t
        self.locks[h.name], t = held, held.over(t)
        self.transports[h.name] = t
        r = await self.host_pass(h, Pass(t, dry_run=True, facts=locked))
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
        deadline = time.monotonic() + self.opts.lock_wait
        for n in names:
            h = self.by_name[n]
            wait = max(0, math.ceil(deadline - time.monotonic()))
            locked = await self._lock(h, self.transports[n], None, started[n], wait=wait)
            if locked is not None:
                r, t = locked
                await self._surveyed(h, t, r)

    async def _apply_halts(self) -> None:
        """Keep halted rollouts halted: extend each group's live halt to members that hold no
        record of it (rollout.quarantine_cover), and re-plan those members with it."""
        for h, qs in fleet_quarantines(self.state, self.results, self._hash_at).items():
            self.fleet_q.setdefault(h, {}).update(qs)
        for name, qs in self.fleet_q.items():
            if name not in self.transports:
                continue        # refused or unreachable: nothing is planned there
            host, old = self.state.hosts[name], self.results[name]
            r = await self.host_pass(host, Pass(self.transports[name], dry_run=True, quarantine=qs, facts=old.facts,
                                                checked=old.checked))
            r.seconds += old.seconds
            self.results[name] = r

    def _hash_at(self, revision: str, host: str, service: str) -> str | None:
        spec = self.rev.spec_at(revision, host, service)
        return spec.content_hash() if spec is not None else None

    # -- passes --

    async def _pass(self, h: HostSpec, *, hold: frozenset[str], fresh: bool,
                    quarantine: Mapping[str, Quarantine] | None = None,
                    say: Callable[[HostResult, HostResult], None] | None = None) -> HostResult:
        """One converge pass on one host, never two at once on it; folded into its result.
        `say`: puts the pass's result (first) in the words of what ran it (a halt), before the
        host's result so far (second) takes it in."""
        async with self.passes[h.name]:
            async with self.sem:
                t = self.transports[h.name]
                before = self.results[h.name]
                qs = {**self.fleet_q.get(h.name, {}), **(quarantine or {})}
                # A host surveyed in sync was never locked: it is never written to (only hosts
                # with something to do are locked). Its survey planned it from the same look:
                # planned again only where a hold or a quarantine now asks something else of it.
                unlocked = not self.dry_run and h.name not in self.locks
                if unlocked and not hold and not qs and h.name not in self.passed:
                    r = replace(before, seconds=0.0)
                else:
                    r = await self.host_pass(h, Pass(t, dry_run=unlocked, hold=hold, quarantine=qs,
                                                     facts=None if fresh and not unlocked else before.facts,
                                                     checked=before.checked))
                if unlocked and r.plan is not None and r.facts is not None:
                    r.running = {n: running_after(r.plan, r.facts, n) for n in h.services}
            if say is not None:
                say(r, before)
            if h.name not in self.passed:
                # The survey's result was a plan, not an outcome: the first pass replaces it.
                self.passed.add(h.name)
                r.seconds += before.seconds
                self.results[h.name] = r
            else:
                merge_result(before, r)
            if self.notifier is not None:
                for fields in rollback_notices(h.name, r):
                    self.notifier.send("rollback", **fields)
            return r

    # -- rollouts --

    async def _rollout(self, ro: RolloutResult) -> None:
        """Run one group's waves; after each, rollout.judge_wave says whether it halts there."""
        p, t0 = ro.plan, time.monotonic()
        svc = p.group.service
        ro.status = RolloutStatus.RUNNING
        self._send("rollout.start", ro, hosts=list(p.pending), waves=[w.to_json() for w in p.waves])
        self._tell("start", ro)
        # Starts of this revision that failed with sick GPUs in an earlier run count here too
        faulted = excuses_on_record(svc, self.state.revision, {
            h: r.facts.gpu_fault for h in p.members if (r := self.results.get(h)) is not None and r.facts is not None})
        waves = Waves(p, self._read(p), self.io.clock)
        while (wave := await waves.next()) is not None:
            if self.io.supersede is not None and self.io.supersede.is_set():
                ro.status = RolloutStatus.SUPERSEDED      # a newer revision rolls out instead
                break
            waits(waves, self.results)
            ro.plan = waves.as_run(wave)
            self._tell("wave", ro)
            others = {h: frozenset(self.by_name[h].services) - {svc} for h in wave.hosts}
            results = await asyncio.gather(*(self._pass(self.by_name[h], hold=others[h], fresh=True)
                                             for h in wave.hosts))
            verdict = judge_wave(wave, (wave_outcome(svc, h, r) for h, r in zip(wave.hosts, results, strict=True)),
                                 faulted)
            ro.excused += verdict.excused
            ro.skipped += verdict.skipped
            faulted += verdict.faulted
            ro.waves_done = wave.number
            if verdict.halt:
                p = ro.plan = waves.as_run(wave)
                hashes = {h: self.by_name[h].services[svc].content_hash() for h in (*wave.hosts, *p.after(wave))}
                stop = halt(p, wave, verdict.halt, self.state.revision, hashes, now=int(time.time()))
                ro.halted(stop)
                await self._halt(ro, stop)
                break
            waves.went(wave)
            ro.budget = tuple(waves.said)
        else:
            ro.plan, ro.budget = waves.as_run(), tuple(waves.said)
            if waves.blocked:
                assert waves.step is not None
                waits(waves, self.results)              # each waiting host's result says why, wave 1 too
                blocked(ro, waves.step, waves.left, self.results)
            else:
                ro.status = RolloutStatus.DONE
        ro.seconds = time.monotonic() - t0
        if ro.status is RolloutStatus.DONE:
            self._send("rollout.finish", ro, hosts=list(p.pending), seconds=round(ro.seconds, 2))
        self._tell(str(ro.status), ro)     # "done", "halted" or "superseded"

    def _read(self, p: RolloutPlan) -> ReadMembers | None:
        return members_reader(p, self.state, self.transports, self.results, self.opts.drain_programs,
                              preview=self.opts.dry_run)

    async def _halt(self, ro: RolloutResult, stop: Stop) -> None:
        """Record the halt (rollout.halt): a pass on each failed and each untouched host writes
        its quarantine, and its result says the halt in the rollout's words."""
        svc = ro.plan.group.service

        def untouched(r: HostResult, before: HostResult) -> None:
            if r.status is Result.QUARANTINED and r.message:
                r.message = stop.untouched_message(svc, r.running.get(svc) or before.running.get(svc))

        async def mark(name: str, failed: bool) -> None:
            spec = self.by_name[name]
            hold = frozenset(spec.services) - {svc}
            r = await self._pass(spec, hold=hold, fresh=True, quarantine={svc: stop.quarantines[name]},
                                 say=None if failed else untouched)
            res = self.results[name]
            if failed:
                res.message = stop.failed_message(res.message)
            elif r.status is Result.QUARANTINED and res.status is Result.QUARANTINED:
                res.reason = halted_reason(res.reason)

        await asyncio.gather(*(mark(h, True) for h in stop.failed), *(mark(h, False) for h in stop.untouched))
        self._send("rollout.halt", ro, host=stop.at.host, wave=stop.wave.number, in_canary=stop.wave.canary,
                   reason=stop.at.reason, message=stop.at.message, journal_line=stop.at.quote,
                   untouched=list(stop.untouched), failed=list(stop.failed))

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
        return await look(rev, opts, io, hosts)
    return await _FleetRun(rev, opts, io, hosts).run()
