"""The GPU gate in the apply path, on this machine: a real process stands for the old server,
a fake `nvidia-smi` (a shell script on PATH) reports its memory while it lives, and a local
transport runs the gate's real shell commands (loop/gpu_gate.GpuGate, run by host/apply between
the stop and the start). Apply scripts are recorded, not run (no systemd here); stopping the
service kills the stand-in process."""

from __future__ import annotations

import asyncio
import re
import subprocess

from reconciler.desired.spec import HostSpec, ServiceSpec, SSHSpec
from reconciler.host.apply import apply_plan
from reconciler.host.transport import Completed, LocalTransport
from reconciler.loop.gpu_gate import GpuGate
from reconciler.plan.actions import plan_host
from reconciler.plan.facts import HostFacts, ServiceFacts
from reconciler.plan.facts.gpu import Gpu, GpuFacts
from reconciler.plan.files import render_env_dropin, render_env_file
from reconciler.plan.model import Checks, Context, Kind
from reconciler.plan.records import ServiceRecord
from tests.clock import FakeClock

FAKE_SMI = """#!/bin/sh
pid=$(cat {state})
alive=0; s=$(sed 's/.*) //' /proc/$pid/stat 2>/dev/null | cut -d' ' -f1)   # a zombie holds no GPU
[ -n "$s" ] && [ "$s" != Z ] && alive=1
case "$*" in
  *query-gpu*) if [ $alive = 1 ]; then echo "0, GPU-aaaa, 21090, 143771"; else echo "0, GPU-aaaa, 0, 143771"; fi ;;
  *query-compute-apps*) [ $alive = 1 ] && echo "$pid, $(cat /proc/$pid/comm), 21090, GPU-aaaa" ;;
esac
exit 0
"""


class GpuHost(LocalTransport):
    """Runs the gate's reads for real; records apply scripts; 'systemctl stop' kills the old server."""

    def __init__(self, old: subprocess.Popen, path: str):
        super().__init__("gpuhost")
        self.old, self.path, self.log = old, path, []

    async def run(self, cmd, *, input=None, check=False, timeout=60.0, what="command"):
        if input is not None and cmd == "sh -s":
            self.log.append(("apply", input))
            if STOP.search(input):
                self.old.terminate()
                self.old.wait()               # gone (and the GPU free) once the stop returns
            return Completed(0, "", "")
        self.log.append(("read", cmd[:40]))
        return await super().run(f"export PATH={self.path}:$PATH; {cmd}", input=input, check=check,
                                 timeout=timeout, what=what)


# apply.sh's calls (host/script.py) that stop and start service m
STOP = re.compile(r"^stop step=[0-9]+ unit=m\.service$", re.M)
START = re.compile(r"^start step=[0-9]+ unit=m\.service wait=1\.00$", re.M)


def gpu_host_setup(tmp_path, holder_pid: int, old_pid: int, unit: str, policy: str = "report"):
    """A fake nvidia-smi reporting holder_pid's memory, and a plan restarting service m."""
    (tmp_path / "pid").write_text(str(holder_pid))
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI.format(state=tmp_path / "pid"))
    smi.chmod(0o755)
    host = HostSpec("gpuhost", SSHSpec("127.0.0.2"), {"m": ServiceSpec("m", unit, {"A": "2"}, gpu_policy=policy)})
    facts = HostFacts(services={"m": ServiceFacts(
        "m", unit, render_env_dropin("m"), ServiceRecord(hash="old"),
        {"ActiveState": "active", "ExecMainPID": str(old_pid), "UnitFileState": "enabled"},
        envfile_text=render_env_file({"A": "1"}))})
    gpu = GpuFacts(has_nvidia_smi=True, gpus=[Gpu(0, 21090, 143771, "GPU-aaaa")], holders=[])
    plan = plan_host(host, facts, Context("a" * 40, checks=Checks(gpu_gate=True)))
    return str(smi.parent), host, facts, plan, gpu


def gated(t, plan, facts, gpu, timeout, clock):
    """Apply the plan with the GPU gate waiting on `clock` (virtual: its polls and timeout cost no time)."""
    gate = GpuGate(t, plan, facts, gpu, timeout=timeout, clock=clock)
    applied = asyncio.run(apply_plan(t, plan, now=0, gpu_wait=gate))
    return applied, gate.notes


