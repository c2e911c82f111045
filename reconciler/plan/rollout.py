"""PURE: rolling a change out over the hosts that share a service definition, in waves; the
rules (canary first, bounded, stop at the first failure, a sick GPU excused once) are in
docs/rollouts.md.

No I/O, no clock, no globals: the fleet run (fleet.py) observes and plans every host first, then
asks this module which hosts restart together, and in which order.

A rollout group is one service name on every host whose service comes from the same shared
definition (`GroupKey`); only hosts whose plan for that service restarts (or starts) it take
part in its waves. Every wave has at most `bound` hosts: max_unavailable as a count of the hosts
that run the service (the whole group, selected or not); more canaries than the bound are split
into several canary waves. `judge_wave` is the verdict on a wave (`host_fault`: a failure its
host's GPUs may explain). Where a wave halts, `halt` says which host gets which quarantine and
how the hosts' results say it, and `quarantine_cover` how the halt reaches hosts that never
restarted; the executor only runs the passes that record them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from ..desired.spec import DesiredState, RolloutPolicy
from ..reasons import Reason
from .gpuhealth import GpuFault
from .records import Quarantine, halt_where

CANARY_LABEL = ("canary", "true")


class GroupKey(msgspec.Struct, frozen=True):
    """One rollout group: a service name and the shared definition it comes from."""

    service: str
    definition: str

    def __str__(self) -> str:
        return f"{self.service} (services/{self.definition}.toml)"


class Wave(msgspec.Struct, frozen=True):
    """Hosts that restart together; the next wave waits until all of them are healthy."""

    number: int                  # 1-based
    hosts: tuple[str, ...]
    canary: bool = False

    def to_json(self) -> dict[str, object]:
        return {"number": self.number, "canary": self.canary, "hosts": list(self.hosts)}


class RolloutPlan(msgspec.Struct, frozen=True):
    """The waves of one group at one revision."""

    group: GroupKey
    policy: RolloutPolicy
    members: tuple[str, ...]     # every host in the desired state that runs this group's service
    pending: tuple[str, ...]     # the selected hosts whose plan restarts it, in wave order
    bound: int                   # max_unavailable as a number of hosts
    waves: tuple[Wave, ...]

    def after(self, wave: Wave) -> tuple[str, ...]:
        """The hosts of every wave after `wave`: what a halt there leaves untouched."""
        return tuple(h for w in self.waves if w.number > wave.number for h in w.hosts)

    def to_json(self) -> dict[str, object]:
        return {"service": self.group.service, "definition": self.group.definition,
                "canary": self.policy.canary, "max_unavailable": self.policy.max_unavailable,
                "bound": self.bound, "members": list(self.members), "pending": list(self.pending),
                "waves": [w.to_json() for w in self.waves]}


class RolloutStatus(StrEnum):
    """Where a rollout stands."""

    PLANNED = "planned"
    RUNNING = "running"
    DONE = "done"
    HALTED = "halted"
    SUPERSEDED = "superseded"    # a newer revision rolls out instead (the daemon's supersede)


class RolloutResult(msgspec.Struct):
    """What became of one planned rollout (filled in by the executor)."""

    plan: RolloutPlan
    status: RolloutStatus = RolloutStatus.PLANNED
    waves_done: int = 0
    halted_at: str | None = None          # the host whose failure stopped the rollout
    halted_wave: int | None = None
    reason: Reason | None = None          # CrashLoop, StartTimeout, ApplyFailed ...
    message: str | None = None
    quote: str | None = None              # the journal line that explains it
    untouched: tuple[str, ...] = ()       # pending hosts that were never restarted
    skipped: tuple[str, ...] = ()         # wave hosts that failed before anything changed
    excused: tuple[str, ...] = ()         # wave hosts whose start failed with sick GPUs (host_fault)
    seconds: float = 0.0
    budget: tuple[str, ...] = ()          # min_available: what the budget said before each wave (plan/budget.py)

    def halted(self, stop: Stop) -> None:
        """The rollout halted where `stop` says (rollout.halt)."""
        self.status, self.halted_at, self.halted_wave = RolloutStatus.HALTED, stop.at.host, stop.wave.number
        self.reason, self.message, self.quote = stop.at.reason, stop.at.message, stop.at.quote
        self.untouched = stop.untouched

    def to_json(self) -> dict[str, object]:
        return {**self.plan.to_json(), "status": self.status, "waves_done": self.waves_done,
                "halted": None if self.halted_at is None else {
                    "host": self.halted_at, "wave": self.halted_wave, "reason": self.reason,
                    "message": self.message, "quote": self.quote},
                # a budget that let no pending host go (min_available): halted at no host
                "blocked": None if self.reason != Reason.BUDGET_BLOCKED else {
                    "reason": self.reason, "message": self.message},
                "untouched": list(self.untouched), "skipped": list(self.skipped), "excused": list(self.excused),
                "budget": list(self.budget), "seconds": round(self.seconds, 2)}


def host_fault(reason: Reason | None) -> bool:
    """A wave host's failure that its host's GPUs may explain: its GPUs were sick when the start
    failed, or before it (GpuFault). Alone it neither halts the rollout nor quarantines the
    change; judge_wave says when it stops being an excuse."""
    return reason == Reason.GPU_FAULT


class HostOutcome(msgspec.Struct, frozen=True):
    """What one wave host's pass made of the group's service, as the executor read its result:
    `reason` None when it is healthy (or nothing needed doing), else the failed deploy's reason
    (`started`: the service was started and watched to that verdict) or the host's own (a
    pre-flight block, an apply that failed); `observed` False when the host was never planned."""

    host: str
    reason: Reason | None = None
    message: str = ""
    quote: str | None = None
    started: bool = False
    observed: bool = True


class Excuse(msgspec.Struct, frozen=True):
    """A host whose start of this revision failed while its GPUs were sick: the fault line."""

    host: str
    quote: str


class WaveVerdict(msgspec.Struct, frozen=True):
    """What a wave's outcomes mean for the rollout (judge_wave). `halt`: the hosts where it halts,
    the first named (empty: it goes on); they are quarantined as failed, the later waves'
    hosts as untouched. `excused`: hosts whose GPU fault does not count against the change;
    `faulted`: this wave's starts that failed with sick GPUs (they count towards the next
    halt); `skipped`: hosts never planned (nothing changed there, nothing to judge)."""

    halt: tuple[HostOutcome, ...] = ()
    excused: tuple[str, ...] = ()
    faulted: tuple[Excuse, ...] = ()
    skipped: tuple[str, ...] = ()


def judge_wave(wave: Wave, outcomes: Iterable[HostOutcome], before: Iterable[Excuse] = ()) -> WaveVerdict:
    """The verdict on one wave (pure), from its hosts' outcomes and the starts of this revision
    that failed with sick GPUs before it (`before`: earlier waves, and hosts whose gpu-fault.json
    names this revision: excuses_on_record). A failure of the change (any reason but GpuFault)
    halts the rollout there; a GPU fault is no excuse on the canary (it vouches for the change)
    or on a second host: docs/health.md, "Excuses are bounded"."""
    failed: list[HostOutcome] = []
    excused: list[str] = []
    faulted: list[Excuse] = []
    skipped: list[str] = []
    for o in outcomes:
        if host_fault(o.reason):
            excused.append(o.host)
            if o.started:
                faulted.append(Excuse(o.host, o.quote or o.message))
        elif o.reason is None:
            continue
        elif o.started or o.observed:
            failed.append(o)
        else:
            skipped.append(o.host)
    seen = [*before, *faulted]
    if not failed and faulted and (wave.canary or len({e.host for e in seen}) >= 2):
        if wave.canary:
            why = (f"the canary's start failed while its GPUs were sick ({faulted[0].quote}): a revision can "
                   f"provoke a GPU fault, so a canary's is no excuse")
        else:
            said = "; ".join(f"{e.host}: {e.quote}" for e in seen)
            why = (f"GPU faults on {len({e.host for e in seen})} hosts at this revision ({said}): a revision "
                   f"that provokes GPU faults is not excused twice")
        failed = [HostOutcome(e.host, Reason.GPU_FAULT, why, e.quote, started=True) for e in faulted]
        excused = [h for h in excused if h not in {e.host for e in faulted}]
    return WaveVerdict(tuple(failed), tuple(excused), tuple(faulted), tuple(skipped))


class Stop(msgspec.Struct, frozen=True):
    """Where a group's rollout halts and what it leaves on each host (`halt`): the failed hosts
    of the wave (the first named is where it halted) and the later waves' hosts, which stay
    untouched; each of them gets `quarantines[host]`, recorded by a pass of its own."""

    at: HostOutcome
    wave: Wave
    failed: tuple[str, ...]
    untouched: tuple[str, ...]
    quarantines: Mapping[str, Quarantine]

    @property
    def where(self) -> str:
        return halt_where(self.at.host, self.wave.canary, self.wave.number)

    def failed_message(self, message: str | None) -> str:
        """A failed host's result message, with where the rollout halted and what it left."""
        n = len(self.untouched)
        return (message + "; " if message else "") + f"rollout halted here, {n} host{'s' * (n != 1)} left untouched"

    def untouched_message(self, service: str, running: str | None) -> str:
        """An untouched host's message for the service, in the rollout's words (its journal line
        is in the failed host's event, not repeated here)."""
        return (f"{service}: rollout halted at {self.where}: {self.at.reason}; not restarted, "
                f"still running {str(running or '?')[:7]}")


