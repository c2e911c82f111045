"""What we read from a host: one batched shell command, and a pure parser of its output.

Like pyinfra's facts: `observe_command(names)` builds the command, `parse_observation(out)`
turns its output into `HostFacts`. One SSH round trip reads, for every desired or inventoried
service: the unit file, every drop-in systemd would apply to it (ours and anyone else's, in
/etc, /run and the `system.control` directories), `systemctl show` properties and the
reconciler's own record on the host (/var/lib/reconciler, typed in records.py), and, for the
files that hold secrets (a referenced file, or the reconciler's own credstore), whether each is
there and a keyed hash of its content: never the content. The key is the host's own
(/var/lib/reconciler/secret.key, 0600, made on first use), so the hash of a low-entropy secret
cannot be reversed by whoever reads a record, and it is the same whichever controller asks.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from dataclasses import dataclass, field

from ..errors import ObserveError
from ..shell import ShCommand
from .records import HostRecord, ServiceRecord

UNIT_DIR = "/etc/systemd/system"
STATE_DIR = "/var/lib/reconciler"
ENV_DROPIN = "50-reconciler-env.conf"
SECRETS_DROPIN = "60-reconciler-secrets.conf"
CREDSTORE = f"{STATE_DIR}/credstore"
SHOW_PROPS = ("Id,LoadState,ActiveState,SubState,Result,NRestarts,ExecMainCode,ExecMainStatus,"
              "ExecMainPID,InvocationID,NeedDaemonReload,FragmentPath,DropInPaths,UnitFileState,"
              "ActiveEnterTimestampMonotonic")
# Where a drop-in for <name>.service can live, highest priority first (systemd.unit(5)): the
# `systemctl set-property` directories, runtime (`systemctl edit --runtime`), and the admin's.
DROPIN_DIRS = ("/etc/systemd/system.control", "/run/systemd/system.control", "/run/systemd/transient",
               "/etc/systemd/system", "/run/systemd/system")
ADOPTED_DIR = f"{STATE_DIR}/adopted"


def unit_path(service: str) -> str:
    return f"{UNIT_DIR}/{service}.service"


def env_path(service: str) -> str:
    return f"{UNIT_DIR}/{service}.service.d/{ENV_DROPIN}"


# A service's environment, as the EnvironmentFile= its env drop-in names: systemd reads it at
# every start, so a change of env alone is a write and a restart, with no daemon-reload.
ENV_DIR = "/etc/reconciler/env"


def envfile_path(service: str) -> str:
    return f"{ENV_DIR}/{service}.env"


def secrets_path(service: str) -> str:
    """The drop-in that hands a service its secrets (paths only, never a value)."""
    return f"{UNIT_DIR}/{service}.service.d/{SECRETS_DROPIN}"


def cred_path(service: str, name: str) -> str:
    """Where the reconciler keeps a secret it delivers (root-only file in a root-only directory)."""
    return f"{CREDSTORE}/{service}/{name}"


def cred_env_path(service: str) -> str:
    """The root-only EnvironmentFile= of a service's secrets delivered as environment variables."""
    return f"{CREDSTORE}/{service}.env"


def record_path(service: str) -> str:
    return f"{STATE_DIR}/services/{service}.json"


HOST_RECORD = f"{STATE_DIR}/host.json"
# The host lock (lock.py): its file, who holds it now, and how many times it was taken. Every
# holder counts itself in LOCK_COUNT before it changes anything, and says who it is in
# LOCK_OWNER until it lets go; a look that saw no holder, and a count no other holder has moved
# since, still holds once the lock is taken (fleet.py's survey: no second observation).
LOCK = f"{STATE_DIR}/.lock"
CONFIRM_SUBDIR = "confirm"     # where an armed dead-man's switch keeps its script (confirm.py)
LOCK_OWNER = f"{STATE_DIR}/.lock.owner"
LOCK_COUNT = f"{STATE_DIR}/.lock.count"


# The lock's files and the switches' directory, by their names in STATE_DIR (the observation's $D)
_LOCK_NAMES = {"lock": LOCK.rsplit("/", 1)[1], "owner": LOCK_OWNER.rsplit("/", 1)[1],
               "count": LOCK_COUNT.rsplit("/", 1)[1], "confirm": CONFIRM_SUBDIR}