def test_restart_on_a_gpu_host_waits_for_release_before_start(tmp_path):
    old = subprocess.Popen(["sleep", "60"])
    unit = "[Service]\nExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /m --tp-size 1\n"
    path, _, facts, plan, gpu = gpu_host_setup(tmp_path, old.pid, old.pid, unit)
    t = GpuHost(old, path)
    clock = FakeClock()
    try:
        applied, notes = gated(t, plan, facts, gpu, 10, clock)
    finally:
        if old.poll() is None:
            old.kill()
    steps = [a.kind for a in plan.actions if a.service == "m" and a.kind in (Kind.STOP, Kind.WAIT_GPUS, Kind.START,
                                                                             Kind.RESTART)]
    assert steps == [Kind.STOP, Kind.WAIT_GPUS, Kind.START]   # the plan says it, so a dry run shows it
    kinds = [k for k, _ in t.log]
    assert kinds[0] == "apply" and STOP.search(t.log[0][1])
    assert "restart=1" not in t.log[0][1] and not START.search(t.log[0][1])
    assert kinds[-1] == "apply" and START.search(t.log[-1][1])
    assert "read" in kinds[1:-1]                      # the gate polled between stop and start
    assert applied.skipped == {} and any("GPUs free" in n for n in notes)
    assert clock.slept == []                          # free at the first look after the stop


def test_gpus_that_stay_busy_keep_the_service_from_starting(tmp_path):
    old = subprocess.Popen(["sleep", "60"])
    stray = subprocess.Popen(["sleep", "60"])          # not the service's: never stopped
    unit = "[Service]\nExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /m\n"
    path, _, facts, plan, gpu = gpu_host_setup(tmp_path, stray.pid, old.pid, unit)
    t = GpuHost(old, path)
    clock = FakeClock()
    try:
        applied, notes = gated(t, plan, facts, gpu, 0.5, clock)
        stray_alive = stray.poll() is None
    finally:
        for p in (old, stray):
            if p.poll() is None:
                p.kill()
    assert "m" in applied.skipped and "busy" in applied.skipped["m"]
    assert clock.elapsed() == 0.5                      # it gave up at its timeout (virtual seconds)
    assert any(f"stray GPU holder pid {stray.pid}" in n for n in notes)
    assert stray_alive                                 # policy "report": reported, never killed
    # Nothing past the gate ran (no start, no started record): the plan is not edited, the
    # gate's answer is the next round's fact (the planner records the start as blocked).
    assert [k for k, _ in t.log].count("apply") == 1 and not START.search(t.log[0][1])
    assert all(a.kind is not Kind.KILL_STRAYS for a in plan.actions)


def test_kill_is_the_plans_step_and_takes_the_stray_after_the_stop(tmp_path):
    old = subprocess.Popen(["sleep", "60"])
    stray = subprocess.Popen(["sleep", "60"])
    unit = "[Service]\nExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /m\n"
    path, _, facts, plan, gpu = gpu_host_setup(tmp_path, stray.pid, old.pid, unit, policy="kill")
    t = GpuHost(old, path)
    try:
        applied, notes = gated(t, plan, facts, gpu, 30, FakeClock())
        stray.wait(timeout=30)                  # reaped here: killed by the gate's step
    finally:
        for p in (old, stray):
            if p.poll() is None:
                p.kill()
    gate = [a.kind for a in plan.actions if a.service == "m" and a.kind in (Kind.STOP, Kind.KILL_STRAYS,
                                                                            Kind.WAIT_GPUS, Kind.START)]
    assert gate == [Kind.STOP, Kind.KILL_STRAYS, Kind.WAIT_GPUS, Kind.START]   # a dry run shows the kill
    assert stray.returncode == -15                                              # SIGTERM was enough
    assert any(n.startswith(f"m: stray pid {stray.pid} (sleep) on its GPUs: terminated") for n in notes), notes
    assert applied.skipped == {} and START.search(t.log[-1][1])

