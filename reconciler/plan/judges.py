"""PURE: what a health watch reads, judged: one `systemctl show` reading of a unit
(`judge_systemd` -> a `UnitReading`), and the unit's journal (facts/journal.py's entries): the
line that explains a failure (`explain`), and whether a crash was the service's at all
(`spawn_failure`).

The journal is host output, read as data (review N5): `explain` looks for its patterns in the
first EXPLAIN_SCAN characters of a line only (a pattern with `.*` on a 48 KiB line of a hostile
service would take seconds), and the read itself keeps the newest JOURNAL_BYTES of what
journalctl prints. The watch (host/health.py) redacts a quote before it cuts it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from ..reasons import Reason
from .facts.journal import JournalEntry
from .unit import UnitState

EXPLAIN_SCAN = 4096          # characters of a line that explain() matches its patterns in


class UnitReading(msgspec.Struct, frozen=True):
    """What systemd says about a unit right now, judged: one reading's state (the verdict on a
    version is records.py's)."""

    state: str            # "running" | "starting" | "crashed" | "not-loaded" | "exited" | "refused"
    reason: Reason | None = None    # when not fine
    detail: str = ""


def judge_systemd(props: dict[str, str], baseline_restarts: int, *, baseline_invocation: str = "",
                  baseline_active_enter: str = "") -> UnitReading:
    """Sort one `systemctl show` reading (pure); the states are systemd.service(5)'s.

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
    restarts = UnitState.parse(props).n_restarts      # the one parse of it (plan/unit.py)
    summary = f"ActiveState={active} SubState={sub} Result={result} NRestarts={restarts}"
    if load and load != "loaded":
        return UnitReading("not-loaded", Reason.UNIT_NOT_LOADED, f"LoadState={load}: the unit file is invalid")
    if baseline_invocation and props.get("InvocationID", "") == baseline_invocation:
        return _not_begun(active, props.get("Job", ""), summary)
    entered = props.get("ActiveEnterTimestampMonotonic")     # absent: unknown, judged a crash
    never_active = entered == "0" or (bool(baseline_active_enter) and entered == baseline_active_enter)
    crash = Reason.START_FAILED if never_active else Reason.CRASH_LOOP
    if active == "failed":
        why = "start limit hit" if result == "start-limit-hit" else f"Result={result}"
        what = "start failed" if never_active else "unit failed"
        return UnitReading("crashed", crash, f"{what} ({why}, NRestarts={restarts})")
    if sub.startswith("auto-restart") or restarts > baseline_restarts:
        what = "start keeps failing" if never_active else "crash loop"
        return UnitReading("crashed", crash, f"{what}: {summary}")
    if active == "active" and sub in ("running", "exited", "reload"):
        return UnitReading("running", detail=summary)
    if active in ("inactive", "deactivating"):
        return _stopped(props.get("Job", ""), never_active, summary)
    return UnitReading("starting", detail=summary)


def _not_begun(active: str, job: str, summary: str) -> UnitReading:
    """A reading whose InvocationID is still the one before our start: it has not begun."""
    if active == "failed" and job in ("", "0"):
        # systemd refused our start (more starts than StartLimitBurst= within
        # StartLimitIntervalSec=): no job left and no new invocation, so none will begin.
        # Result= says start-limit-hit only where the unit had not already failed: a restart
        # of a unit in its crash loop (auto-restart) keeps that crash's exit-code.
        return UnitReading("refused", Reason.START_LIMIT_HIT, f"systemd refused the start: start limit hit ({summary})")
    return UnitReading("starting", detail=f"waiting for the start to begin: {summary}")


def _stopped(job: str, never_active: bool, summary: str) -> UnitReading:
    """A unit inactive or deactivating since our start."""
    if job not in ("", "0"):
        # a job is queued (our start, still waiting): nothing is judged before it runs
        return UnitReading("starting", detail=f"waiting for the start job {job}: {summary}")
    if never_active:   # e.g. a start timeout: systemd is stopping what never came up
        return UnitReading("crashed", Reason.START_FAILED, f"start failed: {summary}")
    return UnitReading("exited", Reason.EXITED, f"process ended: {summary}")


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


def explain(lines: Sequence[JournalEntry]) -> str | None:
    """Pick the journal line that explains a failure (pure).

    The service's own lines win over systemd's. The best pattern wins; among equals, the last
    line (closest to the crash).
    """
    for own in (True, False):
        cands = [e.message.strip() for e in lines if e.own == own and e.message.strip()
                 and not _SYSTEMD_NOISE.search(e.message[:EXPLAIN_SCAN])]
        for pat in _EXPLAIN:
            hits = [m for m in cands if pat.search(m[:EXPLAIN_SCAN])]
            if hits:
                return hits[-1]
    own_lines = [e.message.strip() for e in lines if e.own and e.message.strip()]
    return own_lines[-1] if own_lines else None


# systemd's own exit statuses for a process whose set-up failed before the service's command
# ran, for a cause outside the unit (systemd.exec(5), "Process Exit Codes"): it could not be put
# into the unit's cgroup, or memory ran out while it was set up. Others in 200-245 (203/EXEC
# a missing binary, 217/USER an unknown user, ...) are the unit's own mistakes and count.
SPAWN_FAILURES = {"204": "MEMORY", "219": "CGROUP"}


def spawn_failure(props: dict[str, str], entries: Sequence[JournalEntry], baseline_invocation: str = "") -> str | None:
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
    if len(setup) < len(ends):          # an end of its own: an exit status, a signal
        return None
    if setup:
        names = ", ".join(dict.fromkeys(f"{s}/{SPAWN_FAILURES[s]}" for s in setup))
        return f"systemd could not start its process (exit status {names}): the service itself never ran"
    if props.get("Result") == "resources":
        return "systemd could not set up its process (Result=resources): the service itself never ran"
    return None