def halt(plan: RolloutPlan, wave: Wave, failed: Sequence[HostOutcome], revision: str, hashes: Mapping[str, str],
         now: int) -> Stop:
    """PURE: a wave's halt (judge_wave's `halt`, the first named is where it halted): this
    revision's content of the service is quarantined on the failed hosts, for the first one's
    reason, and on every host of the later waves as RolloutHalted; each quarantine says where
    the rollout halted (halted_at, canary, wave) and why (cause), so quarantine_cover can extend
    it to members that hold no record of it. `hashes`: each host's desired content hash of the
    service."""
    at = failed[0]
    reason = at.reason or Reason.FAILED
    untouched = plan.after(wave)

    def quarantine(host: str, why: Reason) -> Quarantine:
        return Quarantine(hash=hashes[host], revision=revision, reason=why, quote=at.quote, at=now,
                          halted_at=at.host, canary=wave.canary, wave=wave.number, cause=reason)
    marks = {o.host: quarantine(o.host, reason) for o in failed}
    marks.update({h: quarantine(h, Reason.ROLLOUT_HALTED) for h in untouched})
    return Stop(HostOutcome(at.host, reason, at.message, at.quote, at.started, at.observed), wave,
                tuple(o.host for o in failed), untouched, marks)


def halted_reason(reason: Reason | None) -> Reason | None:
    """PURE: an untouched host's reason once the halt's quarantine is recorded there: the halt,
    unless the host failed for a reason of its own (a quarantine elsewhere on it is no failure)."""
    return Reason.ROLLOUT_HALTED if reason in (Reason.QUARANTINED, None) else reason


