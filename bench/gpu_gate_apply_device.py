#!/usr/bin/env python3
"""The whole gated apply path on a real GPU: reconcile_host against a CUDA process (issue 11).

Run ON the GPU machine, from the repository root, as root (python3 with torch and nvidia-smi;
pydantic carried as wheels if it is missing, see --deps):

    python3 bench/gpu_gate_apply_device.py [--gib 20] [--out LOG]

The machine has no systemd and no sshd, so the reconciler runs through its LocalTransport,
with bench/fake_systemctl.py first on PATH as `systemctl` (a stand-in that runs ExecStart= and
answers `show`). Everything else is the product's own code, unchanged: observe, plan (with
the GPU gate: stop, wait-gpus, start), host-side pre-flight (GPU facts, strays on the claimed
GPUs), the apply script, the executor's wait for the GPUs between stop and start, the health
watch over HTTP, and the verdict written to the record. The managed service and the stray are
bench/gpu_hold.py, which really allocates GPU memory and then answers /health.

Scenarios, in order:
  1 first deploy      gated start of v1 (no old process): wait-gpus, start, healthy
  2 change            gated restart of v2: stop v1, wait until its memory is released, start
  3 stray, report     a foreign CUDA process on the GPU: pre-flight blocks before anything stops
  4 stray, kill       same stray, gpu_policy = "kill": killed after the stop, then v3 starts
Prints labelled lines with the figures (detection, wait for release, start to healthy) and
exits 1 if a scenario does not end as expected.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LINES: list[str] = []
T0 = time.monotonic()
PORT = 30123
SERVICE = "gpu-svc"


def say(tag: str, text: str) -> None:
    line = f"[{time.monotonic() - T0:7.2f}s] {tag:<9}{text}"
    LINES.append(line)
    print(line, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--rehearse", action="store_true",
                    help="no GPU: rehearse the flow with the test hosts' stand-in nvidia-smi (FAKE_GPU_HOLD)")
    args = ap.parse_args()
    if args.rehearse:
        os.environ["GPU_HOLD_REHEARSAL"] = "1"
        os.environ["PATH"] = f"{ROOT}/tests/hostpkg:{os.environ['PATH']}"
    bindir = Path(tempfile.mkdtemp(prefix="fake-systemd-bin-"))
    (bindir / "systemctl").write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT}/bench/fake_systemctl.py \"$@\"\n")
    (bindir / "systemctl").chmod(0o755)
    # The dead-man's switch is a transient timer (systemd-run); with no systemd here it is not
    # exercised (nothing would fire it), as the fake systemctl never ran its timer either.
    (bindir / "systemd-run").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "systemd-run").chmod(0o755)
    os.environ["PATH"] = f"{bindir}:{os.environ['PATH']}"
    os.environ["RECONCILER_STATE_DIR"] = tempfile.mkdtemp(prefix="reconciler-state-")
    try:
        ok = asyncio.run(scenarios(args.gib))
    finally:
        subprocess.run(["systemctl", "stop", SERVICE], check=False)
        subprocess.run(["pkill", "-f", "gpu_hold.py --gib"], check=False)
    say("RESULT", "PASS" if ok else "FAIL")
    if args.out:
        Path(args.out).write_text("\n".join(LINES) + "\n")
    return 0 if ok else 1


async def scenarios(gib: float) -> bool:
    from reconciler.desired.spec import DesiredState, HealthSpec, HostSpec, ServiceSpec, SSHSpec
    from reconciler.host.gpu import gpu_facts
    from reconciler.host.transport import LocalTransport
    from reconciler.loop.host_run import Pass, reconcile_host
    from reconciler.loop.options import RunIO, RunOptions
    from reconciler.loop.revision import Revision
    from reconciler.preflight import load_rules

    t = LocalTransport("h200")
    rehearsal = bool(os.environ.get("GPU_HOLD_REHEARSAL"))
    rules = load_rules()
    before = await gpu_facts(t)
    torch = "rehearsal" if os.environ.get("GPU_HOLD_REHEARSAL") else __import__("torch").__version__
    say("setup", f"python {sys.version.split()[0]}, torch {torch}; {before.summary()}")

    def host(tag: str, policy: str = "report") -> HostSpec:
        unit = (f"[Unit]\nDescription=GPU stand-in {tag}\n\n[Service]\nType=simple\n"
                f"ExecStart={sys.executable} {ROOT}/bench/gpu_hold.py --gib {gib} --port {PORT} --tag {tag}\n")
        env = {"VERSION": tag, **({"FAKE_GPU_HOLD": "0"} if rehearsal else {})}
        svc = ServiceSpec(name=SERVICE, unit_text=unit, env=env, gpu_policy=policy,
                          health=HealthSpec(http=f"http://127.0.0.1:{PORT}/health", startup_timeout=180,
                                            interval=0.25, stable_for=2))
        return HostSpec("h200", SSHSpec("127.0.0.1"), {SERVICE: svc})

    async def deploy(step: str, tag: str, policy: str = "report"):  # type: ignore[no-untyped-def]
        started = time.monotonic()
        spec = host(tag, policy)
        rev = Revision(DesiredState(tag.ljust(40, "0"), {spec.name: spec}), rules=lambda: rules)
        r = await reconcile_host(spec, rev, RunOptions(), RunIO(), Pass(t))
        wall = time.monotonic() - started
        plan = [a.describe() for a in (r.plan.actions if r.plan else ()) if a.kind.value in
                ("stop", "wait-gpus", "start", "restart")]
        say(step, f"{r.status}{' ' + str(r.reason) if r.reason else ''} in {wall:.2f}s; plan: {'; '.join(plan)}")
        for n in r.notes:
            if "GPU" in n or "stray" in n:
                say("", f"note: {n}")
        for e in r.events:
            if e.outcome is not None:
                say("", f"{e.action} {e.revision[:7]}: {e.outcome.reason}, {e.outcome.message}")
        if r.message:
            say("", f"message: {r.message[:400]}")
        return r, wall

    def main_pid() -> int:
        st = json.loads(Path(f"/run/fake-systemd/{SERVICE}.service.json").read_text())
        return int(st.get("pid", 0))

    ok = True
    r, _ = await deploy("1 first", "v1")
    ok &= str(r.status) == "converged"
    pid1 = main_pid()
    say("", f"v1 runs as pid {pid1}; {(await gpu_facts(t)).summary()}")

    r, _ = await deploy("2 change", "v2")
    ok &= str(r.status) == "converged" and main_pid() != pid1
    pid2 = main_pid()

    stray = subprocess.Popen([sys.executable, f"{ROOT}/bench/gpu_hold.py", "--gib", "4", "--tag", "stray"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, **({"FAKE_GPU_HOLD": "0"} if rehearsal else {})})
    say("stray", f"pid {stray.pid}: {stray.stdout.readline().strip() if stray.stdout else ''}")
    seen = time.monotonic()
    r, wall = await deploy("3 report", "v3")
    ok &= str(r.status) == "failed" and r.reason == "GpuBusy" and main_pid() == pid2 and stray.poll() is None
    say("", f"detected before anything stopped: v2 still pid {main_pid()} (was {pid2}); "
            f"stray alive: {stray.poll() is None}; pre-flight run {wall:.2f}s after the stray was up "
            f"{time.monotonic() - seen:.2f}s ago")

    r, _ = await deploy("4 kill", "v3", policy="kill")
    await asyncio.sleep(0.5)
    ok &= str(r.status) == "converged" and stray.poll() is not None and main_pid() not in (0, pid2)
    say("", f"stray exit status {stray.poll()}; v3 runs as pid {main_pid()}; {(await gpu_facts(t)).summary()}")
    if stray.poll() is None:
        os.killpg(stray.pid, signal.SIGKILL)
    return ok


if __name__ == "__main__":
    sys.exit(main())
