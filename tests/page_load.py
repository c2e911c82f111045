"""Load on the fleet page while the daemon's loop does its work: a store and a hub as weeks of
deploys leave them, event-stream clients in a child process, and the loop's lag measured in the
server's process (tests/controller/test_web_load.py, bench/page_streams.py, bench/web_load.py).

The clients live in their own process (`python -m tests.page_load streams PORT N SECONDS`) so
that parsing their streams never takes the server's GIL: what the lag probe sees is the server's
own cost. Loopback only; every socket is closed when the clients are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pygit2

from reconciler.controller.store import Store
from reconciler.controller.web.hub import Hub
from reconciler.desired.spec import RolloutPolicy
from reconciler.plan.rollout import GroupKey, RolloutPlan, RolloutResult, plan_waves

ROOT = Path(__file__).resolve().parent.parent
CONNECT_TIMEOUT = 15.0
SERVICES = ("sglang-qwen", "vllm-qwen3-8b")
QUOTE = ("ValueError: MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer and "
         "SGLANG_ENABLE_SPEC_V2=1")
SUBJECTS = ("sglang: 0.5.12 for all GPU hosts", "vllm: raise max-num-seqs to 256", "qwen: enable MTP (3 steps)",
            "fleet: gpu-7 back from RMA", "sglang: context length 131072")


def make_repo(path: Path) -> list[str]:
    """A desired-state repo with a few commits (their subjects show on the page)."""
    repo = pygit2.init_repository(str(path), initial_head="main")
    sig = pygit2.Signature("Ops", "ops@example.invalid")
    revs: list[str] = []
    for i, subject in enumerate(SUBJECTS):
        blob = repo.create_blob(f"revision {i}\n".encode())
        tb = repo.TreeBuilder()
        tb.insert("fleet.toml", blob, pygit2.GIT_FILEMODE_BLOB)
        parents = [revs[-1]] if revs else []
        revs.append(str(repo.create_commit("HEAD", sig, sig, f"{subject}\n\nbody", tb.write(), parents)))
    return revs


def populate(state_dir: Path, repo_dir: Path, hosts: int = 30) -> Hub:
    """A store and a hub as the daemon has them mid-rollout on a fleet of `hosts` hosts."""
    revs = make_repo(repo_dir)
    old, good, new = revs[-3], revs[-2], revs[-1]
    names = [f"gpu-{i}" for i in range(1, hosts + 1)]
    store = Store(state_dir)
    for i, h in enumerate(names):
        for svc in SERVICES:
            for k in range(10):
                store.add_attempt(h, svc, revs[k % len(revs)], f"h{k}", "deploy", "Healthy", f"healthy after {40 + k}s",
                                  None, None, 40.0 + k)
            if svc == SERVICES[0] and i % 10 == 3:
                store.add_attempt(h, svc, new, "bad", "deploy", "CrashLoop", "NRestarts went from 0 to 3", QUOTE,
                                  ["starting", QUOTE], 12.5)
                store.add_attempt(h, svc, good, "h3", "rollback", "Healthy", "healthy after 61.0s", None, None, 61.0)
                store.set_status(h, svc, desired_rev=new, running_rev=good, health="healthy",
                                 last_event=f"rolled-back: {svc}: CrashLoop: rolled back to {good[:7]}", quote=QUOTE)
            elif svc == SERVICES[1] and i % 9 == 5:
                store.set_status(h, svc, desired_rev=good, running_rev=old, health="healthy",
                                 last_event=f"quarantined: {svc}: desired {good[:7]} quarantined (StartTimeout), "
                                            f"running {old[:7]}", quote="torch.OutOfMemoryError: CUDA out of memory. "
                                                                        "Tried to allocate 2.00 GiB")
            else:
                store.set_status(h, svc, desired_rev=good, running_rev=good, health="healthy",
                                 last_event="converged" if i % 4 else "in-sync")
    store.set_status(names[-1], "*", desired_rev=good, running_rev=None, health="unknown",
                     last_event="failed: Unreachable: connect to 127.0.0.99:22 timed out after 10s")
    store.close()

    hub = Hub()
    fleet = {h: SimpleNamespace(ssh=SimpleNamespace(address=f"127.0.0.{40 + i}"),
                                labels={"gpu": "h200" if i % 3 else "h100", "rack": f"r{i // 8 + 1}",
                                        **({"canary": "true"} if i == 0 else {})},
                                services=dict.fromkeys(SERVICES))
             for i, h in enumerate(names)}
    hub.run_started(new, "push", fleet, str(repo_dir))
    policy = RolloutPolicy(canary=1, max_unavailable="25%")
    labels = {h: f.labels for h, f in fleet.items()}
    waves = plan_waves(names, labels, policy, len(names))
    plan = RolloutPlan(GroupKey(SERVICES[0], "qwen"), policy, tuple(names), tuple(names), policy.bound(len(names)),
                       waves)
    ro = RolloutResult(plan, status="running", waves_done=1)
    hub.rollout("wave", ro)
    for h in waves[0].hosts:
        hub.phase(h, SERVICES[0], "healthy", 58.0, 1200)
    for j, h in enumerate(waves[1].hosts):
        hub.phase(h, SERVICES[0], "loading" if j % 2 else "healthy, stable for 30s?", 20.0 + j, 1200)
    return hub


@dataclass
class Lag:
    """How late a task that sleeps `period` again and again wakes up (seconds): the loop's lag."""

    period: float = 0.05
    samples: list[float] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t0 = loop.time()
            await asyncio.sleep(self.period)
            self.samples.append(max(0.0, loop.time() - t0 - self.period))

    def figures(self) -> dict[str, float]:
        s = sorted(self.samples) or [0.0]
        return {"max": s[-1], "p99": s[min(len(s) - 1, round(0.99 * (len(s) - 1)))],
                "median": statistics.median(s), "samples": float(len(self.samples))}


