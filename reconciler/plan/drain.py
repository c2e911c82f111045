"""PURE: the drain of a host's restart, as data (issue 42): its steps, when its wait for
in-flight work is over, and the readings it waits on (the engine's metric, HAProxy's stats).

No I/O, no clock. The steps of a restart of a service with a drain declared
(desired/spec.DrainSpec), and what each does, are in docs/drain.md ("What a restart does");
without a drain they are stop, start, ready (and smoke). `restart_steps` is what the plan and
a dry run print; loop/cutover.py runs them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

import msgspec

from ..desired.spec import CallSpec, DrainSpec, ServiceSpec


class RestartStep(msgspec.Struct, frozen=True):
    """One step of a host's restart: what it does, and how long it may take (None: its own bound)."""

    kind: StepKind
    detail: str
    timeout: float | None = None

    def describe(self) -> str:
        """'drain: wait for sglang:num_running_reqs at http://...:30000/metrics to reach 0 (at most 120s)'."""
        bound = f" (at most {self.timeout:g}s)" if self.timeout is not None else ""
        return f"{self.kind.value}: {self.detail}{bound}"


class StepKind(StrEnum):
    """The steps of a restart, in the order they run."""

    LEAVE = "leave"          # out of the load balancer
    DRAIN = "drain"
    STOP = "stop"
    WAIT_GPUS = "wait-gpus"
    START = "start"
    READY = "ready"
    SMOKE = "smoke"
    REJOIN = "rejoin"
    SERVING = "serving"


def restart_steps(spec: ServiceSpec, *, running: bool = True, in_rotation: bool = True, gpu_gate: bool = False,
                  rollback: bool = False) -> tuple[RestartStep, ...]:
    """The steps of (re)starting `spec` on one host. running: the old server runs (a stop comes
    first); in_rotation: the host is in the balancer's rotation (false for a rollback of a server
    that never rejoined, or after a drain that already ran); gpu_gate: the host has one;
    rollback: `spec` is the last good version replacing a failed one."""
    d, steps = spec.drain, []
    what = "the last good version" if rollback else "the new version"
    if d is not None and running and in_rotation:
        steps += [RestartStep(StepKind.LEAVE, d.leave.describe(), d.leave.timeout),
                  RestartStep(StepKind.DRAIN, _drain_detail(d), d.timeout)]
    if running:
        steps.append(RestartStep(StepKind.STOP, f"systemctl stop {spec.name}.service"))
    if gpu_gate:
        steps.append(RestartStep(StepKind.WAIT_GPUS, "until the service's GPUs hold no process and no memory"))
    h, probe = spec.health, spec.health.http or "systemd's state"
    steps += [RestartStep(StepKind.START, f"systemctl start {spec.name}.service ({what})"),
              RestartStep(StepKind.READY, f"{probe} healthy, then stable for {h.stable_for:g}s", h.startup_timeout)]
    if spec.smoke is not None:
        n = len(spec.smoke.checks)
        ttft = f", first token within {spec.smoke.ttft:g}s" if spec.smoke.ttft is not None else ""
        steps.append(RestartStep(StepKind.SMOKE, f"{n} greedy answer{'s' * (n != 1)} from {spec.smoke.url}{ttft}",
                                 spec.smoke.timeout * n))
    if d is not None:
        steps.append(RestartStep(StepKind.REJOIN, d.rejoin.describe(), d.rejoin.timeout))
        if d.serving is not None:
            steps.append(RestartStep(StepKind.SERVING, f"until {d.serving.describe()} says it is in rotation",
                                     d.timeout))
    return tuple(steps)


def _drain_detail(d: DrainSpec) -> str:
    if d.inflight is None:
        return "wait the drain timeout (no in-flight read declared)"
    what = d.inflight.metric or "the in-flight count"
    return f"wait for {what} at {d.inflight.url} to reach 0, read every {d.interval:g}s"


# ---- the wait for in-flight work ------------------------------------------------------------


def a_preview_may_ask(c: CallSpec | None) -> bool:
    """Whether a dry run may make this `serving` call to count a member of a budget: only a read
    that runs nothing of the revision and changes nothing (issue 39's preview): HAProxy's `show
    stat`, or an HTTP GET made from the host. A `host` line or a `controller` program is the
    revision's code, and another HTTP method may change the router: a real run only."""
    return c is None or c.kind == "haproxy" or (c.kind == "http" and c.method == "GET")


class DrainState(StrEnum):
    """Where a drain's wait stands."""

    WAITING = "waiting"
    DRAINED = "drained"              # in-flight work read 0 twice in a row, or the fixed wait is over
    TIMED_OUT = "timed-out"          # the drain timeout passed with work still in flight (or unread)


