"""PURE: the on-host dead-man's switch of a deploy (what deploy-rs calls magic rollback).

Before a service is (re)started with a new version, the plan arms a timer on the host: unless
the controller confirms the version within the window (start-up timeout + stable_for + margin),
the timer runs a script that puts the previous, verified version back (unit and env), restarts
it, and records the new version as quarantined (reason NotConfirmed); with no verified previous
version it stops the service instead. The controller's verdict, whatever it is, disarms it. A
controller killed or cut off mid-deploy thus leaves the host on its last good version by itself,
and the records say so.

The switch is a script, /var/lib/reconciler/confirm/<service>.sh (0600: it holds the previous
env, which may be secret; systemd runs it with /bin/sh), and a transient timer and service,
reconciler-confirm-<service>.{timer,service}, made by one `systemd-run --on-active` (no unit file
is written, so arming it needs no daemon-reload, and an env-only deploy needs none at all).

The timer is made when the controller goes, not before every start: the run's host lock holder
(lock.py), the process that lives exactly as long as the controller's hold on the host, arms
every switch whose script is still there as it lets go (reconciler/sh/holder.sh): after the verdict that
is none, so a deploy that is confirmed costs no systemd-run and no stop (two systemd clients,
about 40 ms of the host's CPU). A controller killed, cut off or silent for the lock's idle time
ends the holder (EOF, a signal, or its read timing out), and its last act arms the switch, the
window counted from then. A transient timer does not survive a reboot: one static unit,
reconciler-rearm-switches.service (enabled, written once per host by the first deploy that arms
a switch), arms every switch whose script is still there again at boot, so a host that reboots
inside the window still fires it (the window then counts from boot). The holder's last act runs
that same script. The switch's service takes the host lock first (it never interleaves with a
reconcile run) and does nothing when it was disarmed meanwhile; once it runs, it counts itself
and says who holds the lock, as every holder does (lock.py), so a run that looked at the host
before knows to look again.
"""

from __future__ import annotations

import base64
import shlex
from dataclasses import dataclass

from .. import shell
from ..reasons import Reason
from .facts import (
    CONFIRM_SUBDIR,
    CREDSTORE,
    LOCK_COUNT,
    LOCK_OWNER,
    STATE_DIR,
    UNIT_DIR,
    count_holder,
    env_path,
    envfile_path,
    record_path,
    secrets_path,
    unit_path,
)
from .records import Quarantine, ServiceRecord

CONFIRM_DIR = f"{STATE_DIR}/{CONFIRM_SUBDIR}"
WANTS = f"{UNIT_DIR}/timers.target.wants"      # where the switch's timer was linked before it was transient
REARM_UNIT = "reconciler-rearm-switches.service"
REARM_PATH = f"{UNIT_DIR}/{REARM_UNIT}"
REARM_LINK = f"{UNIT_DIR}/multi-user.target.wants/{REARM_UNIT}"
REARM_SCRIPT = f"{STATE_DIR}/rearm-switches.sh"


def unit_name(service: str) -> str:
    return f"reconciler-confirm-{service}"


def script_path(service: str) -> str:
    return f"{CONFIRM_DIR}/{service}.sh"


def paths(service: str) -> tuple[str, str, str]:
    """The switch's script, and the unit files an older reconciler wrote for it (removed with it)."""
    name = unit_name(service)
    return script_path(service), f"{UNIT_DIR}/{name}.service", f"{UNIT_DIR}/{name}.timer"


TRANSIENT = "/run/systemd/transient"     # where systemd keeps a transient unit while it is loaded


def stop_if_armed(service: str) -> str:
    """Shell that queues the stop of a switch's timer and service only where one is loaded (a
    holder armed it as its controller went, or it fired and waits for the lock): a builtin test
    of their transient unit files, no systemctl otherwise. (systemd makes that directory with
    its first transient unit: where there is none, no switch is armed.) Never fails."""
    name = unit_name(service)
    return (f"if [ -e {TRANSIENT}/{name}.timer ] || [ -e {TRANSIENT}/{name}.service ]; "
            f"then systemctl stop --no-block {name}.timer {name}.service >/dev/null 2>&1 || :; fi")


REARM_TEXT = shell.program("rearm")
REARM_UNIT_TEXT = (f"[Unit]\nDescription=reconciler: arm again the dead-man's switches a reboot cut short\n\n"
                   f"[Service]\nType=oneshot\nExecStart=/bin/sh {REARM_SCRIPT}\n\n"
                   f"[Install]\nWantedBy=multi-user.target\n")


@dataclass(frozen=True)
class Previous:
    """The verified version the switch restores: its files as they are on the host now."""

    revision: str
    unit_text: str
    env_text: str | None              # its env drop-in
    envfile_text: str | None = None   # its env file
    secrets_text: str | None = None   # its secrets drop-in (paths only)
    secrets_replaced: bool = False    # the deploy delivers other secret values: put the kept ones back


@dataclass(frozen=True)
class Switch:
    """The texts of one armed switch."""

    service: str
    window: int
    script: str
    restores: str | None         # the revision it puts back (None: it stops the service)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


KEPT = f"{CREDSTORE}/.previous"


