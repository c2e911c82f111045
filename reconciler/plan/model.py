"""PURE: the planner's vocabulary: action kinds in execution order, the states a service can be
in, the reasons an action is in a plan, and the plans themselves (one service's, one host's)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from ..desired.spec import ModelSpec, SecretSpec, ServiceSpec
from ..reasons import Reason as Reason  # the planner's reasons are the one vocabulary (reasons.py)
from .confirm import Switch
from .gpuhealth import GpuHealth
from .records import Quarantine, Result, ServiceRecord


class Kind(StrEnum):
    """Action kinds, in the order the executor runs them on a host."""

    FETCH = "fetch-model"        # controller: download a missing model before anything stops
    HOLD = "hold"                # no-op marker: a service deliberately left as it is (and why)
    INTENT = "intent"            # record on the host what is about to be deployed (pending)
    DISARM = "disarm"            # take down a dead-man's switch (a service that leaves, or is held)
    STOP = "stop"
    DISABLE = "disable"
    ADOPT = "adopt"              # keep a foreign unit's original files under adopted/
    WRITE = "write"
    REMOVE = "remove"
    SECRETS = "secrets"          # deliver a service's secrets to its root-only credstore (values never in the plan)
    RESTORE = "restore"          # put an adopted unit's original files back
    ARM = "arm"                  # write the deploy's dead-man's switch (confirm.py)
    DAEMON_RELOAD = "daemon-reload"
    KILL_STRAYS = "kill-strays"  # controller: kill stray GPU holders on its GPUs after the stop (gpu_policy "kill")
    WAIT_GPUS = "wait-gpus"      # controller: wait until the GPUs are free before starting
    ARM_TIMER = "arm-timer"      # ready the switch's timer (made if the controller goes), right before the start
    ENABLE = "enable"
    START = "start"
    RESTART = "restart"
    RECORD = "record"            # per-service records after the starts, and the host record
    WATCH = "watch"              # controller: health watch until a verdict
    REJOIN = "rejoin"            # controller: back into rotation, left by a run that did not finish (rejoin.py)

    @property
    def mutating(self) -> bool:
        """Changes a service on the host (bookkeeping, markers and watches do not)."""
        return self not in (Kind.HOLD, Kind.INTENT, Kind.RECORD, Kind.WATCH, Kind.ARM, Kind.ARM_TIMER,
                            Kind.DISARM)


ORDER = {k: i for i, k in enumerate(Kind)}


class State(StrEnum):
    """The fixed set of states a service can be in (see the module docstring)."""

    NEW = "New"
    IN_SYNC = "InSync"
    CHANGED = "Changed"
    DRIFTED = "Drifted"
    STOPPED = "Stopped"
    PENDING = "Pending"
    QUARANTINED = "Quarantined"
    QUARANTINED_NO_GOOD = "QuarantinedNoLastGood"
    ROLLBACK_FAILED = "RollbackFailed"
    HALTED = "RolloutHalted"
    ADOPT = "Adopt"
    FOREIGN = "Foreign"
    BLOCKED = "Blocked"
    DEFERRED = "Deferred"
    ORPHAN = "Orphan"
    INCONCLUSIVE = "Inconclusive"


class Target(msgspec.Struct, frozen=True):
    """The version of a service this run converges to: the desired one, or the last good."""

    spec: ServiceSpec
    revision: str
    rollback: bool = False

    @property
    def hash(self) -> str:
        return self.spec.content_hash()


class Watch(msgspec.Struct, frozen=True):
    """What the health watch of one service needs to judge it against its own start."""

    hash: str
    revision: str
    rollback: bool
    baseline_restarts: int = 0       # NRestarts before our start (a restart keeps counting)
    baseline_invocation: str = ""    # InvocationID before our start: unchanged = not started yet
    baseline_active_enter: str = ""  # ActiveEnterTimestampMonotonic before: unchanged = never active
    reverify: bool = False           # watched again, without a restart (the verdict was lost)
    since: int | None = None         # epoch the deploy began, for the journal (None: this apply)


@dataclass(frozen=True)
class Action:
    """One step on one host. `content` is never printed (env may hold secrets); `diff` is masked."""

    kind: Kind
    reason: Reason
    service: str | None = None
    path: str | None = None
    content: str | None = field(default=None, repr=False)
    diff: str | None = None
    detail: str = ""
    record: ServiceRecord | None = field(default=None, repr=False)   # INTENT / RECORD: what to write
    watch: Watch | None = None
    switch: Switch | None = field(default=None, repr=False)          # ARM, ARM_TIMER: the dead-man's switch
    secrets: tuple[SecretSpec, ...] = field(default=(), repr=False)   # SECRETS: what to deliver (no values)
    model: ModelSpec | None = field(default=None, repr=False)         # FETCH: the model, its command and time limit
    # START: systemd had never loaded the unit (no failed state, restart count or start limit to
    # reset first)
    fresh: bool = False

    def describe(self) -> str:
        target = self.path or self.service or ""
        return f"{self.kind.value} {target}".strip() + f"  ({self.detail or self.reason.value})"

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind.value, "service": self.service, "path": self.path,
                "reason": self.reason.value, "detail": self.detail, "diff": self.diff}


class ServicePlan(msgspec.Struct, frozen=True):
    """One service's state, the version it converges to, and what that means for the host."""

    name: str
    state: State
    target: Target | None = None
    result: Result = Result.IN_SYNC  # before any verdict: what this state alone makes of the host
    reason: Reason | None = None     # when result is not a success
    note: str = ""                   # for people: quarantine, foreign path, blocked reasons
    quote: str | None = None         # the journal line recorded with a quarantine
    first_deploy: bool = False       # QuarantinedNoLastGood: no version of it ever passed health here


