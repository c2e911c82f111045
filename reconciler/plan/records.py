"""PURE: the records the reconciler keeps on each host, and the one ranking of results.

The host is the source of truth for what was deployed there and how it went, so another
controller, a restarted daemon or a fresh checkout picks up exactly where the last run stopped.
Per service, `/var/lib/reconciler/services/<name>.json` holds a `ServiceRecord`:

    hash, revision                   what the files on disk hold (the last version applied)
    last_good_hash, last_good_revision
                                     the last version that passed health here
    pending {hash, revision, rollback, replaces_*, at, started}
                                     written BEFORE any file of the service is replaced: what is
                                     being deployed and what it replaces. Cleared by the verdict.
    quarantine {hash, revision, reason, quote, at, rollback_failed, halted_at, ...}
                                     a version that failed here (or whose rollout halted): never
                                     re-applied until the rendered service changes or --retry
    adopted {files, was_enabled, was_active, fragment}
                                     a hand-made unit taken over with `adopt = true`; its original
                                     files are kept under /var/lib/reconciler/adopted/<name>/
    secrets {NAME: version}          what each secret held when it was delivered, never the value:
                                     a keyed hash (HMAC) of it (plan.secret_versions)

A record's presence is what puts a service in the host's inventory: only those are ever stopped
or removed. Records are read leniently (older schema, unknown keys, missing keys) and written
strictly (schema version, every field). `/var/lib/reconciler/host.json` is a `HostRecord`.

`Result` is the one ranking of host and service results, shared by the CLI (exit code), the
state store, the metrics and the report.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any, TypeVar

import msgspec

from ..reasons import Reason
from . import lenient
from .gpuhealth import GPU_FAULT
from .lenient import Schema, Text, Whole, load_json

SCHEMA = 2


class Result(StrEnum):
    """The outcome of a host (or of one service on it), from best to worst."""

    IN_SYNC = "in-sync"
    CONVERGED = "converged"
    WOULD_CHANGE = "would-change"
    QUARANTINED = "quarantined"      # the desired version is quarantined; the last good runs
    ROLLED_BACK = "rolled-back"      # this run rolled back to the last good version
    FAILED = "failed"                # unreachable, blocked, foreign, no rollback possible ...

    @property
    def rank(self) -> int:
        """Position in the ranking: the worst result of a host's services is the host's."""
        return _ORDER.index(self)

    @property
    def exit_code(self) -> int:
        """0 converged / in sync, 2 a dry run found changes, 3 rolled back or on last good, 4 failed."""
        return _EXIT[self]


_ORDER = list(Result)
_EXIT = {Result.IN_SYNC: 0, Result.CONVERGED: 0, Result.WOULD_CHANGE: 2, Result.QUARANTINED: 3,
         Result.ROLLED_BACK: 3, Result.FAILED: 4}


R = TypeVar("R")


def read(cls: type[R], data: object) -> R | None:
    """PURE: a record of type `cls` from JSON data, read leniently (lenient.read): unknown keys
    ignored, a missing key or one that does not read as its field's type is its default."""
    return lenient.read(cls, data, _ABSENT)


@dataclass(frozen=True)
class Quarantine:
    """A rendered service (by content hash) that failed on this host, or whose rollout halted."""

    hash: Text
    revision: str
    reason: Reason                   # CrashLoop, StartFailed, StartTimeout, RolloutHalted ...
    quote: Text | None = None        # the journal line that explains the failure
    at: Whole = 0                    # epoch seconds
    rollback_failed: bool = False    # the last good failed too: the service is left stopped
    halted_at: Text | None = None    # a halted rollout: the host where it halted
    canary: bool = False             # ... in the canary wave
    wave: Whole | None = None        # ... in this wave
    cause: Reason | None = None      # ... for this reason (the failed host's reason)

    @classmethod
    def from_json(cls, data: object) -> Quarantine | None:
        """Read leniently (`read`); None without a hash. A reason this version does not know
        reads as Failed (Reason.read)."""
        return read(cls, data)

    def to_json(self) -> dict[str, Any]:
        """Every field that is set (None and False left out)."""
        # dataclasses.asdict, not msgspec.to_builtins: a dataclass msgspec decoded holds a field
        # left at its default only on its class, and to_builtins leaves such a field out.
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}

    def merged(self, other: Quarantine | None) -> Quarantine:
        """This quarantine, with what it lacks filled in from another one for the same hash (the
        host's own failure wins over a fleet-wide halt; the halt adds where the rollout stopped)."""
        if other is None or other.hash != self.hash:
            return self
        return replace(self, halted_at=self.halted_at or other.halted_at, canary=self.canary or other.canary,
                       wave=self.wave if self.wave is not None else other.wave, cause=self.cause or other.cause,
                       quote=self.quote or other.quote,
                       rollback_failed=self.rollback_failed or other.rollback_failed)

    def why(self, host: str) -> str:
        """Why this version is quarantined, in words: the failure, or where its rollout halted."""
        if not self.halted_at:
            return self.reason
        if self.halted_at == host:
            return f"{self.reason}; its rollout halted here"
        return f"rollout halted at {halt_where(self.halted_at, self.canary, self.wave)}: {self.cause}"


