"""The executor: the only code that changes a host. Runs a HostPlan over a Transport.

A plan goes to the host as one shell script (one round trip); a plan with a GPU gate goes as
two, with the gate's steps between them (KILL_STRAYS, WAIT_GPUS: run by the caller's GpuWait).
A gate that stays closed ends the apply there: nothing after it runs, and the next plan says what
follows (a start the GPUs kept from happening is recorded as such). A model fetch (FETCH) runs
before anything else, by itself (`fetch_model`). Each step reports its own result:

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

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from .. import faults
from ..clock import REAL, Clock
from ..errors import CommandError
from ..plan.facts.fetch import FetchCommand
from ..plan.gpuhealth import FAULT_FILE, GpuFault
from ..plan.model import ORDER, Action, HostPlan, Kind
from ..plan.records import ServiceRecord
from . import programs
from .health import Phase
from .script import CONTROLLER, RECORD_MODE, ApplyScript, call, record_calls
from .transport import Transport


class StepFailure(msgspec.Struct, frozen=True):
    """A systemctl step that failed (the script went on)."""

    action: Action
    exit_status: int
    message: str


class Applied(msgspec.Struct):
    """What running (part of) a plan did: the host's clock when it began, and failed steps."""

    host_clock: float | None = None
    failures: list[StepFailure] = msgspec.field(default_factory=list)
    skipped: dict[str, str] = msgspec.field(default_factory=dict)    # service -> why its GPUs stayed busy (the gate)
    # systemd's reading of the started units at the script's end (unit -> WATCH_PROPS), and
    # when it came back (time.monotonic()): the health watch's first reading
    shown: dict[str, dict[str, str]] = msgspec.field(default_factory=dict)
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


# Takes the services the plan stops or restarts out of rotation and waits for their work in
# flight (host/rotation.py, issue 42), before the script that stops them runs. Raises to stop
# the apply there: nothing has changed on the host yet.
DrainHook = Callable[[HostPlan], Awaitable[None]]

# Runs one GPU gate step of the plan (KILL_STRAYS, WAIT_GPUS): None when done (the GPUs are
# free), else why they are not.
GpuWait = Callable[[Action], Awaitable[str | None]]


async def apply_plan(t: Transport, plan: HostPlan, *, now: int, gpu_wait: GpuWait | None = None,
                     timeout: float = 120.0, drain: DrainHook | None = None) -> Applied:
    """Run a plan's host steps. With GPU gate steps, the script runs in two parts and `gpu_wait`
    runs each gate step between them; when a service's GPUs stay busy (`skipped`: why), the
    second part does not run at all: the plan is never edited here, the next one says what follows.

    Raises CommandError when a file or record step fails (the script stops there), and what
    `drain` raises (the restart splits at STOP: leave rotation and drain first).
    """
    out = Applied()
    if drain is not None:
        await drain(plan)
    if faults.armed("mid-apply"):
        first_write = next((i for i, a in enumerate(plan.actions) if a.kind is Kind.WRITE), None)
        if first_write is not None:
            await _run(t, plan, plan.actions[:first_write + 1], now, timeout, out)
            faults.hit("mid-apply")
    gate = [a for a in plan.actions if a.kind in (Kind.KILL_STRAYS, Kind.WAIT_GPUS) and a.service]
    if not gate or gpu_wait is None:
        await _run(t, plan, plan.actions, now, timeout, out)
        return out
    await _run(t, plan, [a for a in plan.actions if ORDER[a.kind] < ORDER[Kind.KILL_STRAYS]], now, timeout, out)
    for a in gate:
        assert a.service is not None
        why = await gpu_wait(a)
        if why is not None:
            out.skipped[a.service] = why
    if not out.skipped:
        await _run(t, plan, [a for a in plan.actions if ORDER[a.kind] > ORDER[Kind.WAIT_GPUS]], now, timeout, out)
    return out


async def _calls(t: Transport, calls: tuple[str, ...], steps: int, what: str, timeout: float) -> None:
    """A few of apply.sh's calls by themselves (a verdict, a GPU fault), numbering `steps`
    steps: CommandError when a file step failed, or the script did not end."""
    answer, res = await programs.run_with_status(t, ApplyScript(calls, steps), timeout=timeout, what=what)
    if answer.fatal is not None or not res.ok:
        raise CommandError(t.host, what, res.exit_status, answer.fatal.message if answer.fatal else res.stderr)


async def fetch_model(t: Transport, a: Action, *, clock: Clock = REAL,
                      on_phase: Phase | None = None) -> str | None:
    """Run a FETCH step (the planner decided it may: plan/state.fetch_refused): the model's own
    fetch command in its directory, made first (reconciler/sh/fetch.sh, plan/facts/fetch.py),
    within model.fetch_timeout, telling `on_phase` every second (on `clock`: service, what goes on,
    seconds so far, the limit) while it runs.
    Returns why it failed, or None."""
    model = a.model
    assert a.kind is Kind.FETCH and model is not None and model.fetch
    started = clock.now()

    async def tick() -> None:
        while True:
            if on_phase is not None:
                on_phase(a.service or "", f"fetching {model.id}", clock.now() - started, model.fetch_timeout)
            await clock.sleep(1.0)
    ticker = asyncio.create_task(tick())
    try:
        done, res = await programs.run_with_status(t, FetchCommand(model.path, model.fetch),
                                                   timeout=model.fetch_timeout, what=f"fetch {model.id}")
    except CommandError as e:
        return f"model-fetch: {model.fetch!r} did not finish within {model.fetch_timeout:.0f}s: {e.stderr}"
    finally:
        ticker.cancel()
    if not done.ok:
        status = done.status if done.status is not None else res.exit_status
        return f"model-fetch: {model.fetch!r} failed (exit {status}): {' / '.join(done.tail)}"
    return None


async def write_record(t: Transport, name: str, rec: ServiceRecord, *, stop: bool = False,
                       disarm: bool = True) -> None:
    """Write one service's record at once, by itself (a verdict); then stop the unit if asked.

    The record comes first: if the connection drops after it, the next run knows the verdict.
    A verdict disarms the deploy's dead-man's switch (confirm.py) right after the record.
    """
    await _calls(t, record_calls(name, rec, stop=stop, disarm=disarm), 2, f"record verdict of {name}", 120)


async def write_state_file(t: Transport, path: str, text: str, *, what: str, timeout: float = 30) -> None:
    """One file of the reconciler's own on the host (pull mode's pull.json), written atomically
    by apply.sh's write_file, root's alone (RECORD_MODE): CommandError when it could not be."""
    await _calls(t, (call("write_file", step=0, path=path, mode=RECORD_MODE, text=text), "finish"), 1, what, timeout)


async def remove_state_file(t: Transport, path: str, *, what: str, timeout: float = 30) -> None:
    """One file of the reconciler's own removed from the host (apply.sh's remove; none there is
    nothing to do): CommandError when it could not be."""
    await _calls(t, (call("remove", step=0, path=path), "finish"), 1, what, timeout)


async def write_gpu_fault(t: Transport, fault: GpuFault | None) -> None:
    """Mark the host GpuFault (gpuhealth.FAULT_FILE, root's alone, written atomically), or clear
    the mark (None): what the planner decided after a GPU reading (gpuhealth.recorded_after,
    start_fault)."""
    if fault is not None:
        await write_state_file(t, FAULT_FILE, fault.dumps(), what="record the GPU fault", timeout=60)
    else:
        await remove_state_file(t, FAULT_FILE, what="record the GPU fault", timeout=60)