def count_holder(count: str) -> str:
    """sh that a new holder of the host lock runs first: $g the count as it found it (0 when
    there is none yet), and the file moved on by one. Builtins only, no process. Where the count
    cannot be written (a full disk), the file goes: a look that saw a count never finds it again."""
    return (f"g=0; [ ! -f {count} ] || {{ read -r g < {count} || :; }}; "
            f"case $g in ''|*[!0-9]*) n=1 ;; *) n=$((g + 1)) ;; esac; "
            f"{{ echo $n > {count}; }} 2>/dev/null || rm -f {count}")


def adopted_copy(service: str, path: str) -> str:
    """Where the original of an adopted unit's file is kept."""
    return f"{ADOPTED_DIR}/{service}{path}"


@dataclass(frozen=True)
class ServiceFacts:
    """One service as found on the host. Files are None when absent.

    dropins: every drop-in file systemd would apply to the service (path -> content), ours
    included; the planner tells ours from anyone else's.
    """

    name: str
    unit_text: str | None = None
    env_text: str | None = None           # our env drop-in (it names the env file)
    record: ServiceRecord | None = None   # the reconciler's record: present = in the inventory
    props: dict[str, str] = field(default_factory=dict)
    dropins: dict[str, str] = field(default_factory=dict)
    envfile_text: str | None = None       # the env file (envfile_path)

    @property
    def managed(self) -> bool:
        """True when the reconciler installed this service (it is in the host's inventory)."""
        return self.record is not None

    @property
    def active_state(self) -> str:
        return self.props.get("ActiveState", "")

    @property
    def running(self) -> bool:
        """Started (or being started/restarted by systemd): stopping it is a restart, not a start."""
        return self.active_state in ("active", "activating", "reloading", "refreshing")

    @property
    def enabled(self) -> bool:
        return self.props.get("UnitFileState") in ("enabled", "enabled-runtime")

    def foreign_path(self) -> str | None:
        """Where a unit of this name lives that the reconciler did not install, or None.

        A unit file at our path without a record, a loaded unit from elsewhere (a package's
        /lib/systemd/system/NAME.service, which our file would shadow), or a masked unit.
        """
        if self.managed:
            return None
        if self.unit_text is not None:
            return unit_path(self.name)
        load = self.props.get("LoadState", "")
        fragment = self.props.get("FragmentPath", "")
        if load == "masked":
            return fragment or unit_path(self.name)
        if load in ("loaded", "bad-setting", "error") and fragment and fragment != unit_path(self.name):
            return fragment
        return None


@dataclass(frozen=True)
class HostFacts:
    """Everything observed on one host in one round trip."""

    services: dict[str, ServiceFacts]
    record: HostRecord | None = None      # /var/lib/reconciler/host.json
    # Files that hold secrets: path -> keyed hash of the content, None when absent (never a value)
    secret_files: dict[str, str | None] = field(default_factory=dict)
    # How many times the host lock had been taken, when nobody held it as this was read (else None)
    lock_count: str | None = None
    # Temp files (`.reconciler-tmp.*`) in the directories the reconciler writes: what a run that was
    # killed mid-write left (a run's own are gone when its script ends, by its clean-up)
    stale_temps: tuple[str, ...] = ()

    @property
    def inventory(self) -> set[str]:
        return {n for n, s in self.services.items() if s.managed}


