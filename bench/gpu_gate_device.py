#!/usr/bin/env python3
"""The GPU gate on a real GPU: a torch process holding 20 GiB is detected, then released.

Run ON the GPU machine, from the repository root (it needs python3 with torch and
nvidia-smi; no sshd, systemd, pydantic or asyncssh):

    python3 bench/gpu_gate_device.py             # the full run, well under 2 minutes
    python3 bench/gpu_gate_device.py --gib 8     # a smaller allocation
    python3 bench/gpu_gate_device.py --dry       # only the "before" facts (any machine)

It runs reconciler.host.gpu's own code through a local shell, exactly as the reconciler runs it
through SSH: (1) the gate's facts before; (2) a child python3 that allocates --gib GiB on
cuda:0 and touches it; (3) polls the gate until the child's PID shows up as a holder, with
its device nodes and its memory; (4) stops the child through kill_strays(policy="kill") and
waits with wait_released(pids={child}) until the memory is back. Prints labelled lines and
exits 1 when detection or release fails (2 on a usage or set-up error).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))    # run as a script from anywhere: `reconciler` is at ROOT

from reconciler.host import gpu  # noqa: E402  (standard library only at run time)
from reconciler.host.transport import LocalTransport, Transport  # noqa: E402

CHILD = r"""
import sys, time
import torch
n = int(sys.argv[1])
x = torch.empty(n * 2**30, dtype=torch.uint8, device="cuda:0")
x.fill_(1)                       # touch every page: the memory is really in use
torch.cuda.synchronize()
print(f"ready {torch.cuda.memory_allocated(0) / 2**30:.2f}", flush=True)
time.sleep(600)
"""


def transport() -> Transport:
    """reconciler's own LocalTransport (the standard library only: asyncssh loads when a
    connection is made, which this never makes)."""
    return LocalTransport()


T0 = time.monotonic()


def say(label: str, text: str) -> None:
    print(f"[{time.monotonic() - T0:6.2f}s] {label:<8} {text}", flush=True)


async def run(gib: int, dry: bool) -> int:
    t = transport()
    say("setup", f"transport={type(t).__name__} python={sys.executable} pid={os.getpid()}")
    before = await gpu.gpu_facts(t)
    say("before", before.summary())
    if dry:
        return 0
    if not before.has_nvidia_smi or not before.gpus:
        say("FAIL", "no GPU visible to nvidia-smi on this machine")
        return 2
    gpu0 = next((g for g in before.gpus if g.index == 0), before.gpus[0])
    # The release threshold: what GPU 0 used before, plus 1 GiB of slack.
    threshold = max(1024, (gpu0.used_mib or 0) + 1024)
    want_mib = int(gib * 1024 * 0.9)

    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, str(gib), stdout=asyncio.subprocess.PIPE)
    say("child", f"pid {child.pid}: allocating {gib} GiB on cuda:0 with torch")
    try:
        assert child.stdout is not None
        try:
            line = await asyncio.wait_for(child.stdout.readline(), 90)
        except asyncio.TimeoutError:
            say("FAIL", "child not ready within 90 s")
            return 1
        if not line.startswith(b"ready"):
            say("FAIL", f"child exited before allocating (exit {await child.wait()})")
            return 1
        t_ready = time.monotonic()
        say("child", f"ready: torch.cuda.memory_allocated = {line.split()[1].decode()} GiB")

        # (3) Detection: the child's PID as a holder, with its device nodes and its memory.
        polls = 0
        facts = before
        detected: gpu.Holder | None = None
        while time.monotonic() - t_ready < 30:
            polls += 1
            facts = await gpu.gpu_facts(t)
            h = facts.holder(child.pid)
            if h is not None and h.devices and (h.used_mib or 0) >= want_mib:
                detected = h
                break
            await asyncio.sleep(0.25)
        took = time.monotonic() - t_ready
        if detected is None:
            h = facts.holder(child.pid)
            say("FAIL", f"pid {child.pid} not detected with >= {want_mib} MiB within {took:.2f} s "
                        f"({polls} polls); last: {h or 'not a holder'}; {facts.summary()}")
            return 1
        say("detect", f"pid {detected.pid} found after {took:.2f} s ({polls} poll{'s' if polls != 1 else ''})")
        say("holder", str(detected))
        say("gpus", "; ".join(f"GPU {g.index}: {g.used_mib}/{g.total_mib} MiB used" for g in facts.gpus))

        # The stray check: with no service PIDs, the child is a stray; "report" leaves it alone.
        strays = facts.holders            # no service here: every holder is a stray
        reported = await gpu.kill_strays(t, [s for s in strays if s.pid == child.pid], "report")
        alive = child.returncode is None
        say("stray", f"{len(strays)} stray holder(s); policy report -> "
                     f"{', '.join(o.outcome for o in reported)}; child still running: {alive}")
        if not alive:
            say("FAIL", "policy report must not stop anything")
            return 1

        # (4) Stop it the way the gate would (policy kill: SIGTERM, then SIGKILL), then wait
        # until its PID is gone and GPU 0's memory is back under the threshold.
        t_kill = time.monotonic()
        outcome = await gpu.kill_strays(t, [detected], "kill", grace=10.0)
        say("kill", f"policy kill -> {outcome[0].outcome} after {time.monotonic() - t_kill:.2f} s")
        reap = asyncio.ensure_future(child.wait())
        ok, after, waited = await gpu.wait_released(
            t, pids={child.pid}, timeout=30.0, poll=0.25, max_used_mib=threshold, gpus={gpu0.index})
        await asyncio.wait_for(reap, 10)
        say("release", f"released={ok} {time.monotonic() - t_kill:.2f} s after the kill "
                       f"(wait_released waited {waited:.2f} s; threshold {threshold} MiB on GPU {gpu0.index})")
        say("after", after.summary())
        if not ok:
            say("FAIL", "GPU memory or the holder did not go away")
            return 1
        say("PASS", f"detected pid {detected.pid} holding {detected.used_mib} MiB; released after the kill")
        return 0
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=int, default=20, help="GiB the child allocates on cuda:0 (default 20)")
    p.add_argument("--dry", action="store_true", help="only print the gate's facts, start nothing")
    args = p.parse_args(argv)
    if args.gib < 1:
        p.error("--gib must be at least 1")
    try:
        return asyncio.run(asyncio.wait_for(run(args.gib, args.dry), 115))
    except asyncio.TimeoutError:
        say("FAIL", "did not finish within 115 s")
        return 1


if __name__ == "__main__":
    sys.exit(main())
