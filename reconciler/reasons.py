"""The reconciler's vocabulary of reasons: one CamelCase word per idea, as Flux's condition
reasons are constants of its API (`HealthCheckFailed`, `RolledBack`).

A reason says why an action is in a plan (`NewService`, `GpuGate`), why a service or a host came
to its result (`CrashLoop`, `RolledBack`, `PreflightFailed`, `Unreachable`), or why a version is
quarantined. The values are the strings the reports, the JSON output, the state store, the git
notes and the records on the hosts have always carried: a `StrEnum` member is that string (it
compares, hashes, formats and serialises as it), so a record written before the enum reads the
same. A record's reason is read with `Reason.read`: a word this version does not know (a newer
reconciler wrote it) reads as `Failed`, never as an error.

Base layer: imported by errors.py, the planner, pre-flight and everything above.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Every reason the reconciler gives, by where it is given (see the module docstring)."""

    # -- why an action is in a plan (plan/actions.py) --
    NEW_SERVICE = "NewService"
    UNIT_CHANGED = "UnitChanged"
    ENV_CHANGED = "EnvChanged"
    SECRET_CHANGED = "SecretChanged"
    DRIFT = "Drift"
    FOREIGN_DROPIN = "ForeignDropIn"
    NOT_RUNNING = "NotRunning"
    STALE_PROCESS = "ProcessPredatesFiles"
    INTERRUPTED = "InterruptedDeploy"
    REVERIFY = "Reverify"
    SUBSTITUTE = "SubstituteLastGood"
    HOLD_LAST_GOOD = "HoldLastGood"
    HOLD_STOPPED = "HoldStopped"
    HOLD_HALTED = "HoldHalted"
    BLOCKED = "Blocked"
    ADOPT = "Adopt"
    REMOVED = "RemovedFromGit"
    RESTORE = "RestoreAdopted"
    RESTORE_MASK = "RestoreMask"
    KEEP_ORPHAN = "KeptWhileBlocked"
    GPU_GATE = "GpuGate"
    FETCH_MODEL = "FetchModel"
    START_AT_BOOT = "StartAtBoot"
    RELOAD = "UnitFilesChanged"
    HEALTH = "HealthCheck"
    RECORD = "Record"
    QUARANTINE = "RecordQuarantine"
    CONFIRM = "DeadMansSwitch"
    START_AGAIN = "StartAgain"
    HOLD_UNJUDGED = "HoldUnjudged"
    STALE_TEMP = "StaleTempFile"
    LEFT_ROTATION = "LeftRotation"      # a run left rotation and was killed before its rejoin (plan/rejoin.py)
    HOLD_OUT = "HoldOutOfRotation"      # ... and the service is not healthy: it stays out

    # -- a health watch's verdict (host/health.py, plan/judges.py) --
    HEALTHY = "Healthy"
    CRASH_LOOP = "CrashLoop"
    START_FAILED = "StartFailed"
    START_TIMEOUT = "StartTimeout"
    UNSTABLE = "Unstable"
    UNIT_NOT_LOADED = "UnitNotLoaded"
    EXITED = "Exited"
    NOT_CONFIRMED = "NotConfirmed"      # the dead-man's switch fired: the controller never confirmed
    # ... and no verdict on the version (records.NO_VERDICT)
    SUPERSEDED = "Superseded"
    INCONCLUSIVE = "Inconclusive"
    START_LIMIT_HIT = "StartLimitHit"
    GPU_FAULT = "GpuFault"
    # ... and the smoke test's, after a healthy start (plan/smoke.py)
    WRONG_ANSWER = "WrongAnswer"        # up, but a check's answer is not the expected text
    SLOW_ANSWER = "SlowAnswer"          # the first token came later than the smoke test's ttft
    SMOKE_FAILED = "SmokeFailed"        # no answer at all

    # -- what a service's run comes to (loop/results.py, plan/state.py) --
    ROLLED_BACK = "RolledBack"
    ROLLBACK_FAILED = "RollbackFailed"
    FIRST_DEPLOY_FAILED = "FirstDeployFailed"
    QUARANTINED = "Quarantined"
    NO_ROLLBACK = "QuarantinedNoRollback"
    ROLLOUT_HALTED = "RolloutHalted"
    FOREIGN = "Foreign"

    # -- why a start is refused before anything stops (model.Block) --
    PREFLIGHT_FAILED = "PreflightFailed"
    UNIT_INVALID = "UnitInvalid"
    ENGINE_REJECTED = "EngineRejected"
    MODEL_FETCH_FAILED = "ModelFetchFailed"
    GPU_BUSY = "GpuBusy"
    SECRET_MISSING = "SecretMissing"
    SECRET_UNDECRYPTABLE = "SecretUndecryptable"

    # -- a host's own failure (errors.HostError and the fleet run) --
    FAILED = "Failed"
    HOST_FAILED = "HostFailed"
    UNREACHABLE = "Unreachable"
    HOST_KEY_UNVERIFIED = "HostKeyUnverified"
    COMMAND_FAILED = "CommandFailed"
    OBSERVE_FAILED = "ObserveFailed"
    APPLY_FAILED = "ApplyFailed"
    LOCKED = "Locked"
    NOT_DESCENDANT = "NotDescendant"
    DRAIN_FAILED = "DrainFailed"        # the host could not leave rotation: nothing was stopped
    REJOIN_FAILED = "RejoinFailed"      # healthy and judged, but not back in the balancer's rotation

    # -- a rollout's own stop (plan/budget.py) --
    BUDGET_BLOCKED = "BudgetBlocked"    # no pending host could restart without breaking min_available

    @classmethod
    def read(cls, text: object, default: Reason | None = None) -> Reason:
        """A reason as a record or a report wrote it: its member, or `default` (Failed) for
        anything this version does not know."""
        known = cls._value2member_map_.get(text) if isinstance(text, str) else None
        if isinstance(known, cls):
            return known
        return default if default is not None else cls.FAILED
