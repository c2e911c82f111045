"""The floor for bench/compare.py: the least a tool can do to converge one service on N hosts.

A bare asyncssh script, run as a process of its own (Python start-up and the asyncssh import
included, as for `reconcile`): all hosts at once, one connection per host, one batched read
(the unit file, the env drop-in and `systemctl show` of the unit), and the minimal fix in one
more command where anything differs: write the files that changed, one daemon-reload, enable a
unit that is not enabled, start or restart it, and read its state in the same command. Health is
systemd's alone with stable_for = 0: active/running once (polled again every 0.1 s until then).
No records, no lock, no pre-flight, no atomic fsync'd writes, no rollback: a floor, not a tool.

    python -m bench.floor SPEC.json     # exit 0 when every host runs the desired files

SPEC: {"key": client key, "known_hosts": file, "service": name,
       "hosts": [{"address": "127.0.0.N", "unit": text, "env": text}, ...]}
optional: "port" (22), "concurrency" (hosts connecting at once; default all), "read_only"
(bench/scale.py: read only, and say in-sync when the unit is active/running).
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time

import asyncssh

SEP = "@@floor@@"
# The same cipher preference as reconciler/transport.py (AES-GCM first: far cheaper per packet
# in asyncssh than its default chacha20-poly1305), so the floor is no slower for want of it.
CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
           "aes256-ctr", "aes192-ctr", "aes128-ctr")


def environment_dropin(env: dict[str, str]) -> str:
    """The env as the floor writes it: a drop-in of Environment= lines (what a hand-written fix
    would do; it takes a daemon-reload per change, where the reconciler's env file takes none)."""
    lines = ["[Service]\n"]
    for key in sorted(env):
        value = env[key].replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
        lines.append(f'Environment="{key}={value}"\n')
    return "".join(lines)


async def converge(h: dict, service: str, key: str, known_hosts: object, port: int = 22,
                   read_only: bool = False) -> str:
    """One host: read, fix what differs, wait for systemd's active/running. Returns what it did."""
    unit_path = f"/etc/systemd/system/{service}.service"
    env_dir = f"{unit_path}.d"
    env_path = f"{env_dir}/50-reconciler-env.conf"
    show = f"systemctl show -p ActiveState,SubState,UnitFileState {service}.service"
    async with asyncssh.connect(h["address"], port=port, username="root", client_keys=[key],
                                known_hosts=known_hosts, config=[], encryption_algs=CIPHERS) as conn:
        read = await conn.run(f"cat {unit_path} 2>/dev/null; echo {SEP}; cat {env_path} 2>/dev/null; "
                              f"echo {SEP}; {show}", check=True)
        unit, env, props = str(read.stdout).split(f"{SEP}\n")
        state = dict(line.split("=", 1) for line in props.splitlines() if "=" in line)
        if read_only:
            return "in-sync" if state.get("SubState") == "running" else "not-running"
        steps = []
        if unit != h["unit"]:
            steps.append(f"printf %s {base64.b64encode(h['unit'].encode()).decode()} | base64 -d > {unit_path}")
        if env != h["env"]:
            steps.append(f"mkdir -p {env_dir} && printf %s {base64.b64encode(h['env'].encode()).decode()} "
                         f"| base64 -d > {env_path}")
        changed = bool(steps)
        running = state.get("ActiveState") == "active" and state.get("SubState") == "running"
        if changed:
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
                                  spec.get("read_only", False))

    results = await asyncio.gather(*(one(h) for h in spec["hosts"]), return_exceptions=True)
    bad = [(h["address"], r) for h, r in zip(spec["hosts"], results, strict=True) if isinstance(r, BaseException)]
    for addr, e in bad:
        print(f"{addr}: {type(e).__name__}: {e}", file=sys.stderr)
    done = [r for r in results if isinstance(r, str)]
    print(f"{len(results)} hosts: " + ", ".join(f"{done.count(s)} {s}" for s in sorted(set(done))))
    return 1 if bad else 0


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.exit(asyncio.run(main(json.load(f))))