class Block(msgspec.Struct, frozen=True):
    """Why pre-flight (or systemd's own check of the unit) refuses to start a service."""

    reason: Reason    # PreflightFailed | UnitInvalid | EngineRejected | ModelFetchFailed | GpuBusy | GpuFault | Secret*
    message: str


class ModelFetch(msgspec.Struct, frozen=True):
    """A model pre-flight found missing or incomplete on the host, with `model.fetch` set: what a
    FETCH runs, and the room it has (the planner decides whether it may: state.fetch_refused)."""

    model: ModelSpec
    total_size: int | None = None    # bytes, as the checkpoint's index says (None: no index)
    free_bytes: int | None = None    # free space of the file system it goes to (None: unknown)


class Checks(msgspec.Struct, frozen=True):
    """What the host said before this plan: host-side pre-flight's findings and the answers of
    this run's steps so far (the GPU gate). The planner only reads them."""

    blocked: Mapping[str, tuple[Block, ...]] = msgspec.field(default_factory=dict)
    fetch: Mapping[str, ModelFetch] = msgspec.field(default_factory=dict)   # service -> its model to fetch first
    gpu_gate: bool = False           # the host has GPUs: starts wait until they are free
    gpu_health: GpuHealth | None = None   # the GPUs' health read for this plan's starts (None: not read)
    # service -> why its GPUs stayed busy after this run stopped it: the gate's answer (not started)
    gate: Mapping[str, str] = msgspec.field(default_factory=dict)


class Context(msgspec.Struct, frozen=True):
    """Everything besides desired and observed that a plan depends on (all plain values)."""

    revision: str
    last_good: Mapping[str, ServiceSpec | None] = msgspec.field(default_factory=dict)  # rendered at last_good_revision
    fleet_quarantine: Mapping[str, Quarantine] = msgspec.field(default_factory=dict)   # halted rollouts
    deferred: frozenset[str] = frozenset()    # converged by another pass (a rollout wave)
    retry: bool = False                       # --retry: ignore quarantines once
    checks: Checks = msgspec.field(default_factory=Checks)
    confirm_margin: float | None = 60.0       # dead-man's switch window = start-up + stable_for + this (None: off)


class HostPlan(msgspec.Struct, frozen=True):
    """Everything to do on one host, in execution order, plus every service's plan."""

    host: str
    revision: str
    actions: tuple[Action, ...]
    services: Mapping[str, ServicePlan]
    dropped_records: tuple[str, ...] = ()     # services leaving the inventory

    @property
    def states(self) -> dict[str, State]:
        return {n: s.state for n, s in self.services.items()}

    @property
    def changes(self) -> tuple[Action, ...]:
        """Actions that change the host's services (bookkeeping, holds and watches excluded)."""
        return tuple(a for a in self.actions if a.kind.mutating)

    @property
    def visible(self) -> tuple[Action, ...]:
        """What a person should see in a plan: everything but the bookkeeping writes."""
        return tuple(a for a in self.actions if a.kind not in (Kind.INTENT, Kind.RECORD, Kind.ARM_TIMER,
                                                               Kind.DISARM))

    @property
    def restarts(self) -> list[str]:
        return [a.service for a in self.actions if a.kind in (Kind.START, Kind.RESTART) and a.service]

    @property
    def watches(self) -> list[Action]:
        return [a for a in self.actions if a.kind is Kind.WATCH]

    def summary(self) -> str:
        """One line: what would change, e.g. 'write 2 files, daemon-reload, restart sglang'."""
        if not self.changes:
            reverify = [a.service for a in self.watches if a.service]
            return f"in sync; re-verify {', '.join(reverify)}" if reverify else "in sync"
        parts = []
        for kind in (Kind.WRITE, Kind.REMOVE):
            if n := sum(a.kind is kind for a in self.actions):
                parts.append(f"{kind.value} {n} file{'s' * (n != 1)}")
        for kind in (Kind.FETCH, Kind.ADOPT, Kind.SECRETS, Kind.RESTORE, Kind.DAEMON_RELOAD, Kind.STOP, Kind.DISABLE,
                     Kind.KILL_STRAYS, Kind.WAIT_GPUS, Kind.ENABLE, Kind.START, Kind.RESTART, Kind.REJOIN):
            names = sorted({a.service for a in self.actions if a.kind is kind and a.service})
            if kind is Kind.DAEMON_RELOAD and any(a.kind is kind for a in self.actions):
                parts.append("daemon-reload")
            elif names:
                parts.append(f"{kind.value} {', '.join(names)}")
        return ", ".join(parts)
