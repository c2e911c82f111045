"""PURE: the host's file system as the reconciler lays it out: where each file it writes or
reads lives, written once. The programs run on hosts get these as constants in front of their
text (frames.HostProgram.constants), so the shell and the Python side never disagree.

    /etc/systemd/system/NAME.service                  the unit
    /etc/systemd/system/NAME.service.d/50-...env.conf  our env drop-in (names the env file)
    /etc/systemd/system/NAME.service.d/60-...secrets   our secrets drop-in (paths only)
    /etc/reconciler/env/NAME.env                       the env file (root's alone)
    /var/lib/reconciler/                               the state directory (root's alone)
      host.json, services/NAME.json                    the records (plan/records.py)
      gpu-fault.json                                   the host's GPU fault (plan/gpuhealth.py)
      credstore/NAME/, credstore/NAME.env              secrets delivered (values, root's alone)
      adopted/, removed/                               originals of adopted units, drop-ins removed
      confirm/NAME.sh                                  an armed dead-man's switch (plan/confirm.py)
      rotation/NAME.left                               a leave not yet followed by its rejoin (loop/cutover.py)
      .lock, .lock.count, .lock.owner                  the host lock (host/lock.py)
      bin/                                             the lock holder's programs, by content
      secret.key                                       the key of secret files' hashes
"""

from __future__ import annotations

UNIT_DIR = "/etc/systemd/system"
STATE_DIR = "/var/lib/reconciler"
ENV_DROPIN = "50-reconciler-env.conf"
SECRETS_DROPIN = "60-reconciler-secrets.conf"
CREDSTORE = f"{STATE_DIR}/credstore"
# Where a drop-in for <name>.service can live, highest priority first (systemd.unit(5)): the
# `systemctl set-property` directories, runtime (`systemctl edit --runtime`), and the admin's.
DROPIN_DIRS = ("/etc/systemd/system.control", "/run/systemd/system.control", "/run/systemd/transient",
               "/etc/systemd/system", "/run/systemd/system")
ADOPTED_DIR = f"{STATE_DIR}/adopted"
REMOVED_DIR = f"{STATE_DIR}/removed"
# A service's environment, as the EnvironmentFile= its env drop-in names: systemd reads it at
# every start, so a change of env alone is a write and a restart, with no daemon-reload.
ENV_DIR = "/etc/reconciler/env"
HOST_RECORD = f"{STATE_DIR}/host.json"
SECRET_KEY = f"{STATE_DIR}/secret.key"
# The host lock (host/lock.py): its file, who holds it now, and how many times it was taken. Every
# holder counts itself in LOCK_COUNT before it changes anything, and says who it is in
# LOCK_OWNER until it lets go; a look that saw no holder, and a count no other holder has moved
# since, still holds once the lock is taken (fleet.py's survey: no second observation).
LOCK = f"{STATE_DIR}/.lock"
LOCK_OWNER = f"{STATE_DIR}/.lock.owner"
LOCK_COUNT = f"{STATE_DIR}/.lock.count"
# A service out of its balancer's rotation by a run's leave, until its rejoin: NAME.left (root's
# alone) holds the revision and when; a run killed between the two leaves it for the next run.
ROTATION_DIR = f"{STATE_DIR}/rotation"
BIN = f"{STATE_DIR}/bin"                 # the lock holder's programs, by content (root's own directory)
CONFIRM_SUBDIR = "confirm"               # where an armed dead-man's switch keeps its script (confirm.py)
CONFIRM_DIR = f"{STATE_DIR}/{CONFIRM_SUBDIR}"
KEPT = f"{CREDSTORE}/.previous"          # the secrets a deploy replaced, until its verdict (confirm.py)
TEMP = ".reconciler-tmp"                 # the prefix of every temp file the reconciler writes
SWITCH = "reconciler-confirm"            # a dead-man's switch's transient units: SWITCH-<service>.{timer,service}
# The dead-man's switches' unit that arms them again at boot, and its script (confirm.py)
REARM_UNIT = "reconciler-rearm-switches.service"
REARM_PATH = f"{UNIT_DIR}/{REARM_UNIT}"
REARM_LINK = f"{UNIT_DIR}/multi-user.target.wants/{REARM_UNIT}"
REARM_SCRIPT = f"{STATE_DIR}/rearm-switches.sh"
TRANSIENT = "/run/systemd/transient"     # where systemd keeps a transient unit while it is loaded
WANTS = f"{UNIT_DIR}/timers.target.wants"      # where a switch's timer was linked before it was transient


def unit_path(service: str) -> str:
    return f"{UNIT_DIR}/{service}.service"


def dropin_path(service: str, name: str) -> str:
    """A drop-in of <service>.service in the admin's directory."""
    return f"{unit_path(service)}.d/{name}"


def env_path(service: str) -> str:
    return dropin_path(service, ENV_DROPIN)


def envfile_path(service: str) -> str:
    return f"{ENV_DIR}/{service}.env"


def secrets_path(service: str) -> str:
    """The drop-in that hands a service its secrets (paths only, never a value)."""
    return dropin_path(service, SECRETS_DROPIN)


def cred_path(service: str, name: str) -> str:
    """Where the reconciler keeps a secret it delivers (root-only file in a root-only directory)."""
    return f"{CREDSTORE}/{service}/{name}"


def cred_env_path(service: str) -> str:
    """The root-only EnvironmentFile= of a service's secrets delivered as environment variables."""
    return f"{CREDSTORE}/{service}.env"


def record_path(service: str) -> str:
    return f"{STATE_DIR}/services/{service}.json"


def adopted_copy(service: str, path: str) -> str:
    """Where the original of an adopted unit's file is kept."""
    return f"{ADOPTED_DIR}/{service}{path}"