class Reading(msgspec.Struct, frozen=True):
    """One in-flight read, `at` seconds after the host left rotation; inflight None: unreadable
    (`error` says why)."""

    at: float
    inflight: float | None
    error: str | None = None


class DrainDecision(msgspec.Struct, frozen=True):
    """What the drain does next: wait `wait` seconds more and read again, or go on to the stop."""

    state: DrainState
    wait: float = 0.0
    message: str = ""


def drain_decision(d: DrainSpec, readings: Sequence[Reading], now: float) -> DrainDecision:
    """The drain's next move, `now` seconds after the host left rotation, given the reads so far.

    Without an in-flight read the drain is a fixed wait of its timeout. With one, it is over when
    the last two reads were 0 (one read may race a request the balancer forwarded just before it
    let go), and at the timeout in any case: the stop then goes ahead, and the message says what
    was still in flight (systemd's stop and the engine's own stop behaviour take it from there).
    """
    if d.inflight is None:
        if now >= d.timeout:
            return DrainDecision(DrainState.DRAINED, message=f"waited {d.timeout:g}s (no in-flight read declared)")
        return DrainDecision(DrainState.WAITING, wait=d.timeout - now)
    last = [r.inflight for r in readings[-2:]]
    if len(last) == 2 and last == [0, 0]:
        return DrainDecision(DrainState.DRAINED, message=f"no work in flight after {readings[-1].at:.1f}s")
    if now >= d.timeout:
        read = next((r for r in reversed(readings) if r.inflight is not None), None)
        if read is None:
            error = next((r.error for r in reversed(readings) if r.error), "no read came back")
            return DrainDecision(DrainState.TIMED_OUT, message=f"in-flight work could not be read within the drain "
                                                               f"timeout ({d.timeout:g}s): {error}")
        return DrainDecision(DrainState.TIMED_OUT, message=f"{read.inflight:g} still in flight after the drain timeout "
                                                           f"({d.timeout:g}s): stopping anyway")
    return DrainDecision(DrainState.WAITING, wait=max(0.0, min(d.interval, d.timeout - now)))


# ---- readings: the engine's metric, HAProxy's stats -----------------------------------------

MAX_SERVERS = 10_000                 # rows of `show stat` read; a balancer's stats past this are not ours


def inflight_of(body: str, metric: str | None) -> float | None:
    """The in-flight count in what the in-flight URL answered: `metric` summed over its label
    sets in Prometheus' text format, or (metric None) the number the body is. None when it is
    not there or not a finite number >= 0 (a read that says nothing, never a crash)."""
    if metric is None:
        return _count(body.strip())
    total, seen = 0.0, False
    for line in body.splitlines():
        if not line.startswith(metric) or line.startswith("#"):
            continue
        rest = line[len(metric):]
        if rest[:1] == "{":
            close = rest.find("}")
            if close < 0:
                continue
            rest = rest[close + 1:]
        elif rest[:1] not in (" ", "\t"):
            continue                 # another metric whose name starts with this one
        words = rest.split()
        value = _count(words[0]) if words else None
        if value is None:
            return None
        total, seen = total + value, True
    return total if seen else None


def _count(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


class ServerStat(msgspec.Struct, frozen=True):
    """One server of HAProxy's `show stat`: its status and current sessions."""

    status: str
    sessions: int | None

    @property
    def serving(self) -> bool:
        """In rotation: UP (or UP and failing a check, 'UP 1/3'), or up without checks ('no check').
        DRAIN, MAINT, DOWN (and 'DOWN 1/2', on its way up) are not."""
        return self.status in ("UP", "no check") or self.status.startswith("UP ")


def parse_show_stat(text: str) -> dict[str, ServerStat]:
    """HAProxy's `show stat` (CSV, its header line starting '# pxname,svname,'), as
    '<backend>/<server>' -> ServerStat; the frontend and backend rows are left out."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    header = lines[0][2:].split(",")
    try:
        px, sv, st, cur = (header.index(k) for k in ("pxname", "svname", "status", "scur"))
    except ValueError:
        return {}
    out: dict[str, ServerStat] = {}
    for line in lines[1:MAX_SERVERS + 1]:
        row = line.split(",")
        if len(row) <= max(px, sv, st, cur) or row[sv] in ("FRONTEND", "BACKEND"):
            continue
        sessions = int(row[cur]) if row[cur].isdigit() and len(row[cur]) < 10 else None
        out[f"{row[px]}/{row[sv]}"] = ServerStat(row[st], sessions)
    return out