async def rollout_phases(hub: object, hosts: list[str], service: str, stop: asyncio.Event, every: float) -> int:
    """Report a health phase for one host after another, as a rollout does: each one changes the
    page's live and grid sections (every open stream has something to send). Returns the count."""
    n = 0
    while not stop.is_set():
        host = hosts[n % len(hosts)]
        hub.phase(host, service, "loading" if n % 2 else "starting", float(n % 60), 1200.0)  # type: ignore[attr-defined]
        n += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
    return n


def start_clients(port: int, n: int, seconds: float, path: str = "/events") -> subprocess.Popen[str]:
    """Open `n` event streams on 127.0.0.1:`port` from a child process, hold them `seconds`."""
    return subprocess.Popen([sys.executable, "-m", "tests.page_load", "streams", str(port), str(n), str(seconds), path],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)


def clients_result(proc: subprocess.Popen[str], timeout: float) -> dict[str, object]:
    """What the child saw: outcomes (200, 503, reset, ...) and per served stream its events."""
    out, _ = proc.communicate(timeout=timeout)
    return dict(json.loads(out.strip().splitlines()[-1]))


async def _one(port: int, path: str, hold: float) -> tuple[str, int, int]:
    """One client: (outcome, events seen, bytes read). Outcome: the HTTP status, or why none came."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), CONNECT_TIMEOUT)
    except (OSError, TimeoutError):
        return "connect-failed", 0, 0
    events = size = 0
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n".encode())
        line = await asyncio.wait_for(reader.readline(), CONNECT_TIMEOUT)
        parts = line.split()
        if len(parts) < 2:
            return "closed", 0, 0
        status = parts[1].decode()
        if status != "200":
            return status, 0, 0
        loop = asyncio.get_running_loop()
        end, tail = loop.time() + hold, b""
        while (left := end - loop.time()) > 0:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), left)
            except TimeoutError:
                break
            if not chunk:
                return "200-ended", events, size
            size += len(chunk)
            buf = tail + chunk
            events += buf.count(b"\nevent: ") - tail.count(b"\nevent: ")
            tail = buf[-16:]
        return status, events, size
    except (OSError, TimeoutError):
        return "reset", events, size
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _streams(port: int, n: int, hold: float, path: str) -> dict[str, object]:
    got = await asyncio.gather(*(_one(port, path, hold) for _ in range(n)))
    served = [g for g in got if g[0] == "200"]
    return {"outcomes": dict(Counter(g[0] for g in got)), "events": [g[1] for g in served],
            "bytes": sum(g[2] for g in got)}


def main(argv: list[str]) -> None:
    """`streams PORT N SECONDS [PATH]`: print one JSON line with what the clients saw."""
    if len(argv) < 4 or argv[0] != "streams":
        raise SystemExit("usage: python -m tests.page_load streams PORT N SECONDS [PATH]")
    path = argv[4] if len(argv) > 4 else "/events"
    print(json.dumps(asyncio.run(_streams(int(argv[1]), int(argv[2]), float(argv[3]), path))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
