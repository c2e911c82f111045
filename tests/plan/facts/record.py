"""Capture the host programs' answers on a real test host, as samples for test_samples.py.

    sudo .venv/bin/python -m tests.plan.facts.record          # boots one host, writes samples/

Boots one test host (127.0.0.<RECONCILER_SAMPLES_ADDRESS>, default 239; named smp<N>), puts it
in a state worth reading (a managed stand-in server loading, a unit that crash-loops, a foreign
drop-in, the stand-in nvidia-smi with a stray holder), runs each program there over SSH with a
fixed token, and writes tests/plan/facts/samples/<program>/<case>.json: the program's
parameters, the token, what the host printed, and what the parser read (`expected`, to be looked
at before it is kept). Nothing here is a test: test_samples.py reads the samples back.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any

from reconciler.desired.spec import SSHSpec
from reconciler.frames import Records, batch
from reconciler.host.health import WATCH_PROPS
from reconciler.host.transport import SSHTransport
from reconciler.plan.layout import ENV_DROPIN, HOST_RECORD, ROTATION_DIR, envfile_path, record_path, unit_path
from tests import fleet as fleetlib
from tests.plan.facts.cases import SAMPLES, build, sent, to_data

ADDRESS = int(os.environ.get("RECONCILER_SAMPLES_ADDRESS", "239"))
TOKEN = "5a3c9e0d1f2b4a67"

M_UNIT = ("[Unit]\nDescription=stand-in server\n[Service]\nEnvironmentFile=-{envfile}\n"
          "ExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /models/Qwen3-8B --host {addr} "
          "--port 30000\nRestart=on-failure\n[Install]\nWantedBy=multi-user.target\n")
CRASHY = ("[Service]\nExecStart=/bin/sh -c 'echo \"MTP with the hybrid GDN model needs "
          "--mamba-scheduler-strategy extra_buffer\" >&2; exit 1'\nRestart=always\nRestartSec=1\n")
RECORD = '{"hash": "a6bdef65df3c8775", "revision": "' + "a" * 40 + '", "schema": 2}\n'
# what pull mode reads (host-record): the revision last applied; its last line without a newline
HOST_JSON = '{"applied_at": 1795000000,\n "applied_revision": "' + "b" * 40 + '", "schema": 2}'


def setup_script(address: str) -> str:
    """The host's state: m, a managed stand-in server (its record, env drop-in and env file, a
    foreign drop-in, a leave of rotation no rejoin followed), loading for a few seconds; crashy,
    a unit of someone else's that crash-loops;
    the stand-in nvidia-smi with two GPUs and a stray holder of GPU 0."""
    files = {unit_path("m"): M_UNIT.format(envfile=envfile_path("m"), addr=address),
             f"/etc/systemd/system/m.service.d/{ENV_DROPIN}": f"[Service]\nEnvironmentFile={envfile_path('m')}\n",
             "/etc/systemd/system/m.service.d/10-numa.conf": "[Service]\nNice=5\n",
             envfile_path("m"): 'STANDIN_LOAD_SECONDS="6"\nA="1"\n',
             record_path("m"): RECORD, "/etc/systemd/system/crashy.service": CRASHY,
             f"{ROTATION_DIR}/m.left": '{"revision": "' + "a" * 40 + '", "at": 1795000000}\n',
             "/srv/good.service": "[Service]\nExecStart=/bin/true\n",
             "/srv/bad.service": "[Service]\nExecStart=/bin/true\nBogus=1\n"}
    lines = [f"mkdir -p {shlex.quote(p.rsplit('/', 1)[0])} && printf %s {shlex.quote(t)} > {shlex.quote(p)}"
             for p, t in files.items()]
    return "\n".join([*lines, "systemctl daemon-reload", "systemctl start m.service crashy.service",
                      fleetlib.gpu_host(2), fleetlib.stray("0") + " >/dev/null"]) + "\n"


def cases(invocation: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(program, case, parameters): what each program is asked on the host."""
    return [
        ("observe", "managed-foreign-and-absent", {"services": ["m", "crashy", "gone"], "secret_files": None}),
        ("observe", "secret-files-hashed", {"services": ["m"], "secret_files": ["/etc/hostname", "/etc/nothing"]}),
        ("show", "loading-crashing-and-unknown", {"units": ["m.service", "crashy.service", "gone.service"],
                                                  "props": WATCH_PROPS}),
        ("journal", "a-crash-loop", {"unit": "crashy.service", "since": 0}),
        ("progress", "a-server-loading", {"reads": [[invocation, None]]}),
        ("versions", "standin-and-missing", {"reads": [
            {"service": "m", "executable": "/usr/bin/python3", "module": "sglang"},
            {"service": "gone", "executable": "/opt/none/bin/python3", "module": "vllm"}]}),
        ("model-check", "complete-broken-and-missing", {"paths": ["/models/Qwen3-8B", "/models/Broken-MissingShard",
                                                                  "/models/none"],
                                                        "spaces": ["/models/Qwen3-8B", "/models/none"]}),
        ("verify", "good-and-bad", {"nonce": "0f1e2d3c4b5a6978", "units": {
            "good": ["[Service]\nExecStart=/bin/true\n", None],
            "bad": ["[Service]\nExecStart=/bin/true\nBogus=1\n", "[Service]\nEnvironmentFile=/etc/x.env\n"]}}),
        ("gpu", "standin-smi-a-stray-and-health", {"health_since": 0}),
        ("engine-probe", "not-installed", {"service": "m", "server": "vllm", "interpreter": "/usr/bin/python3",
                                           "args": ["--model", "/models/Qwen3-8B"]}),
        ("signal", "alive", {"action": "alive", "holders": [[1, ""], [999999, ""]]}),
        ("apply", "a-write-and-a-refused-stop", {"calls": [
            "now", "write_file step=0 path=/srv/written.txt mode=0600 'text=a\nb'",
            "stop step=1 unit=gone.service", "finish units=m.service"], "steps": 2}),
        ("fetch", "a-copy-then-a-failure", {"path": "/srv/fetched/model dir", "command":
            "cp -r /models/Qwen3-8B/. . && ls | head -2\necho 'no space left' >&2\nexit 3"}),
        ("fetch", "a-directory-that-cannot-be-made", {"path": "/proc/none/model", "command": "true"}),
        ("install", "two-programs", {"texts": ["#!/bin/sh\necho one\n", "#!/bin/sh\necho two\n"]}),
        ("host-record", "none-yet", {}),
        ("apply", "the-host-record-written", {"calls": [
            "now", f"write_file step=0 path={HOST_RECORD} mode=0600 'text={HOST_JSON}'", "finish"], "steps": 1}),
        ("host-record", "a-record", {}),
        ("apply", "a-file-step-that-fails", {"calls": [
            "now", "stage_file step=0 path=/srv/a.txt mode=0644 text=a", "commit",
            "write_file step=1 path=/proc/none/b.txt mode=0600 text=b", "stop step=2 unit=m.service",
            "finish units=m.service"], "steps": 3}),
    ]


