"""The drain's calls (issue 42): a host leaves the balancer's rotation, its work in flight is
waited for, and it rejoins once its new server is ready and judged. plan/drain.py decides (the
steps, when the wait is over, what HAProxy's stats say); this module only makes the calls.

A call (desired/spec.CallSpec) is one of:

  * `http`: a request made from the host, through the SSH channel, as the health probe is
    (host/probe.http_request);
  * `haproxy`: one line to HAProxy's runtime API on its Unix socket on the controller (`set
    server <b>/<s> state drain|ready`; `show stat` for `serving`), as an operator's `socat` does;
  * `host`: a shell line run on the host as root (as `model.fetch` is);
  * `controller`: a command run on the controller, never through a shell, and only when its
    program is one the run allows (`RunOptions.drain_programs`: `reconcile --drain-program`, the
    daemon's `drain_programs`): the repo alone never names a program the controller runs.

The in-flight read is a GET from the host (the engine's /metrics, or a URL that answers a
number). Nothing here raises for a call that failed: the answer says so, and the caller decides
(a leave that failed stops the restart before anything stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection

import msgspec

from .. import redact
from ..clock import REAL, Clock
from ..desired.spec import CallSpec, DrainSpec, InflightSpec
from ..errors import CommandError
from ..plan.drain import DrainState, Reading, drain_decision, inflight_of, parse_show_stat
from .transport import Transport

ANSWER_CHARS = 300                   # of what a call answered, in a message


class Called(msgspec.Struct, frozen=True):
    """What one call came to: ok, and what it answered (redacted, cut)."""

    ok: bool
    said: str = ""


async def call(t: Transport, c: CallSpec, *, allowed: Collection[str] = ()) -> Called:
    """Make one call of a drain. `allowed`: the programs a `controller` call may run."""
    try:
        if c.kind == "http":
            from .probe import http_request  # on first use: httpx loads when a drain calls, not at start-up
            status, body = await http_request(t, c.target, method=c.method, body=c.body, timeout=c.timeout)
            ok = status is not None and (status == c.expect_status if c.expect_status is not None
                                         else 200 <= status < 300)
            return Called(ok, _said(f"HTTP {status}: {body}" if status is not None else body))
        if c.kind == "haproxy":
            said = await haproxy(c.target, c.input or "", timeout=c.timeout)
            if (c.input or "").startswith("show stat"):
                stat = parse_show_stat(said).get(c.server or "")
                return Called(stat is not None and stat.serving, f"{c.server}: {stat.status if stat else 'not listed'}")
            return Called(not said.strip(), _said(said))      # HAProxy answers nothing to a `set` it took
        if c.kind == "host":
            try:
                res = await t.run(c.target, timeout=c.timeout, what="drain call")
            except CommandError as e:        # timed out, or killed on the host: a failed call like any other
                return Called(False, _said(e.stderr or e.message))
            return Called(res.ok, _said(f"exit {res.exit_status}: {res.stderr or res.stdout}"))
        return await _controller(c, allowed)
    except (OSError, TimeoutError) as e:
        return Called(False, _said(f"{type(e).__name__}: {e}"))


def _said(text: str) -> str:
    return redact.clip(text.strip(), ANSWER_CHARS)


async def haproxy(socket_path: str, line: str, *, timeout: float = 10.0) -> str:
    """One command to HAProxy's runtime API on its Unix socket; what it answered."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_unix_connection(socket_path)
        try:
            writer.write(line.rstrip("\n").encode() + b"\n")
            await writer.drain()
            return (await reader.read(1 << 20)).decode(errors="replace")
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _controller(c: CallSpec, allowed: Collection[str]) -> Called:
    program = c.argv[0] if c.argv else ""
    if program not in allowed:
        return Called(False, f"{program!r} is not a program this controller allows a drain to run "
                             f"(reconcile --drain-program {program or 'PROGRAM'}; the daemon: drain_programs in "
                             f"config.toml)")
    proc = await asyncio.create_subprocess_exec(*c.argv, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(c.timeout):
            out, err = await proc.communicate((c.input or "").encode())
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return Called(False, f"{program} did not finish within {c.timeout:g}s")
    return Called(proc.returncode == 0, _said(f"exit {proc.returncode}: {(err or out).decode(errors='replace')}"))


async def read_inflight(t: Transport, spec: InflightSpec, at: float, *, timeout: float = 5.0) -> Reading:
    """One in-flight read from the host, `at` seconds after the leave."""
    from .probe import http_request  # on first use, as call's
    status, body = await http_request(t, spec.url, timeout=timeout)
    if status != 200:
        return Reading(at, None, _said(f"HTTP {status}" if status is not None else body))
    value = inflight_of(body, spec.metric)
    return Reading(at, value, None if value is not None else f"{spec.metric or 'a number'} not in the answer")


class Drained(msgspec.Struct, frozen=True):
    """A leave and its drain: whether the host left rotation, the seconds each took, what the
    wait ended on (its message), and what was still in flight when it ended (None: 0 or unread)."""

    left: bool
    message: str
    leave_seconds: float = 0.0
    drain_seconds: float = 0.0
    inflight: float | None = None


async def leave_and_drain(t: Transport, d: DrainSpec, *, clock: Clock = REAL,
                          allowed: Collection[str] = ()) -> Drained:
    """Take the host out of rotation, then wait (plan/drain.drain_decision) for its work in flight
    to reach 0, or the drain timeout."""
    t0 = clock.now()
    left = await call(t, d.leave, allowed=allowed)
    if not left.ok:
        return Drained(False, f"could not leave rotation ({d.leave.describe()}): {left.said}", clock.now() - t0)
    t1 = clock.now()
    readings: list[Reading] = []
    while True:
        now = clock.now() - t1
        decision = drain_decision(d, readings, now)
        if decision.state is not DrainState.WAITING:
            last = next((r.inflight for r in reversed(readings) if r.inflight is not None), None)
            return Drained(True, decision.message, t1 - t0, clock.now() - t1,
                           last if decision.state is DrainState.TIMED_OUT else None)
        if readings or d.inflight is None:
            await clock.sleep(decision.wait)
        if d.inflight is not None:
            readings.append(await read_inflight(t, d.inflight, clock.now() - t1, timeout=min(5.0, d.timeout)))


class Rejoined(msgspec.Struct, frozen=True):
    """A rejoin: whether the host is back (and, when it can be asked, serving), the seconds each took."""

    ok: bool
    message: str
    rejoin_seconds: float = 0.0
    serving_seconds: float = 0.0


async def rejoin(t: Transport, d: DrainSpec, *, clock: Clock = REAL, allowed: Collection[str] = (),
                 every: float = 0.2) -> Rejoined:
    """Put the host back into rotation; then, when `serving` is declared, wait until the balancer
    says it sends the host traffic again (at most the drain timeout)."""
    t0 = clock.now()
    back = await call(t, d.rejoin, allowed=allowed)
    t1 = clock.now()
    if not back.ok:
        return Rejoined(False, f"could not rejoin rotation ({d.rejoin.describe()}): {back.said}", t1 - t0)
    if d.serving is None:
        return Rejoined(True, "back in rotation", t1 - t0)
    while True:
        said = await call(t, d.serving, allowed=allowed)
        if said.ok:
            return Rejoined(True, f"serving again: {said.said}", t1 - t0, clock.now() - t1)
        if clock.now() - t1 >= d.timeout:
            return Rejoined(False, f"not serving within {d.timeout:g}s of the rejoin: {said.said}", t1 - t0,
                            clock.now() - t1)
        await clock.sleep(every)


async def serving(t: Transport, d: DrainSpec, *, allowed: Collection[str] = ()) -> bool | None:
    """Whether the balancer sends the host traffic now (None: it cannot be asked)."""
    if d.serving is None:
        return None
    return (await call(t, d.serving, allowed=allowed)).ok