_SCRIPT = r"""
T=%(token)s
D=%(state)s
# The lock's count: 0 where the lock was never taken, - where it cannot be trusted: a holder
# has the lock (its owner file says who), an armed dead-man's switch may fire at any moment, or
# the lock was taken but its count is gone (a holder could not write it).
g=-
if [ -f "$D/%(count)s" ]; then read -r g < "$D/%(count)s" || :; elif [ ! -e "$D/%(lock)s" ]; then g=0; fi
[ ! -s "$D/%(owner)s" ] || g=-
for f in "$D"/%(confirm)s/*.sh; do [ ! -e "$f" ] || g=-; done
printf '%%s G %%s\n' "$T" "${g:--}"
for f in %(unit_dir)s/.reconciler-tmp.* %(unit_dir)s/*.service.d/.reconciler-tmp.* %(env_dir)s/.reconciler-tmp.* \
         "$D"/.reconciler-tmp.* "$D"/*/.reconciler-tmp.* "$D"/credstore/*/.reconciler-tmp.*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  printf '%%s T %%s\n' "$T" "$(printf '%%s' "$f" | base64 -w0)"
done
names=" "
while [ $# -gt 0 ]; do [ "$1" = -- ] && { shift; break; }; names="$names$1 "; shift; done
if [ $# -gt 0 ]; then
  # files that hold secrets ("$@"): a keyed hash of each, never the content
  K="$D/secret.key"
  if [ ! -s "$K" ]; then
    mkdir -p "$D" && chmod 0700 "$D" && (umask 077; head -c 32 /dev/urandom | base64 > "$K.tmp" && mv -f "$K.tmp" "$K")
  fi
  for f in "$@"; do
    h=-; [ -f "$f" ] && h=$(cat "$K" "$f" | sha256sum | cut -c1-32)
    printf '%%s K %%s %%s\n' "$T" "$(printf '%%s' "$f" | base64 -w0)" "$h"
  done
fi
emit() {  # kind name path: each line of the file after "$T kind name L ", a last line without its
  # newline as P, then F; or "-" when there is no such file. Builtins only: no process per file.
  if [ -f "$3" ]; then
    l=
    while IFS= read -r l; do printf '%%s %%s %%s L %%s\n' "$T" "$1" "$2" "$l"; done < "$3"
    [ -z "$l" ] || printf '%%s %%s %%s P %%s\n' "$T" "$1" "$2" "$l"
    printf '%%s %%s %%s F\n' "$T" "$1" "$2"
  else printf '%%s %%s %%s -\n' "$T" "$1" "$2"; fi
}
NL='
'

for f in "$D"/services/*.json; do
  [ -e "$f" ] || continue
  n=${f##*/}; n=${n%%.json}
  case "$names" in *" $n "*) ;; *) names="$names$n ";; esac
done
emit H - "$D/host.json"
units=""
for n in $names; do
  u=%(unit_dir)s/$n.service
  emit R "$n" "$D/services/$n.json"
  emit U "$n" "$u"
  emit E "$n" "$u.d/%(dropin)s"
  emit V "$n" "%(env_dir)s/$n.env"
  for d in %(dropin_dirs)s; do
    for f in "$d/$n.service.d/"*.conf; do
      [ -f "$f" ] || continue
      case "$f" in
        *"$NL"*) printf '%%s D %%s B %%s\n' "$T" "$n" "$(printf '%%s' "$f" | base64 -w0)" ;;
        *) printf '%%s D %%s N %%s\n' "$T" "$n" "$f" ;;
      esac
      emit D "$n" "$f"
    done
  done
  units="$units $n.service"
done
if [ -n "$units" ]; then
  # last, and as it is (no base64 process): everything up to the END line is systemctl's
  printf '%%s S -\n' "$T"; systemctl show -p %(props)s $units; echo
fi
printf '%%s END\n' "$T"
"""


def observe_command(desired: list[str], token: str | None = None,
                    secret_files: list[str] | None = None) -> tuple[ShCommand, str]:
    """The shell command that reads everything about these services (and the inventory), and
    the keyed hash of each file in `secret_files`.

    Returns (command, token); the token frames the output so no file content can forge it.
    """
    token = token or secrets.token_hex(8)
    script = _SCRIPT % {"token": token, "state": STATE_DIR, **_LOCK_NAMES, "unit_dir": UNIT_DIR,
                        "env_dir": ENV_DIR, "dropin": ENV_DROPIN, "props": SHOW_PROPS,
                        "dropin_dirs": " ".join(DROPIN_DIRS)}
    args = sorted(desired)
    if secret_files:
        args += ["--", *sorted(set(secret_files))]
    return ShCommand(script, "reconciler-observe", args), token


def parse_show(text: str) -> dict[str, dict[str, str]]:
    """`systemctl show` output for one or more units -> {unit Id: {Key: value}}.

    Blocks are separated by blank lines; values are looked up by key; missing keys are fine.
    """
    out: dict[str, dict[str, str]] = {}
    for block in text.split("\n\n"):
        props: dict[str, str] = {}
        for line in block.split("\n"):   # not splitlines(): a value may hold \u2028 or \x1c
            key, sep, value = line.partition("=")
            if sep:
                props[key] = value
        if props.get("Id"):
            out[props["Id"]] = props
    return out


