"""PURE: the on-host dead-man's switch of a deploy (what deploy-rs calls magic rollback). What it
does, when it fires and what it leaves on the host: docs/health.md ("The dead-man's switch").

The switch is /var/lib/reconciler/confirm/<service>.sh: reconciler/sh/confirm.sh after a header
of its named parameters (the service, the previous version's files, the record it writes) and
constants (`arm`), so the host runs no shell composed here. Its transient timer and service are
made by one `systemd-run --on-active` (no unit file is written, so arming it needs no
daemon-reload, and an env-only deploy needs none at all), and only as the controller goes: the
run's host lock holder (lock.py, reconciler/sh/holder.sh), as it lets go, runs
reconciler/sh/rearm.sh (`rearm_text`), which arms every switch whose script is still there; the
same script runs at boot (`REARM_UNIT_TEXT`). After a verdict there is none left, so a confirmed
deploy costs no systemd-run and no stop (two systemd clients, about 40 ms of the host's CPU).
The switch's service takes the host lock (rearm.sh's flock) before it runs the script.
"""

from __future__ import annotations

import base64

import msgspec

from .. import shell
from ..reasons import Reason
from . import layout
from .layout import CONFIRM_DIR, KEPT, REARM_SCRIPT, WANTS
from .records import Quarantine, ServiceRecord

__all__ = ["CONFIRM_DIR", "KEPT", "REARM_SCRIPT"]


def unit_name(service: str) -> str:
    """The name of a service's switch units (.timer, .service): layout.SWITCH-<service>."""
    return f"{layout.SWITCH}-{service}"


def script_path(service: str) -> str:
    return f"{CONFIRM_DIR}/{service}.sh"


# The script that arms pending switches (at boot, and as a holder lets go), installed once per
# host by the first deploy that arms one (apply.sh's arm_timer), and the unit that runs it at boot.
REARM_CONSTANTS = {"CONFIRM": CONFIRM_DIR, "LOCK": layout.LOCK, "SWITCH": layout.SWITCH}


def rearm_text() -> str:
    """reconciler/sh/rearm.sh as it is installed, its constants in front."""
    return shell.with_constants(shell.program("rearm"), REARM_CONSTANTS)


REARM_UNIT_TEXT = (f"[Unit]\nDescription=reconciler: arm again the dead-man's switches a reboot cut short\n\n"
                   f"[Service]\nType=oneshot\nExecStart=/bin/sh {REARM_SCRIPT}\n\n"
                   f"[Install]\nWantedBy=multi-user.target\n")
# What confirm.sh shares with the Python side
SWITCH_CONSTANTS = {"STATE": layout.STATE_DIR, "UNIT_DIR": layout.UNIT_DIR, "ENV_DIR": layout.ENV_DIR,
                    "ENV_DROPIN": layout.ENV_DROPIN, "SECRETS_DROPIN_NAME": layout.SECRETS_DROPIN,
                    "CREDSTORE": layout.CREDSTORE, "KEPT": KEPT, "COUNT": layout.LOCK_COUNT,
                    "OWNER": layout.LOCK_OWNER, "WANTS": WANTS, "TEMP": layout.TEMP,
                    "SWITCH": layout.SWITCH, "CONFIRM": CONFIRM_DIR}


class Previous(msgspec.Struct, frozen=True):
    """The verified version the switch restores: its files as they are on the host now."""

    revision: str
    unit_text: str
    env_text: str | None              # its env drop-in
    envfile_text: str | None = None   # its env file
    secrets_text: str | None = None   # its secrets drop-in (paths only)
    secrets_replaced: bool = False    # the deploy delivers other secret values: put the kept ones back


class Switch(msgspec.Struct, frozen=True):
    """The texts of one armed switch."""

    service: str
    window: int
    script: str
    restores: str | None         # the revision it puts back (None: it stops the service)


def _b64(text: str | None) -> str:
    """A file's text as the switch's header carries it: base64, "-" for no such file."""
    return base64.b64encode(text.encode()).decode() if text is not None else "-"


def arm(service: str, *, revision: str, new_hash: str, window: int, record: ServiceRecord,
        previous: Previous | None) -> Switch:
    """The switch for deploying `revision` (content `new_hash`) of `service`.

    record: the service's record as the deploy writes it (the base of what the switch records).
    previous: the verified version to restore, or None (the switch then stops the service)."""
    q = Quarantine(hash=new_hash, revision=revision, reason=Reason.NOT_CONFIRMED,
                   quote=f"the controller did not confirm {revision[:7]}: it died or lost the host, and nobody "
                         f"came back within {window}s; --retry or a new commit tries again")
    fired = ServiceRecord(hash=record.last_good_hash if previous else new_hash,
                          revision=previous.revision if previous else revision,
                          last_good_hash=record.last_good_hash, last_good_revision=record.last_good_revision,
                          quarantine=q, adopted=record.adopted, secrets=record.secrets)
    params = {"SERVICE": service, "ACTION": "restore" if previous is not None else "stop",
              "UNIT": _b64(previous.unit_text) if previous else "-",
              "DROPIN": _b64(previous.env_text) if previous else "-",
              "ENVFILE": _b64(previous.envfile_text) if previous else "-",
              "SECRETS_DROPIN": _b64(previous.secrets_text) if previous else "-",
              "RESTORE_SECRETS": "1" if previous is not None and previous.secrets_replaced else "",
              "RECORD": _b64(fired.dumps())}
    # The header: what the switch is, its window (rearm.sh reads the `# window=` line), its
    # parameters; then confirm.sh, its constants in front.
    head = (f"#!/bin/sh\n# reconciler's dead-man's switch for {service}: the controller did not confirm "
            f"{revision[:7]}.\n# window={window}\n{shell.assignments(params)}")
    body = shell.with_constants(shell.program("confirm"), SWITCH_CONSTANTS).split("\n", 1)[1]
    return Switch(service, window, head + body, previous.revision if previous else None)