async def record(host: fleetlib.Host, kh: Path) -> list[Path]:
    spec = SSHSpec(host.address, known_hosts=kh.read_text(), known_hosts_file=str(kh))
    t = await SSHTransport.connect(host.name, spec, identity=str(fleetlib.client_key_path()))
    written: list[Path] = []
    try:
        res = await t.run("sh -s", input=setup_script(host.address), check=True, what="setup")
        for _ in range(50):               # m's first invocation, and crashy's first restarts
            res = await t.run("systemctl show -p InvocationID --value m.service; "
                              "systemctl show -p NRestarts --value crashy.service", what="wait")
            inv, restarts = [*res.stdout.split(), "", ""][:2]
            if inv and restarts not in ("", "0"):
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)            # some load progress in m's journal
        for name, case, params in cases(inv):
            program = build(name, params)
            cmd, stdin = batch([program], [TOKEN])
            res = await t.run(cmd, input=stdin, timeout=120, what=name)
            expected = program.parse(Records(res.stdout, TOKEN, "sample", res.stderr))
            path = SAMPLES / name / f"{case}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"program": name, "params": params, "token": TOKEN,
                                        "stdin": sent(program, TOKEN), "stdout": res.stdout,
                                        "stderr": res.stderr, "exit_status": res.exit_status,
                                        "expected": to_data(expected)}, indent=1, ensure_ascii=False) + "\n")
            written.append(path)
    finally:
        await t.close()
    return written


def main() -> None:
    fleetlib.build()
    hosts = fleetlib.up(1, first=ADDRESS, prefix=os.environ.get("RECONCILER_SAMPLES_PREFIX", "smp"))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            kh = fleetlib.write_known_hosts(hosts, Path(tmp) / "known_hosts")
            for p in asyncio.run(record(hosts[0], kh)):
                print(p.relative_to(SAMPLES.parent.parent.parent.parent))
    finally:
        fleetlib.down(hosts)


if __name__ == "__main__":
    main()
