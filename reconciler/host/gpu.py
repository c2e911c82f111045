"""The GPU gate's executor: read a host's GPUs (plan/facts/gpu.py's GpuRead) in one round trip
(`gpu_facts`), wait until they are free after a stop (`wait_released`), and deal with stray
holders (`kill_strays`, sh/signal.sh)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import msgspec

from ..clock import REAL, Clock
from ..frames import HostProgram, Param, Records, number
from ..plan.facts.gpu import DEVICE_PREFIX, GpuFacts, GpuRead, Holder
from . import programs
from .transport import Transport

POLICIES: tuple[str, ...] = ("report", "kill")
Fate = Literal["reported", "terminated", "killed", "gone", "survived", "failed"]


async def gpu_facts(t: Transport, *, timeout: float = 30.0, device_prefix: str = DEVICE_PREFIX,
                    health_since: int | None = None) -> GpuFacts:
    """Read and parse the GPU state of the host behind a transport (one round trip); with
    health_since, its GPUs' health too (GpuRead)."""
    return await programs.run(t, GpuRead(health_since, device_prefix), timeout=timeout, what="GPU check",
                              check=False)


def released(facts: GpuFacts, *, pids: set[int] | None, max_used_mib: int,
             gpus: set[int] | None = None) -> bool:
    """Pure: none of pids holds the GPUs, and memory.used is below the threshold on every GPU
    (or on the given GPU indexes)."""
    if pids and any(h.pid in pids for h in facts.holders):
        return False
    return not facts.used_over(max_used_mib, gpus)


async def wait_released(t: Transport, *, pids: set[int] | None = None, timeout: float,
                        poll: float = 0.25, max_used_mib: int = 1024,
                        gpus: set[int] | None = None, device_prefix: str = DEVICE_PREFIX,
                        clock: Clock = REAL) -> tuple[bool, GpuFacts, float]:
    """After a stop: wait (at most timeout seconds) until the GPUs are free again.

    Free: none of pids is still a holder, and memory.used is below max_used_mib on every GPU
    (or only on the GPU indexes in gpus, when other services keep theirs). Returns (released,
    the last facts, seconds waited). A host without GPUs is released once the pids are gone.
    `clock`: what the polls and the timeout are measured on (a test's virtual one).
    """
    start = clock.now()
    while True:
        facts = await gpu_facts(t, timeout=max(5.0, min(30.0, timeout)), device_prefix=device_prefix)
        waited = clock.now() - start
        if released(facts, pids=pids, max_used_mib=max_used_mib, gpus=gpus):
            return True, facts, waited
        if waited >= timeout:
            return False, facts, waited
        await clock.sleep(min(poll, max(0.0, timeout - waited)))


class KillOutcome(msgspec.Struct, frozen=True):
    """What kill_strays did to one holder: reported (policy report), terminated (exited after
    SIGTERM), killed (needed SIGKILL), gone (had exited already, or its PID now belongs to
    another program), survived (still there after SIGKILL) or failed (the signal could not be
    sent, e.g. not permitted)."""

    holder: Holder
    outcome: Fate


class Signal(HostProgram[dict[str, set[int]]], frozen=True):
    """reconciler/sh/signal.sh: SIGTERM (`term`: each holder whose name is still the one seen)
    or SIGKILL (`kill`) these holders, or say which are `alive`. Its answer: S (signalled), F
    (the signal failed) and A (alive), each a set of PIDs."""

    name: ClassVar[str] = "signal"
    action: Literal["term", "kill", "alive"]
    holders: tuple[tuple[int, str], ...]

    def params(self) -> Mapping[str, Param]:
        # a name with a line break cannot be compared (nor carried): such a holder is left alone
        return {"action": self.action,
                "holder": [f"{pid} {comm}" for pid, comm in self.holders if "\n" not in comm and "\r" not in comm]}

    def parse(self, answer: Records) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {"S": set(), "F": set(), "A": set()}
        for f in answer:
            if f.kind in out and (pid := number(f.payload, 12)) is not None:
                out[f.kind].add(pid)
        return out


async def _still_alive(t: Transport, pids: set[int], until: float, poll: float, clock: Clock) -> set[int]:
    """Which of pids are alive, read again every `poll` seconds while any is, until `until`."""
    alive = pids
    while alive:
        alive = (await programs.run(t, Signal("alive", tuple((p, "") for p in sorted(alive))), timeout=15,
                                    what="GPU holder check", check=False))["A"]
        if not alive or clock.now() >= until:
            break
        await clock.sleep(poll)
    return alive


async def kill_strays(t: Transport, holders: list[Holder], policy: str = "report", *,
                      grace: float = 10.0, poll: float = 0.25, clock: Clock = REAL) -> list[KillOutcome]:
    """Deal with stray GPU holders according to the service's policy.

    "report" (the default) never signals anything. "kill" sends SIGTERM, waits up to grace
    seconds, then SIGKILLs what is left. Before signalling, each PID's comm is checked again,
    so a PID that was reused by another program in the meantime is left alone. `clock`: what
    grace and the polls are measured on (a test's virtual one).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown stray-process policy {policy!r} (expected one of {', '.join(POLICIES)})")
    if policy == "report" or not holders:
        return [KillOutcome(h, "reported") for h in holders]
    said = await programs.run(t, Signal("term", tuple((h.pid, h.comm) for h in holders)), timeout=15,
                              what="SIGTERM stray GPU holders", check=False)
    signalled, failed = said["S"], said["F"]
    alive = await _still_alive(t, signalled, clock.now() + grace, poll, clock)
    killed: set[int] = set()
    if alive:
        said = await programs.run(t, Signal("kill", tuple((p, "") for p in sorted(alive))), timeout=15,
                                  what="SIGKILL stray GPU holders", check=False)
        killed = said["S"]
        alive = await _still_alive(t, alive, clock.now() + 5.0, poll, clock)

    def fate(pid: int) -> Fate:
        if pid in failed:
            return "failed"
        if pid not in signalled:
            return "gone"
        if pid in alive:
            return "survived"
        return "killed" if pid in killed else "terminated"
    return [KillOutcome(h, fate(h.pid)) for h in holders]
