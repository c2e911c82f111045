"""The executor: the only code that changes a host. Runs a HostPlan over a Transport.

The whole plan goes to the host as one shell script (one round trip), so a change costs one
SSH exchange more than a no-change run. Each step announces itself on stderr; when the script
stops at a failing step, the error names that step.

Safety:
  * every file is written atomically: a temp file in the same directory whose name systemd
    never loads (`.reconciler-tmp.*`), fsync, rename, fsync of the directory;
  * one daemon-reload per host; restart only what the plan says;
  * the record (revision + inventory) is written last, so a run that fails part-way is
    re-planned from what is really on the host and the next run converges.
"""

from __future__ import annotations

import base64
import json
import shlex
import time

from .errors import CommandError
from .facts import HOST_RECORD, STATE_DIR, record_path
from .plan import Action, HostPlan, Kind
from .transport import Transport

_PRELUDE = r"""set -eu
umask 022
step() { printf '@@step %s\n' "$1" >&2; }
printf '@@now %s\n' "$(date +%s)"
cleanup() { rm -f /etc/systemd/system/.reconciler-tmp.* /etc/systemd/system/*.service.d/.reconciler-tmp.* """ \
    + STATE_DIR + r"""/.reconciler-tmp.* """ + STATE_DIR + r"""/services/.reconciler-tmp.* 2>/dev/null || true; }
trap cleanup EXIT
# A dropped SSH connection (controller killed) ends the script through these, running cleanup:
# writes are atomic, so no unit is ever half-written, and the next run re-plans from the host.
trap 'exit 129' HUP INT TERM PIPE
atomic_write() {  # path mode base64-content
  d=$(dirname "$1"); mkdir -p "$d"
  t=$(mktemp "$d/.reconciler-tmp.XXXXXX")
  printf '%s' "$3" | base64 -d > "$t"
  chmod "$2" "$t"
  sync "$t"
  mv -f "$t" "$1"
  sync "$d"
}
"""


def _write(path: str, content: str, mode: str = "0644") -> str:
    b64 = base64.b64encode(content.encode()).decode()
    return f"atomic_write {shlex.quote(path)} {mode} {b64}"


def _unit(service: str | None) -> str:
    return shlex.quote(f"{service}.service")


def action_script(a: Action) -> str:
    """The shell for one action (paths and names are validated upstream and quoted here)."""
    if a.kind is Kind.WRITE:
        assert a.path is not None and a.content is not None
        return _write(a.path, a.content)
    if a.kind is Kind.REMOVE:
        assert a.path is not None
        d = a.path.rsplit("/", 1)[0]
        rm = f"rm -f {shlex.quote(a.path)}"
        return rm + (f"; rmdir {shlex.quote(d)} 2>/dev/null || true" if d.endswith(".service.d") else "")
    if a.kind is Kind.DAEMON_RELOAD:
        return "systemctl daemon-reload"
    if a.kind is Kind.ENABLE:
        return f"systemctl enable --quiet {_unit(a.service)}"
    if a.kind is Kind.DISABLE:
        return f"systemctl disable --quiet {_unit(a.service)}"
    if a.kind is Kind.STOP:
        return f"systemctl stop {_unit(a.service)}; systemctl reset-failed {_unit(a.service)} 2>/dev/null || true"
    if a.kind is Kind.START:
        return f"systemctl reset-failed {_unit(a.service)} 2>/dev/null || true; systemctl start {_unit(a.service)}"
    if a.kind is Kind.RESTART:
        return f"systemctl restart {_unit(a.service)}"
    raise ValueError(a.kind)


def record_script(plan: HostPlan, applied_at: float) -> str:
    """Write per-service records, drop records of removed services, then the host record."""
    lines = []
    for name, rec in sorted(plan.records.items()):
        lines.append(_write(record_path(name), json.dumps(rec, sort_keys=True) + "\n"))
    for name in plan.dropped_records:
        lines.append(f"rm -f {shlex.quote(record_path(name))}")
    host = {"applied_revision": plan.revision, "applied_at": int(applied_at)}
    lines.append(_write(HOST_RECORD, json.dumps(host, sort_keys=True) + "\n"))
    return "\n".join(lines)


def build_script(plan: HostPlan, applied_at: float) -> str:
    """The whole plan as one script; step N marks the start of plan.actions[N]."""
    parts = [_PRELUDE]
    for i, a in enumerate(plan.actions):
        parts.append(f"step {i}")
        parts.append(record_script(plan, applied_at) if a.kind is Kind.RECORD else action_script(a))
    parts.append("step done")
    return "\n".join(parts) + "\n"


def failed_step(stderr: str) -> tuple[int | None, str]:
    """From the script's stderr: the index of the step that failed and what it printed."""
    idx: int | None = None
    tail: list[str] = []
    for line in stderr.splitlines():
        if line.startswith("@@step "):
            arg = line.split(" ", 1)[1]
            idx = int(arg) if arg.isdigit() else None
            tail = []
        else:
            tail.append(line)
    return idx, "\n".join(tail).strip()


async def apply_plan(t: Transport, plan: HostPlan, *, timeout: float = 120.0) -> float | None:
    """Run the plan on the host; return the host's clock (epoch s) when it began, for the journal.

    Raises CommandError naming the failed action.
    """
    if not plan.actions:
        return None
    script = build_script(plan, time.time())
    res = await t.run("sh -s", input=script, timeout=timeout, what="apply")
    if res.ok:
        for line in res.stdout.splitlines():
            if line.startswith("@@now "):
                return float(line.split()[1])
        return None
    idx, err = failed_step(res.stderr)
    what = plan.actions[idx].describe() if idx is not None and idx < len(plan.actions) else "apply"
    raise CommandError(t.host, what, res.exit_status, err)


async def write_records(t: Transport, records: dict[str, dict]) -> None:
    """Atomically rewrite some per-service records (last good, quarantine) on the host."""
    if not records:
        return
    body = "\n".join(_write(record_path(n), json.dumps(r, sort_keys=True) + "\n") for n, r in sorted(records.items()))
    await t.run("sh -s", input=_PRELUDE + body + "\n", check=True, timeout=60, what="write records")


async def stop_service(t: Transport, name: str) -> None:
    """Stop a failing unit so it stops crash-looping and frees its GPUs."""
    await t.run(action_script(Action(Kind.STOP, "failed health", name)), check=True, timeout=120,
                what=f"stop {name}")
