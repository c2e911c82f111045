"""The floor for bench/compare.py: the least a tool can do to converge one service on N hosts.

A bare asyncssh script, run as a process of its own (Python start-up and the asyncssh import
included, as for `reconcile`): all hosts at once, one connection per host, one batched read
(the service's files, read by a shell builtin loop with no process per file, and `systemctl show`
of the unit), and the minimal fix in one more command where anything differs: write the files
that changed, one daemon-reload only where a file systemd loads changed (an env file is read at
the start: no reload for it), enable a unit that is not enabled, start or restart it, and read
its state in the same command. The files are the reconciler's own layout (the unit, the env
drop-in that names the env file, the env file), so both end with the same host. Health is
systemd's alone with stable_for = 0: active/running once (polled again every 0.1 s until then).
No records, no lock, no pre-flight, no atomic fsync'd writes, no rollback: a floor, not a tool.

    python -m bench.floor SPEC.json     # exit 0 when every host runs the desired files

SPEC: {"key": client key, "known_hosts": file, "service": name,
       "hosts": [{"address": "127.0.0.N", "files": {path: text, ...}}, ...]}
optional: "port" (22), "concurrency" (hosts connecting at once; default all), "read_only"
(bench/scale.py: read only, and say in-sync when the unit is active/running) with "paths" (the
files to read).
"""

from __future__ import annotations

import asyncio
import base64
import json
import shlex
import sys
import time

import asyncssh

SEP = "@@floor@@"
# The same cipher preference as reconciler/host/transport.py (AES-GCM first: far cheaper per packet
# in asyncssh than its default chacha20-poly1305), so the floor is no slower for want of it.
CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
           "aes256-ctr", "aes192-ctr", "aes128-ctr")
UNIT_DIR = "/etc/systemd/system"      # where a changed file takes a daemon-reload


def read_command(paths: list[str], show: str) -> str:
    """Each file's text (builtins only: no process per file), SEP after each, then `show`."""
    reads = "; ".join(f"r {shlex.quote(p)}; echo {SEP}" for p in paths)
    return (f"r() {{ [ -f \"$1\" ] || return 0; while IFS= read -r l; do printf '%s\\n' \"$l\"; done < \"$1\"; }}; "
            f"{reads}; {show}")


async def converge(h: dict, service: str, key: str, known_hosts: object, port: int = 22,
                   read_only: bool = False, paths: list[str] | None = None) -> str:
    """One host: read, fix what differs, wait for systemd's active/running. Returns what it did.
    `paths`: the files to read where the host names none to write (read_only)."""
    want: dict[str, str] = h.get("files") or {}
    paths = list(want) or list(paths or [])
    show = f"systemctl show -p ActiveState,SubState,UnitFileState {service}.service"
    async with asyncssh.connect(h["address"], port=port, username="root", client_keys=[key],
                                known_hosts=known_hosts, config=[], encryption_algs=CIPHERS) as conn:
        read = await conn.run(read_command(paths, show), check=True)
        *texts, props = str(read.stdout).split(f"{SEP}\n")
        state = dict(line.split("=", 1) for line in props.splitlines() if "=" in line)
        if read_only:
            return "in-sync" if state.get("SubState") == "running" else "not-running"
        changed = [p for p, have in zip(paths, texts, strict=True) if have != want[p]]
        steps = []
        for p in changed:
            d, text = shlex.quote(p.rsplit("/", 1)[0]), base64.b64encode(want[p].encode()).decode()
            steps.append(f"{{ [ -d {d} ] || mkdir -p {d}; }} && printf %s {text} | base64 -d > {shlex.quote(p)}")
        running = state.get("ActiveState") == "active" and state.get("SubState") == "running"
        if any(p.startswith(f"{UNIT_DIR}/") for p in changed):
            steps.append("systemctl daemon-reload")
        if state.get("UnitFileState") != "enabled":
            steps.append(f"systemctl enable --quiet --no-reload {service}.service")
        if changed and running:
            steps.append(f"systemctl restart {service}.service")
        elif not running:
            steps.append(f"systemctl start {service}.service")
        if not steps:
            return "in-sync"
        res = await conn.run(" && ".join(steps) + f" && {show}", check=True)
        deadline = time.monotonic() + 30
        while "ActiveState=active" not in str(res.stdout) or "SubState=running" not in str(res.stdout):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{h['address']}: not running: {res.stdout}")
            await asyncio.sleep(0.1)
            res = await conn.run(show, check=True)
        return "converged"


async def main(spec: dict) -> int:
    known = asyncssh.read_known_hosts(spec["known_hosts"])     # parsed once, not per host
    sem = asyncio.Semaphore(spec.get("concurrency") or max(1, len(spec["hosts"])))

    async def one(h: dict) -> str:
        async with sem:
            return await converge(h, spec["service"], spec["key"], known, spec.get("port", 22),
                                  spec.get("read_only", False), spec.get("paths"))

    results = await asyncio.gather(*(one(h) for h in spec["hosts"]), return_exceptions=True)
    bad = [(h["address"], r) for h, r in zip(spec["hosts"], results, strict=True) if isinstance(r, BaseException)]
    for addr, e in bad:
        said = getattr(e, "stderr", "") or ""
        print(f"{addr}: {type(e).__name__}: {e}" + (f": {str(said).strip()[-500:]}" if said else ""), file=sys.stderr)
    done = [r for r in results if isinstance(r, str)]
    print(f"{len(results)} hosts: " + ", ".join(f"{done.count(s)} {s}" for s in sorted(set(done))))
    return 1 if bad else 0


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.exit(asyncio.run(main(json.load(f))))