def halt_where(host: str, canary: bool, wave: object) -> str:
    """Where a rollout halted, in words: 'canary gpu-3' or 'gpu-7 (wave 3)'."""
    return f"canary {host}" if canary else f"{host} (wave {wave})"


@dataclass(frozen=True)
class Pending:
    """A deploy that was started and has no verdict yet (the durable intent)."""

    hash: Text
    revision: str
    rollback: bool = False           # a substitution of the last good, not the desired version
    replaces_hash: Text | None = None
    replaces_revision: Text | None = None
    at: Whole = 0                    # host clock (epoch s) when the intent was written
    started: bool = False            # the start/restart was issued after the files were in place
    blocked: Text | None = None      # why the start did not happen (GPUs still busy): tried again next run
    unjudged: Text | None = None     # why the last watch of it came to no verdict: it is started again
    attempts: Whole = 0              # watches of it that came to no verdict (capped: MAX_UNJUDGED)

    def to_json(self) -> dict[str, Any]:
        """Every field."""
        return asdict(self)


@dataclass(frozen=True)
class Adopted:
    """A unit that was on the host before the reconciler took it over (`adopt = true`)."""

    files: tuple[str, ...] = ()      # original paths, copies kept under adopted/<service>/<path>
    was_enabled: bool = False
    was_active: bool = False
    fragment: Text | None = None     # where systemd loaded it from at adoption
    masked: bool = False             # it was masked (a link to /dev/null): masked again on the way out

    def to_json(self) -> dict[str, Any]:
        """Every field."""
        return {**asdict(self), "files": list(self.files)}


@dataclass(frozen=True)
class ServiceRecord:
    """What the reconciler knows about one service it installed on a host."""

    hash: Text | None = None
    revision: Text | None = None
    last_good_hash: Text | None = None
    last_good_revision: Text | None = None
    quarantine: Quarantine | None = None
    pending: Pending | None = None
    adopted: Adopted | None = None
    secrets: Mapping[str, str] = field(default_factory=dict)   # NAME -> keyed hash of the delivered value
    # issue 42: the seconds each step of the last healthy restart here took (plan/drain.StepKind
    # value -> seconds): the host's own load time, which the dry run's forecast starts from
    steps: Mapping[str, float] = field(default_factory=dict)
    corrupt: bool = False            # unreadable on the host: kept in the inventory, trusted for nothing
    schema: Schema = SCHEMA

    @classmethod
    def from_json(cls, data: object) -> ServiceRecord:
        """Read leniently (`read`): older schemas, unknown keys and missing keys are fine; anything
        that is not a JSON object is a corrupt record (still in the inventory)."""
        return read(cls, data) or cls(corrupt=True)

    @classmethod
    def parse(cls, text: str) -> ServiceRecord:
        """Any text: a record, or a corrupt one (kept in the inventory, trusted for nothing)."""
        return cls.from_json(load_json(text))

    def to_json(self) -> dict[str, Any]:
        """Written strictly: the current schema, every field, nothing else."""
        return {"schema": SCHEMA, "hash": self.hash, "revision": self.revision,
                "last_good_hash": self.last_good_hash, "last_good_revision": self.last_good_revision,
                "quarantine": self.quarantine.to_json() if self.quarantine else None,
                "pending": self.pending.to_json() if self.pending else None,
                "adopted": self.adopted.to_json() if self.adopted else None,
                "secrets": dict(sorted(self.secrets.items())),
                "steps": {k: round(v, 3) for k, v in sorted(self.steps.items())}}

    def dumps(self) -> str:
        return _dumps(self.to_json())

    @property
    def verified(self) -> bool:
        """The applied version passed health here (it is the last good)."""
        return self.hash is not None and self.hash == self.last_good_hash


@dataclass(frozen=True)
class HostRecord:
    """/var/lib/reconciler/host.json: the last revision applied to the host, and when."""

    applied_revision: Text | None = None
    applied_at: Whole = 0
    schema: Schema = SCHEMA

    @classmethod
    def parse(cls, text: str) -> HostRecord:
        """Any text: the record, read leniently (`read`), or an empty one."""
        return read(cls, load_json(text)) or cls()

    def dumps(self) -> str:
        return _dumps({**asdict(self), "schema": SCHEMA})