def _decode(field_: str) -> str | None:
    if field_ == "-":
        return None
    try:
        return base64.b64decode(field_, validate=True).decode("utf-8", errors="replace")
    except (binascii.Error, ValueError):
        raise ObserveError("?", "malformed observation output (bad base64)") from None


def parse_observation(stdout: str, token: str, host: str = "?") -> HostFacts:
    """Parse the output of `observe_command` into HostFacts (pure).

    A record that is not valid JSON is read as a corrupt record: the service stays in the
    inventory (so it is never mistaken for a foreign unit), and nothing in it is trusted.
    """
    files: dict[str, dict[str, str | None]] = {}
    dropins: dict[str, dict[str, str]] = {}
    host_record: HostRecord | None = None
    show: dict[str, dict[str, str]] = {}
    secret_files: dict[str, str | None] = {}
    lock_count: str | None = None
    temps: list[str] = []
    ended = False
    # `systemctl show` comes last, unencoded, between the "S -" line and the END line (the
    # token, random per observation, cannot occur in it).
    head, mark, rest = stdout.partition(f"{token} S -\n")
    if mark:
        shown, end, _ = rest.rpartition(f"\n{token} END\n")
        if not end:
            raise ObserveError(host, "observation output ended early (is this a systemd host with a POSIX shell?)")
        show = parse_show(shown)
        stdout = head + f"{token} END\n"
    lines: dict[tuple[str, str], list[str]] = {}
    dropin_path: dict[str, str | None] = {}
    for line in stdout.split("\n"):   # not splitlines(): a file's line may hold \r, \x0c or \u2028
        parts = line.split(" ", 4)
        if len(parts) < 2 or parts[0] != token:
            continue
        kind = parts[1]
        if kind == "END":
            ended = True
            continue
        if kind == "G" and len(parts) == 3:
            lock_count = parts[2] if parts[2].isdigit() else None
            continue
        if kind == "T" and len(parts) == 3:
            temp = _decode(parts[2])
            if temp:
                temps.append(temp)
            continue
        if kind == "K" and len(parts) == 4:
            path = _decode(parts[2])
            if path:
                secret_files[path] = None if parts[3] == "-" else parts[3]
            continue
        if len(parts) < 4 or kind not in ("H", "R", "U", "E", "V", "D"):
            raise ObserveError(host, f"malformed observation line: {line[:80]!r}")
        name, op, rest = parts[2], parts[3], parts[4] if len(parts) == 5 else ""
        if op == "L":
            lines.setdefault((kind, name), []).append(rest + "\n")
            continue
        if op == "P":
            lines.setdefault((kind, name), []).append(rest)
            continue
        if kind == "D" and op in ("N", "B"):
            dropin_path[name] = rest if op == "N" else _decode(rest)
            continue
        if op not in ("F", "-"):
            raise ObserveError(host, f"malformed observation line: {line[:80]!r}")
        text = "".join(lines.pop((kind, name), [])) if op == "F" else None
        if kind == "H":
            host_record = HostRecord.parse(text) if text is not None else None
        elif kind == "D":
            path = dropin_path.pop(name, None)
            if path:
                dropins.setdefault(name, {})[path] = text or ""
        else:
            files.setdefault(name, {})[kind] = text
    if not ended:
        raise ObserveError(host, "observation output ended early (is this a systemd host with a POSIX shell?)")
    services = {}
    for name, f in files.items():
        rec_text = f.get("R")
        services[name] = ServiceFacts(
            name=name,
            unit_text=f.get("U"),
            env_text=f.get("E"),
            envfile_text=f.get("V"),
            record=ServiceRecord.parse(rec_text) if rec_text is not None else None,
            props=show.get(f"{name}.service", {}),
            dropins=dropins.get(name, {}),
        )
    return HostFacts(services=services, record=host_record, secret_files=secret_files, lock_count=lock_count,
                     stale_temps=tuple(sorted(temps)))