def excuses_on_record(service: str, revision: str, marks: Mapping[str, GpuFault | None]) -> tuple[Excuse, ...]:
    """The hosts whose gpu-fault.json says their start of `service` at `revision` failed with sick
    GPUs (an earlier run of this revision's rollout): they count towards judge_wave's two (pure)."""
    return tuple(Excuse(h, m.quote) for h, m in sorted(marks.items(), key=lambda kv: natural_key(kv[0]))
                 if m is not None and m.service == service and m.revision == revision)


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key for host names: digit runs compare as numbers, so gpu-2 comes before gpu-10."""
    return tuple((0, int(p), p) if p.isdigit() else (1, 0, p) for p in _DIGITS.split(name) if p)


def order_hosts(hosts: Iterable[str], labels: Mapping[str, Mapping[str, str]]) -> list[str]:
    """Canary candidates first: hosts labelled canary = "true", then the others; natural order."""
    key, value = CANARY_LABEL
    return sorted(hosts, key=lambda h: (labels.get(h, {}).get(key) != value, natural_key(h)))


def plan_waves(pending: Collection[str], labels: Mapping[str, Mapping[str, str]], policy: RolloutPolicy,
               members: int) -> tuple[Wave, ...]:
    """The waves for the pending hosts of one group (no waves for fewer than two hosts)."""
    if len(pending) < 2:
        return ()
    bound = policy.bound(max(members, len(pending)))
    ordered = order_hosts(pending, labels)
    canaries, rest = ordered[:policy.canary], ordered[policy.canary:]
    waves: list[Wave] = []
    for chunk_of, is_canary in ((canaries, True), (rest, False)):
        for i in range(0, len(chunk_of), bound):
            waves.append(Wave(len(waves) + 1, tuple(chunk_of[i:i + bound]), is_canary))
    return tuple(waves)


def group_members(state: DesiredState) -> dict[GroupKey, tuple[str, ...]]:
    """Every rollout group of the desired state and its hosts (natural order)."""
    groups: dict[GroupKey, list[str]] = {}
    for name, host in state.hosts.items():
        for svc in host.services.values():
            if svc.definition is not None:
                groups.setdefault(GroupKey(svc.name, svc.definition), []).append(name)
    return {k: tuple(sorted(v, key=natural_key)) for k, v in sorted(groups.items(), key=lambda kv: str(kv[0]))}


def plan_rollouts(state: DesiredState, restarts: Mapping[str, Collection[str]]) -> list[RolloutPlan]:
    """The rollout plan of every group that has at least two hosts to restart.

    restarts: host -> the services its plan restarts or starts with the desired version (the
    executor leaves out hosts it could not observe or did not select, and services it swaps for
    their last good version). The group's size for a percentage counts every member, selected
    or not: "25%" of the hosts that run the service is the same number whatever the selection.
    """
    labels = {n: h.labels for n, h in state.hosts.items()}
    plans = []
    for key, members in group_members(state).items():
        pending = [h for h in members if key.service in restarts.get(h, ())
                   and state.hosts[h].services[key.service].definition == key.definition]
        policy = state.hosts[members[0]].services[key.service].rollout   # one per group (load checks it)
        waves = plan_waves(pending, labels, policy, len(members))
        if waves:
            plans.append(RolloutPlan(key, policy, members, tuple(h for w in waves for h in w.hosts),
                                     policy.bound(len(members)), waves))
    return plans


# Reads a host's rendered content hash for a service at another revision (None: not there).
HashAt = Callable[[str, str, str], str | None]          # (revision, host, service) -> hash


@dataclass(frozen=True)
class Halt:
    """A live quarantine found on one member's record (its hash is the member's desired hash
    now). It stops the group when it carries `halted_at`: it was written when a waved rollout
    halted, on the host that failed and on every host the rollout left untouched."""

    host: str
    record: Mapping[str, object] = field(hash=False, compare=False)


def quarantine_cover(group: GroupKey, desired_hashes: Mapping[str, str], halts: Iterable[Halt],
                     revision: str, hash_at: HashAt) -> dict[str, dict[str, object]]:
    """Which members the group's halt covers, and the quarantine each of them gets.

    A halt lives in the service records of the hosts (the failed host's own quarantine, and the
    one the executor writes on every host the halted rollout left untouched), so another
    controller or a fresh checkout sees it. A member that holds no such record (it was
    unreachable or not selected when the rollout halted) is covered when its own rendering of
    the service is the same now as at the halted revision: the same change, for this host, as
    the one that failed. Per-host rendering differs ({host.address} ...), so this compares each
    host with itself, never one host's hash with another's. A commit that changes this host's
    rendering lifts it; a commit that touches only other files does not.

    desired_hashes: member -> its desired content hash now, for the members that would restart
    without this (the executor passes only those). Returns member -> quarantine record.
    """
    out: dict[str, dict[str, object]] = {}
    for halt in sorted(halts, key=lambda h: natural_key(h.host)):
        q = halt.record
        rev = q.get("revision")
        # Only a failure inside a waved rollout stops the group; a host that failed a change of
        # its own (no waves) quarantines that change on itself alone.
        if not isinstance(rev, str) or not q.get("halted_at"):
            continue
        for host, want in sorted(desired_hashes.items()):
            if host == halt.host or host in out:
                continue
            then = want if rev == revision else hash_at(rev, host, group.service)
            if then == want:
                out[host] = {"hash": want, "revision": rev, "reason": Reason.ROLLOUT_HALTED,
                             "halted_at": q.get("halted_at") or halt.host,
                             "cause": q.get("cause") or q.get("reason"), "quote": q.get("quote")}
    return out