def _dumps(data: dict[str, Any]) -> str:
    """A record as written on the host: JSON, keys sorted, one line, ASCII (json's escapes: the
    text travels inside the shell programs that write it, byte for byte as before)."""
    return json.dumps(data, sort_keys=True) + "\n"


# What a key that is absent (or does not read as its type) means when a record is read, where
# that is not the field's default: a record written before `schema` existed is of schema 1.
_ABSENT: dict[type, dict[str, Any]] = {Quarantine: {"revision": "", "reason": Reason.FAILED}, Pending: {"revision": ""},
                                       ServiceRecord: {"schema": 1}, HostRecord: {"schema": 1}}


SUPERSEDED = Reason.SUPERSEDED
# A watch that came to no verdict on the version: a crash sign without evidence that the service
# itself failed (systemd could not start its process: health.spawn_failure), or a start that
# systemd refused for its start limit (our own starts in quick succession). The version is
# neither last good nor quarantined; the pending deploy stays, and the planner starts it again,
# at most MAX_UNJUDGED times in all.
INCONCLUSIVE = Reason.INCONCLUSIVE
START_LIMIT_HIT = Reason.START_LIMIT_HIT
# A start that failed while the host's GPUs were sick (gpuhealth.blames_gpu): the host's fault,
# no verdict on the version either (the host is marked GpuFault; the unit is stopped).
NO_VERDICT = frozenset({SUPERSEDED, INCONCLUSIVE, START_LIMIT_HIT, GPU_FAULT})
MAX_UNJUDGED = 3


class Verdict(msgspec.Struct, frozen=True):
    """The health verdict on one watched service (what the planner needs of health.Outcome)."""

    healthy: bool
    reason: Reason
    quote: str | None = None
    message: str = ""


class Judged(msgspec.Struct, frozen=True):
    """A verdict applied to a record: the record to write and whether to stop the unit."""

    record: ServiceRecord
    stop: bool


def judge(rec: ServiceRecord, *, hash: str, revision: str, rollback: bool, verdict: Verdict, now: int,
          fleet: Quarantine | None = None) -> Judged:
    """PURE: the record after a verdict on a watched version (written at once, by itself).

    healthy deploy      -> last good = it; any quarantine of it lifted; pending cleared
    healthy rollback    -> last good = it; the quarantine of the desired version stays
    failed deploy       -> quarantine it (reason, journal line); stop the unit; pending cleared
    failed rollback     -> the quarantine is marked rollback_failed; stop the unit (no flapping)
    superseded          -> a newer revision arrived during the wait: no verdict at all (not last
                           good, not quarantined); the unit keeps running for the next deploy
    inconclusive, start limit hit
                        -> no verdict on the version: the pending deploy stays, with why and one
                           more attempt counted; the planner starts it again (a start refused
                           again right after that is StartFailed)
    GPU fault           -> the same, and the unit is stopped: the failed start was the host's
                           (its GPUs are sick), never the version's; not last good, not quarantined
    """
    base = replace(rec, pending=None, hash=hash, revision=revision)
    if verdict.reason == SUPERSEDED:
        return Judged(base, stop=False)
    kept = rec.pending if rec.pending is not None and rec.pending.hash == hash else None
    if verdict.reason == START_LIMIT_HIT and kept is not None and (kept.unjudged or "").startswith(START_LIMIT_HIT):
        # refused again after the planner started it again (reset-failed first): that start failed
        verdict = msgspec.structs.replace(verdict, reason=Reason.START_FAILED,
                                          message=f"{verdict.message}, again after systemctl reset-failed")
    elif verdict.reason in NO_VERDICT:
        pending = kept or Pending(hash=hash, revision=revision, rollback=rollback, started=True, at=now)
        if not pending.at:         # the intent's time is stamped on the host as it is written
            pending = replace(pending, at=now)
        why = f"{verdict.reason}: {verdict.message}" if verdict.message else verdict.reason
        return Judged(replace(base, pending=replace(pending, unjudged=why, attempts=pending.attempts + 1)),
                      stop=verdict.reason == GPU_FAULT)
    if verdict.healthy:
        q = rec.quarantine if rollback else None
        return Judged(replace(base, last_good_hash=hash, last_good_revision=revision, quarantine=q), stop=False)
    if rollback:
        q = rec.quarantine or Quarantine(hash=hash, revision=revision, reason=verdict.reason, quote=verdict.quote,
                                         at=now)
        return Judged(replace(base, quarantine=replace(q, rollback_failed=True)), stop=True)
    q = Quarantine(hash=hash, revision=revision, reason=verdict.reason, quote=verdict.quote, at=now).merged(fleet)
    return Judged(replace(base, quarantine=q), stop=True)