def restore_secrets_script(service: str) -> str:
    """Shell that puts back the secrets a deploy replaced (the executor kept them under
    credstore/.previous/ before it delivered the new ones)."""
    cur, env = shlex.quote(f"{CREDSTORE}/{service}"), shlex.quote(f"{CREDSTORE}/{service}.env")
    old, old_env = shlex.quote(f"{KEPT}/{service}"), shlex.quote(f"{KEPT}/{service}.env")
    return (f"rm -rf {cur} {env}; {{ [ ! -e {old} ] || mv {old} {cur}; }}; "
            f"{{ [ ! -e {old_env} ] || mv {old_env} {env}; }}")


def disarm_script(service: str, *, inside: bool = False, wait: bool = True) -> str:
    """Shell that disarms a switch (the timer, a run it may have started, its files). `inside`:
    the switch's own script cleaning up after it fired (it must not stop its own unit).

    wait=False, for a verdict: the script goes, and a timer is stopped (queued, `--no-block`) only
    where one is loaded (stop_if_armed): a verdict's run held the lock throughout, so its holder
    armed none, and the usual verdict runs no systemctl at all. One that a holder of an earlier,
    dead controller armed and that fires meanwhile finds no script and does nothing (it takes the
    host lock first, which the verdict's run holds). The plan's own disarms (of a service held
    stopped or removed, both rare) stop it and wait for the stop, as before."""
    s, unit, timer = paths(service)
    name = unit_name(service)
    if inside:    # its transient timer is gone once it fired; an older reconciler's files go with it
        return f"rm -f {s} {unit} {timer} {WANTS}/{name}.timer; true"
    kept = f"{shlex.quote(f'{KEPT}/{service}')} {shlex.quote(f'{KEPT}/{service}.env')}"
    # One systemctl for both units; the files are an older reconciler's (unit files, enabled).
    stop = f"systemctl stop {name}.timer {name}.service >/dev/null 2>&1" if wait else stop_if_armed(service)
    return f"{stop}; rm -rf {s} {unit} {timer} {WANTS}/{name}.timer {kept}; true"


def arm(service: str, *, revision: str, new_hash: str, window: int, record: ServiceRecord,
        previous: Previous | None) -> Switch:
    """The switch for deploying `revision` (content `new_hash`) of `service`.

    record: the service's record as the deploy writes it (the base of what the switch records).
    previous: the verified version to restore, or None (the switch then stops the service)."""
    q = Quarantine(hash=new_hash, revision=revision, reason=Reason.NOT_CONFIRMED,
                   quote=f"the controller did not confirm {revision[:7]}: it died or lost the host, and nobody "
                         f"came back within {window}s; --retry or a new commit tries again")
    lines = ["#!/bin/sh",
             f"# reconciler's dead-man's switch for {service}: the controller did not confirm {revision[:7]}.",
             f"# window={window}",
             "set -u",
             "# a holder of the host lock: counted, and named, before it changes anything (lock.py)",
             count_holder(LOCK_COUNT),
             f"echo {shlex.quote(f'the dead-man switch of {service} ({unit_name(service)}.service)')} > {LOCK_OWNER}",
             "put() {  # path base64 [mode]",
             '  d=$(dirname "$1"); mkdir -p "$d"; t=$(mktemp "$d/.reconciler-tmp.XXXXXX")',
             '  printf "%s" "$2" | base64 -d > "$t" && chmod "${3:-0644}" "$t" && sync "$t" && mv -f "$t" "$1"',
             "}"]
    u = shlex.quote(f"{service}.service")
    if previous is not None:
        fired = ServiceRecord(hash=record.last_good_hash, revision=previous.revision,
                              last_good_hash=record.last_good_hash, last_good_revision=record.last_good_revision,
                              quarantine=q, adopted=record.adopted, secrets=record.secrets)
        lines.append(f"put {shlex.quote(unit_path(service))} {_b64(previous.unit_text)}")
        if previous.env_text is not None:
            lines.append(f"put {shlex.quote(env_path(service))} {_b64(previous.env_text)}")
        else:
            lines.append(f"rm -f {shlex.quote(env_path(service))}")
        if previous.envfile_text is not None:
            lines.append(f"put {shlex.quote(envfile_path(service))} {_b64(previous.envfile_text)} 0600")
        else:
            lines.append(f"rm -f {shlex.quote(envfile_path(service))}")
        if previous.secrets_text is not None:
            lines.append(f"put {shlex.quote(secrets_path(service))} {_b64(previous.secrets_text)}")
        else:
            lines.append(f"rm -f {shlex.quote(secrets_path(service))}")
        if previous.secrets_replaced:
            lines.append(restore_secrets_script(service))
        lines.append(f"put {shlex.quote(record_path(service))} {_b64(fired.dumps())}")
        lines += ["systemctl daemon-reload", f"systemctl reset-failed {u} 2>/dev/null", f"systemctl restart {u}"]
    else:
        fired = ServiceRecord(hash=new_hash, revision=revision, last_good_hash=record.last_good_hash,
                              last_good_revision=record.last_good_revision, quarantine=q, adopted=record.adopted,
                              secrets=record.secrets)
        lines.append(f"put {shlex.quote(record_path(service))} {_b64(fired.dumps())}")
        lines.append(f"systemctl stop {u}")
    lines += [disarm_script(service, inside=True), f"rm -f {LOCK_OWNER}"]
    script = "\n".join(lines) + "\n"
    return Switch(service, window, script, previous.revision if previous else None)
