#!/usr/bin/env python3
"""The GPU health read on a real GPU: what `nvidia-smi -q`, the kernel log and DCGM say, and what
the read costs, with a CUDA process holding memory (as a loaded server does) and without.

Run ON the GPU machine, from the repository root (python3 with torch and nvidia-smi; no sshd,
systemd, pydantic or asyncssh):

    python3 bench/gpu_health_device.py --out DIR      # well under a minute
    python3 bench/gpu_health_device.py --dry          # only the reading (any machine)

It runs reconciler.host.gpu's own command (gpu.sh with the health asked for) through a local
shell, exactly as a pre-flight runs it through SSH, three times each: without a holder, then
while a child python3 holds --gib GiB on cuda:0. Prints the reading (faults, signs, notes) and
the wall time of each read, and writes the raw `nvidia-smi -q` (and the kept sections) to --out
for the parser's tests. Exits 1 when a healthy GPU reads as faulted or not read at all.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu_gate_device import CHILD, LocalShell  # noqa: E402
from reconciler.host import gpu  # noqa: E402


async def reads(t: gpu.Runner, label: str, n: int = 3) -> gpu.GpuFacts:
    times, facts = [], None
    for _ in range(n):
        t0 = time.monotonic()
        facts = await gpu.gpu_facts(t, health_since=0)
        times.append(time.monotonic() - t0)
    assert facts is not None
    h = facts.health
    print(f"{label}: GPU read with health: {', '.join(f'{x:.2f}s' for x in times)} "
          f"(median {statistics.median(times):.2f}s)", flush=True)
    t0 = time.monotonic()
    await gpu.gpu_facts(t)
    print(f"{label}: GPU read without health (the waits' polls): {time.monotonic() - t0:.2f}s", flush=True)
    print(f"{label}: {facts.summary()}", flush=True)
    print(f"{label}: health: {h.summary() if h else 'not read'}; faults={list(h.faults) if h else None} "
          f"signs={list(h.signs) if h else None} notes={list(h.notes) if h else None}", flush=True)
    return facts


async def run(gib: int, out: Path | None, dry: bool) -> int:
    t = LocalShell()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        raw = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True)
        (out / "nvidia-smi-q.txt").write_text(raw.stdout + raw.stderr)
        cmd, token = gpu.gpu_command(health_since=0)
        res = await t.run(cmd, timeout=60)
        kept = [ln[len(token) + 3:] for ln in res.stdout.splitlines() if ln.startswith(f"{token} Q ")]
        (out / "kept-sections.txt").write_text("\n".join(kept) + "\n")
        print(f"nvidia-smi -q: {len(raw.stdout)} bytes, exit {raw.returncode}; kept {len(kept)} lines", flush=True)
    before = await reads(t, "idle")
    h = before.health
    if h is None or not h.read or h.faults:
        print("FAIL: a healthy GPU must read healthy", flush=True)
        return 1
    if dry:
        return 0
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, str(gib),
                                                 stdout=asyncio.subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 90)
        print(f"holder: pid {child.pid} {line.decode().strip()} GiB on cuda:0", flush=True)
        during = await reads(t, "held")
        if during.health is None or during.health.faults:
            print("FAIL: a held, healthy GPU must read healthy", flush=True)
            return 1
        alive = child.returncode is None
        print(f"holder undisturbed by the reads: {alive}", flush=True)
        return 0 if alive else 1
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=100)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry", action="store_true")
    a = ap.parse_args()
    return asyncio.run(run(a.gib, a.out, a.dry))


if __name__ == "__main__":
    sys.exit(main())
