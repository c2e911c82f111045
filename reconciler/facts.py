"""What we read from a host: one batched shell command, and a pure parser of its output.

Like pyinfra's facts: `observe_command(names)` builds the command, `parse_observation(out)`
turns its output into `HostFacts`. One SSH round trip reads, for every desired or inventoried
service, the unit file, the reconciler's env drop-in, `systemctl show` properties and the
reconciler's own record on the host (/var/lib/reconciler).
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import shlex
from dataclasses import dataclass, field

from .errors import ObserveError

UNIT_DIR = "/etc/systemd/system"
STATE_DIR = "/var/lib/reconciler"
ENV_DROPIN = "50-reconciler-env.conf"
SHOW_PROPS = ("Id,LoadState,ActiveState,SubState,Result,NRestarts,ExecMainCode,ExecMainStatus,"
              "ExecMainPID,InvocationID,NeedDaemonReload,FragmentPath,DropInPaths,UnitFileState,"
              "ActiveEnterTimestampMonotonic")


def unit_path(service: str) -> str:
    return f"{UNIT_DIR}/{service}.service"


def env_path(service: str) -> str:
    return f"{UNIT_DIR}/{service}.service.d/{ENV_DROPIN}"


def record_path(service: str) -> str:
    return f"{STATE_DIR}/services/{service}.json"


HOST_RECORD = f"{STATE_DIR}/host.json"


@dataclass(frozen=True)
class ServiceFacts:
    """One service as found on the host. Files are None when absent."""

    name: str
    unit_text: str | None = None
    env_text: str | None = None
    record: dict | None = None            # the reconciler's record: present = in the inventory
    props: dict[str, str] = field(default_factory=dict)

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


@dataclass(frozen=True)
class HostFacts:
    """Everything observed on one host in one round trip."""

    services: dict[str, ServiceFacts]
    record: dict | None = None            # /var/lib/reconciler/host.json

    @property
    def inventory(self) -> set[str]:
        return {n for n, s in self.services.items() if s.managed}


_SCRIPT = r"""
T=%(token)s
D=%(state)s
b64() { if [ -f "$3" ]; then printf '%%s %%s %%s ' "$T" "$1" "$2"; base64 -w0 < "$3"; echo; else printf '%%s %%s %%s -\n' "$T" "$1" "$2"; fi; }
names=" $* "
for f in "$D"/services/*.json; do
  [ -e "$f" ] || continue
  n=${f##*/}; n=${n%%.json}
  case "$names" in *" $n "*) ;; *) names="$names$n ";; esac
done
b64 H - "$D/host.json"
units=""
for n in $names; do
  u=%(unit_dir)s/$n.service
  b64 R "$n" "$D/services/$n.json"
  b64 U "$n" "$u"
  b64 E "$n" "$u.d/%(dropin)s"
  units="$units $n.service"
done
if [ -n "$units" ]; then
  printf '%%s S - ' "$T"; systemctl show -p %(props)s $units | base64 -w0; echo
fi
printf '%%s END\n' "$T"
"""


def observe_command(desired: list[str], token: str | None = None) -> tuple[str, str]:
    """The shell command that reads everything about these services (and the inventory).

    Returns (command, token); the token frames the output so no file content can forge it.
    """
    token = token or secrets.token_hex(8)
    script = _SCRIPT % {"token": token, "state": STATE_DIR, "unit_dir": UNIT_DIR,
                        "dropin": ENV_DROPIN, "props": SHOW_PROPS}
    args = " ".join(shlex.quote(n) for n in sorted(desired))
    return f"sh -c {shlex.quote(script)} reconciler-observe {args}", token


def parse_show(text: str) -> dict[str, dict[str, str]]:
    """`systemctl show` output for one or more units -> {unit Id: {Key: value}}.

    Blocks are separated by blank lines; values are looked up by key; missing keys are fine.
    """
    out: dict[str, dict[str, str]] = {}
    for block in text.split("\n\n"):
        props: dict[str, str] = {}
        for line in block.splitlines():
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


def _json(text: str | None, what: str) -> dict | None:
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # A corrupt record is treated as present but empty: the service stays in the inventory.
        return {"corrupt": True, "what": what}
    return data if isinstance(data, dict) else {"corrupt": True, "what": what}


def parse_observation(stdout: str, token: str, host: str = "?") -> HostFacts:
    """Parse the output of `observe_command` into HostFacts (pure)."""
    files: dict[str, dict[str, str | None]] = {}
    host_record: dict | None = None
    show: dict[str, dict[str, str]] = {}
    ended = False
    for line in stdout.splitlines():
        parts = line.split(" ")
        if len(parts) < 2 or parts[0] != token:
            continue
        if parts[1] == "END":
            ended = True
            continue
        if len(parts) != 4:
            raise ObserveError(host, f"malformed observation line: {line[:80]!r}")
        _, kind, name, payload = parts
        try:
            text = _decode(payload)
        except ObserveError:
            raise ObserveError(host, "malformed observation output (bad base64)") from None
        if kind == "H":
            host_record = _json(text, "host.json")
        elif kind == "S":
            show = parse_show(text or "")
        elif kind in ("R", "U", "E"):
            files.setdefault(name, {})[kind] = text
    if not ended:
        raise ObserveError(host, "observation output ended early (is this a systemd host with a POSIX shell?)")
    services = {
        name: ServiceFacts(
            name=name,
            unit_text=f.get("U"),
            env_text=f.get("E"),
            record=_json(f.get("R"), f"services/{name}.json"),
            props=show.get(f"{name}.service", {}),
        )
        for name, f in files.items()
    }
    return HostFacts(services=services, record=host_record)
