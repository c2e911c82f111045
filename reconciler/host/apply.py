"""The executor: the only code that changes a host. Runs a HostPlan over a Transport.

A plan goes to the host as one shell script (one round trip); a plan with a GPU gate goes as
two, with the wait for the GPUs between them. Each step reports its own result:

  * files and records (intent, adopt, write, remove, restore, daemon-reload, record) are fatal
    when they fail: the script stops there and `CommandError` names the step. The durable intent
    was written first, so the next run re-plans from what is really on the host;
  * systemctl steps (stop, disable, enable, start, restart) never stop the script: each reports
    ok or its exit status and message, and a start or restart that fails is judged like any
    other health failure (reason StartFailed) by the caller. A start or restart waits for its
    job only briefly (JOB_WAIT for all of them): a server with Type=notify may take many minutes
    to report ready, or long to stop, and the health watch, not this script, waits for that; a
    job that ran and failed is the watch's to judge too. The script's last command reads
    systemd's state of what it started: the watch's first reading (Applied.shown).

Safety:
  * every file is written atomically: a temp file in the same directory whose name systemd
    never loads (`.reconciler-tmp.<script PID>.<n>`), fsync, rename, fsync of the directory;
    the clean-up on exit removes only this script's own temp files. Consecutive file steps go
    as one batch: every temp written by the shell's printf (no process), one fsync of them all,
    a rename each, one fsync of their directories (2 + N processes for N files); the intents
    are a batch of their own, durable before any file they announce is replaced;
  * the record of a service says `pending` (what is deployed, what it replaces) before any of
    its files is replaced; one daemon-reload per host; restart only what the plan says;
  * a drop-in someone else wrote is moved to /var/lib/reconciler/removed/, never just deleted;
    an adopted unit's originals are copied to /var/lib/reconciler/adopted/ before the takeover.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from .. import faults
from ..errors import CommandError
from ..plan.gpuhealth import FAULT_FILE, GpuFault
from ..plan.model import ORDER, Action, HostPlan, Kind
from ..plan.records import ServiceRecord
from . import programs
from .script import CONTROLLER, RECORD_MODE, ApplyScript, call, record_calls
from .transport import Transport


@dataclass(frozen=True)
class StepFailure:
    """A systemctl step that failed (the script went on)."""

    action: Action
    exit_status: int
    message: str


@dataclass
class Applied:
    """What running (part of) a plan did: the host's clock when it began, and failed steps."""

    host_clock: float | None = None
    failures: list[StepFailure] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)    # service -> why its start was skipped
    # systemd's reading of the started units at the script's end (unit -> WATCH_PROPS), and
    # when it came back (time.monotonic()): the health watch's first reading
    shown: dict[str, dict[str, str]] = field(default_factory=dict)
    shown_at: float = 0.0

    def failed(self, service: str) -> StepFailure | None:
        """The failed start or restart of a service, if any."""
        return next((f for f in self.failures if f.action.service == service
                     and f.action.kind in (Kind.START, Kind.RESTART)), None)


async def _run(t: Transport, plan: HostPlan, actions: Sequence[Action], now: int, timeout: float,
               out: Applied) -> None:
    if not any(a.kind not in CONTROLLER for a in actions):
        return
    answer, res = await programs.run_with_status(t, ApplyScript.of(plan, actions, now), timeout=timeout, what="apply")
    if answer.shown is not None:
        out.shown, out.shown_at = answer.shown, time.monotonic()
    if out.host_clock is None:
        out.host_clock = answer.clock
    out.failures.extend(StepFailure(plan.actions[f.step], f.status, f.message) for f in answer.failures)
    if (fatal := answer.fatal) is not None:
        raise CommandError(t.host, plan.actions[fatal.step].describe(), fatal.status, fatal.message)
    if not res.ok:
        raise CommandError(t.host, "apply", res.exit_status, res.stderr)


# Waits until a service's GPUs are free: None when they are, else why they are not.
GpuWait = Callable[[str], Awaitable[str | None]]


async def apply_plan(t: Transport, plan: HostPlan, *, now: int, gpu_wait: GpuWait | None = None,
                     timeout: float = 120.0) -> Applied:
    """Run a plan's host steps. With WAIT_GPUS steps, the script runs in two parts and `gpu_wait`
    runs between them; a service whose GPUs stay busy is not started (nor recorded as started).

    Raises CommandError when a file or record step fails (the script stops there).
    """
    out = Applied()
    if faults.armed("mid-apply"):
        first_write = next((i for i, a in enumerate(plan.actions) if a.kind is Kind.WRITE), None)
        if first_write is not None:
            await _run(t, plan, plan.actions[:first_write + 1], now, timeout, out)
            faults.hit("mid-apply")
    waits = [a for a in plan.actions if a.kind is Kind.WAIT_GPUS and a.service]
    if not waits or gpu_wait is None:
        await _run(t, plan, plan.actions, now, timeout, out)
        return out
    cut = ORDER[Kind.WAIT_GPUS]
    await _run(t, plan, [a for a in plan.actions if ORDER[a.kind] < cut], now, timeout, out)
    for a in waits:
        assert a.service is not None
        why = await gpu_wait(a.service)
        if why is not None:
            out.skipped[a.service] = why
    later = [a for a in plan.actions if ORDER[a.kind] > cut
             and not (a.service in out.skipped and a.kind in (Kind.START, Kind.RECORD, Kind.ENABLE, Kind.ARM_TIMER))]
    await _run(t, plan, later, now, timeout, out)
    return out


async def _calls(t: Transport, calls: tuple[str, ...], steps: int, what: str, timeout: float) -> None:
    """A few of apply.sh's calls by themselves (a verdict, a GPU fault), numbering `steps`
    steps: CommandError when a file step failed, or the script did not end."""
    answer, res = await programs.run_with_status(t, ApplyScript(calls, steps), timeout=timeout, what=what)
    if answer.fatal is not None or not res.ok:
        raise CommandError(t.host, what, res.exit_status, answer.fatal.message if answer.fatal else res.stderr)


async def write_record(t: Transport, name: str, rec: ServiceRecord, *, stop: bool = False,
                       disarm: bool = True) -> None:
    """Write one service's record at once, by itself (a verdict); then stop the unit if asked.

    The record comes first: if the connection drops after it, the next run knows the verdict.
    A verdict disarms the deploy's dead-man's switch (confirm.py) right after the record.
    """
    await _calls(t, record_calls(name, rec, stop=stop, disarm=disarm), 2, f"record verdict of {name}", 120)


async def write_gpu_fault(t: Transport, fault: GpuFault | None) -> None:
    """Mark the host GpuFault (gpuhealth.FAULT_FILE, root's alone, written atomically), or clear
    the mark (None): what the planner decided after a GPU reading (gpuhealth.recorded_after,
    start_fault)."""
    write = (call("write_file", step=0, path=FAULT_FILE, mode=RECORD_MODE, text=fault.dumps()) if fault is not None
             else call("remove", step=0, path=FAULT_FILE))
    await _calls(t, (write, "finish"), 1, "record the GPU fault", 60)
