"""The drain's calls (reconciler/host/rotation.py, issue 42): leave, rejoin and `serving` of each
kind (`http` from the host, `haproxy` on its runtime API socket, `host`, `controller` and its
allow-list), the in-flight read, the timeouts and the messages; then leave_and_drain and rejoin,
timed by the virtual clock (tests/clock.py).

Real parts: LocalTransport (a host that is this machine: bash, and TCP to 127.0.0.1, the shape of
the SSH channel the probe uses), a small HTTP server on 127.0.0.1 that records what it was asked
and answers what the test says, and a stand-in for HAProxy's runtime API on a Unix socket (one
line in, one answer out, then it closes, as HAProxy does). The real HAProxy is in the drain's
e2e tests (tests/e2e/test_e2e_drain.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reconciler import redact
from reconciler.desired.spec import CallSpec, DrainSpec, InflightSpec
from reconciler.host import rotation
from reconciler.host.rotation import Called, Drained, Rejoined
from reconciler.host.transport import LocalTransport
from reconciler.plan.drain import Reading
from tests.clock import FakeClock
from tests.host.procs import wait_gone

LOOPBACK = "127.0.0.1"
STAT_HEADER = "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status"


def stat(status: str, server: str = "gpu-1", sessions: int = 0) -> str:
    """HAProxy's `show stat` with one backend server in `status` (and the frontend/backend rows)."""
    rest = ",".join(["0"] * 9)       # bin .. wredis
    return (f"{STAT_HEADER}\nqwen,FRONTEND,,,0,0,100,0,{rest},OPEN\n"
            f"qwen,{server},0,0,{sessions},0,,0,{rest},{status}\nqwen,BACKEND,0,0,0,0,10,0,{rest},UP\n")


@dataclass
class Http:
    """A server on 127.0.0.1 that records each request (method, path, body) and answers with
    `answer(method, path)`: (status line, body)."""

    answer: Callable[[str, str], tuple[str, str]]
    seen: list[tuple[str, str, str]] = field(default_factory=list)
    port: int = 0

    def url(self, path: str) -> str:
        return f"http://{LOOPBACK}:{self.port}{path}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            method, path = head.split(" ", 2)[:2]
            length = next((int(x.split(":", 1)[1]) for x in head.split("\r\n")
                           if x.lower().startswith("content-length:")), 0)
            body = (await reader.readexactly(length)).decode() if length else ""
            self.seen.append((method, path, body))
            status, text = self.answer(method, path)
            data = text.encode()
            writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def http(answer: Callable[[str, str], tuple[str, str]]) -> AsyncIterator[Http]:
    srv = Http(answer)
    server = await asyncio.start_server(srv.handle, LOOPBACK, 0)
    srv.port = server.sockets[0].getsockname()[1]
    try:
        yield srv
    finally:
        server.close()


@dataclass
class RuntimeApi:
    """A stand-in for HAProxy's runtime API socket: records each line; answers `answer(line)`
    and closes (None: holds the connection open and says nothing, as a stuck balancer)."""

    path: str
    answer: Callable[[str], str | None]
    lines: list[str] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await reader.readline()).decode()
            self.lines.append(line)
            said = self.answer(line.rstrip("\n"))
            if said is None:
                await reader.read()          # until the caller gives up and hangs up
                return
            writer.write(said.encode())
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


@asynccontextmanager
async def runtime_api(tmp_path: Path, answer: Callable[[str], str | None]) -> AsyncIterator[RuntimeApi]:
    api = RuntimeApi(str(tmp_path / "admin.sock"), answer)
    server = await asyncio.start_unix_server(api.handle, api.path)
    try:
        yield api
    finally:
        server.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


T = LocalTransport("gpu-1")


# ---- one call of each kind ------------------------------------------------------------------


@pytest.mark.parametrize(("status", "expect", "ok", "said"), [
    ("200 OK", None, True, "HTTP 200: draining"),
    ("202 Accepted", None, True, "HTTP 202: draining"),        # any 2xx, when none is named
    ("503 Service Unavailable", None, False, "HTTP 503: draining"),
    ("302 Found", None, False, "HTTP 302: draining"),           # a redirect is not followed, nor taken
    ("200 OK", 204, False, "HTTP 200: draining"),                # the status named, and no other
    ("204 No Content", 204, True, "HTTP 204: draining"),
])
def test_an_http_call_is_made_from_the_host_with_its_method_and_body(status, expect, ok, said):
    async def main() -> tuple[Called, list[tuple[str, str, str]]]:
        async with http(lambda m, p: (status, "draining" if not status.startswith("204") else "")) as srv:
            c = CallSpec("http", srv.url("/admin/drain"), method="PUT", body='{"drain": true}', expect_status=expect,
                         timeout=5)
            return await rotation.call(T, c), srv.seen
    got, seen = run(main())
    assert seen == [("PUT", "/admin/drain", '{"drain": true}')]
    assert got == Called(ok, said if not status.startswith("204") else "HTTP 204:")


def test_an_http_call_nobody_answers_fails_with_where_it_broke():
    async def main() -> Called:
        async with http(lambda m, p: ("200 OK", "")) as srv:
            port = srv.port
        return await rotation.call(T, CallSpec("http", f"http://{LOOPBACK}:{port}/drain", timeout=5))
    got = run(main())
    assert not got.ok and got.said.startswith("connect: ") and "refused" in got.said.lower()


@pytest.mark.parametrize(("answer", "ok", "said"), [
    ("", True, ""),                                   # HAProxy answers nothing to a `set` it took
    ("\n", True, ""),
    ("No such server.\n", False, "No such server."),
    ("Require 'backend/server'.\n", False, "Require 'backend/server'."),
])
def test_a_haproxy_set_sends_one_line_and_is_taken_when_nothing_comes_back(tmp_path, answer, ok, said):
    async def main() -> tuple[Called, list[str]]:
        async with runtime_api(tmp_path, lambda line: answer) as api:
            c = CallSpec("haproxy", api.path, input="set server qwen/gpu-1 state drain", server="qwen/gpu-1")
            return await rotation.call(T, c), api.lines
    got, lines = run(main())
    assert lines == ["set server qwen/gpu-1 state drain\n"]
    assert got == Called(ok, said)


@pytest.mark.parametrize(("status", "server", "ok", "said"), [
    ("UP", "gpu-1", True, "qwen/gpu-1: UP"),
    ("UP 1/3", "gpu-1", True, "qwen/gpu-1: UP 1/3"),
    ("no check", "gpu-1", True, "qwen/gpu-1: no check"),
    ("DRAIN", "gpu-1", False, "qwen/gpu-1: DRAIN"),
    ("MAINT", "gpu-1", False, "qwen/gpu-1: MAINT"),
    ("DOWN 1/2", "gpu-1", False, "qwen/gpu-1: DOWN 1/2"),
    ("UP", "gpu-2", False, "qwen/gpu-1: not listed"),      # another server is UP: not this one
])
def test_haproxy_show_stat_says_whether_the_balancer_serves_this_server(tmp_path, status, server, ok, said):
    async def main() -> tuple[Called, list[str]]:
        async with runtime_api(tmp_path, lambda line: stat(status, server)) as api:
            c = CallSpec("haproxy", api.path, input="show stat", server="qwen/gpu-1")
            return await rotation.call(T, c), api.lines
    got, lines = run(main())
    assert lines == ["show stat\n"] and got == Called(ok, said)


def test_a_haproxy_socket_that_is_not_there_or_never_answers_is_a_failed_call(tmp_path):
    async def main() -> tuple[Called, Called]:
        missing = await rotation.call(T, CallSpec("haproxy", str(tmp_path / "none.sock"), input="show info"))
        async with runtime_api(tmp_path, lambda line: None) as api:
            stuck = await rotation.call(T, CallSpec("haproxy", api.path, input="show info", timeout=0.2))
        return missing, stuck
    missing, stuck = run(main())
    assert missing == Called(False, "FileNotFoundError: [Errno 2] No such file or directory")
    assert stuck == Called(False, "TimeoutError:")


def test_a_host_call_runs_its_line_on_the_host_and_says_its_exit_and_stderr(tmp_path):
    mark = tmp_path / "left"
    ok = run(rotation.call(T, CallSpec("host", f"echo left >> {mark}; echo fine")))
    assert ok == Called(True, "exit 0: fine") and mark.read_text() == "left\n"
    bad = run(rotation.call(T, CallSpec("host", "echo out; echo 'no balancer here' >&2; exit 3")))
    assert bad == Called(False, "exit 3: no balancer here")


def test_a_host_call_that_times_out_is_a_failed_call_not_an_error():
    """The host's command overran its timeout: the transport kills it (CommandError); the call
    says so, as every other failed call does, and the caller decides (DrainFailed, not the
    host's run ending on a bare command error)."""
    got = run(rotation.call(T, CallSpec("host", "exec sleep 30", timeout=0.3)))
    assert got == Called(False, "timed out after 0.3s")


def test_a_controller_program_runs_only_when_the_run_allows_it(tmp_path):
    mark = tmp_path / "ran"
    argv = ("touch", str(mark))
    refused = run(rotation.call(T, CallSpec("controller", argv=argv), allowed=("/usr/bin/touch", "socat")))
    assert refused == Called(False, "'touch' is not a program this controller allows a drain to run "
                                    "(reconcile --drain-program touch; the daemon: drain_programs in config.toml)")
    assert not mark.exists()                       # refused before anything ran
    assert run(rotation.call(T, CallSpec("controller", argv=argv), allowed=("touch",))) == Called(True, "exit 0:")
    assert mark.exists()


def test_a_controller_program_gets_its_input_on_stdin_and_is_never_given_a_shell(tmp_path):
    got_in = tmp_path / "stdin"
    c = CallSpec("controller", argv=("sh", "-c", f'cat > {got_in}; echo "took it"'),
                 input="set server qwen/gpu-1 state drain\n")
    assert run(rotation.call(T, c, allowed=("sh",))) == Called(True, "exit 0: took it")
    assert got_in.read_text() == "set server qwen/gpu-1 state drain\n"
    # the words are argv: `;` and `$(...)` reach the program as text, never a shell
    echo = CallSpec("controller", argv=("echo", "a;", "$(id)"))
    assert run(rotation.call(T, echo, allowed=("echo",))) == Called(True, "exit 0: a; $(id)")
    bad = CallSpec("controller", argv=("sh", "-c", "echo partial; echo 'socket: permission denied' >&2; exit 2"))
    assert run(rotation.call(T, bad, allowed=("sh",))) == Called(False, "exit 2: socket: permission denied")


@pytest.mark.timeout(60)     # a bound for a failing test: a program left to run out its sleep
def test_a_controller_program_that_overruns_its_timeout_is_killed(tmp_path):
    pidfile = tmp_path / "pid"
    c = CallSpec("controller", argv=("sh", "-c", f"echo $$ > {pidfile}; exec sleep 3600"), timeout=0.3)
    assert run(rotation.call(T, c, allowed=("sh",))) == Called(False, "sh did not finish within 0.3s")
    assert wait_gone(int(pidfile.read_text()), timeout=5)


def test_what_a_call_answered_is_redacted_and_cut():
    secret = "Drain-Token-Value-0123456789"
    redact.register(secret)
    try:
        async def main() -> Called:
            async with http(lambda m, p: ("403 Forbidden", f"bad token {secret} " + "x" * 1000)) as srv:
                return await rotation.call(T, CallSpec("http", srv.url("/drain")))
        got = run(main())
    finally:
        redact._values.discard(secret)
    assert secret not in got.said and got.said.startswith("HTTP 403: bad token *** xxx")
    assert len(got.said) == rotation.ANSWER_CHARS and got.said.endswith("\u2026")


# ---- the in-flight read -------------------------------------------------------------------


METRICS = ('# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
           'vllm:num_requests_running{model_name="qwen",engine="0"} 2.0\n'
           'vllm:num_requests_running{model_name="qwen",engine="1"} 1.0\n'
           'vllm:num_requests_running_total 99\n')


@pytest.mark.parametrize(("status", "body", "metric", "reading"), [
    ("200 OK", METRICS, "vllm:num_requests_running", Reading(1.5, 3.0)),          # summed over its label sets
    ("200 OK", "4\n", None, Reading(1.5, 4.0)),                                    # a URL that answers a number
    ("200 OK", METRICS, "sglang:num_running_reqs", Reading(1.5, None, "sglang:num_running_reqs not in the answer")),
    ("200 OK", "busy", None, Reading(1.5, None, "a number not in the answer")),
    ("500 Internal Server Error", "oops", None, Reading(1.5, None, "HTTP 500")),
])
def test_the_in_flight_read(status, body, metric, reading):
    async def main() -> tuple[Reading, list[tuple[str, str, str]]]:
        async with http(lambda m, p: (status, body)) as srv:
            return await rotation.read_inflight(T, InflightSpec(srv.url("/metrics"), metric), 1.5), srv.seen
    got, seen = run(main())
    assert got == reading and seen == [("GET", "/metrics", "")]


# ---- leave and drain, rejoin: the virtual clock --------------------------------------------


class Counts:
    """The HTTP side of a drained server: the leave and rejoin calls and the in-flight read,
    which answers the next of `inflight` each time (the last one for ever); `leave`: the leave's
    status line."""

    def __init__(self, inflight: list[str], leave: str = "200 OK"):
        self.inflight, self.leave = inflight, leave

    def __call__(self, method: str, path: str) -> tuple[str, str]:
        if path == "/metrics":
            value = self.inflight.pop(0) if len(self.inflight) > 1 else self.inflight[0]
            return ("500 Internal Server Error", "") if value == "500" else ("200 OK",
                                                                             f"sglang:num_running_reqs {value}\n")
        return (self.leave, "no") if path == "/leave" else ("200 OK", "")


def drain_spec(srv: Http, *, inflight: bool = True, timeout: float = 10.0, interval: float = 1.0,
               serving: CallSpec | None = None, rejoin: CallSpec | None = None) -> DrainSpec:
    return DrainSpec(CallSpec("http", srv.url("/leave")), rejoin or CallSpec("http", srv.url("/rejoin")), serving,
                     InflightSpec(srv.url("/metrics"), "sglang:num_running_reqs") if inflight else None,
                     timeout, interval)


def drain(answers: Counts, **spec: Any) -> tuple[Drained, list[str], list[float], float]:
    """leave_and_drain on the virtual clock: what it returned, the paths asked, the sleeps, the
    virtual seconds it took."""
    async def main() -> tuple[Drained, list[str], list[float], float]:
        clock = FakeClock()
        async with http(answers) as srv:
            out = await rotation.leave_and_drain(T, drain_spec(srv, **spec), clock=clock)
            return out, [p for _, p, _ in srv.seen], clock.slept, clock.elapsed()
    return run(main())


def test_the_drain_waits_until_two_reads_in_a_row_say_nothing_is_in_flight():
    out, asked, slept, took = drain(Counts(["3", "1", "0", "0"]))
    assert out == Drained(True, "no work in flight after 3.0s", 0.0, 3.0, None)
    assert asked == ["/leave", "/metrics", "/metrics", "/metrics", "/metrics"]
    assert slept == [1.0, 1.0, 1.0] and took == 3.0


def test_a_drain_that_times_out_says_what_was_still_in_flight():
    out, asked, slept, _ = drain(Counts(["2"]), timeout=5.0, interval=2.0)
    assert out == Drained(True, "2 still in flight after the drain timeout (5s): stopping anyway", 0.0, 5.0, 2.0)
    assert slept == [2.0, 2.0, 1.0] and asked.count("/metrics") == 4       # at 0, 2, 4 and at the timeout, 5


def test_a_drain_whose_reads_fail_times_out_saying_why():
    out, _, _, took = drain(Counts(["500"]), timeout=3.0)
    assert out == Drained(True, "in-flight work could not be read within the drain timeout (3s): HTTP 500",
                          0.0, 3.0, None)
    assert took == 3.0


def test_a_drain_without_an_in_flight_read_is_a_fixed_wait():
    out, asked, slept, took = drain(Counts(["9"]), inflight=False, timeout=4.0)
    assert out == Drained(True, "waited 4s (no in-flight read declared)", 0.0, 4.0, None)
    assert asked == ["/leave"] and slept == [4.0] and took == 4.0


def test_a_leave_that_fails_reads_nothing_and_says_why():
    out, asked, slept, _ = drain(Counts(["0"], leave="503 Service Unavailable"))
    assert not out.left and asked == ["/leave"] and slept == []
    assert out.message.startswith("could not leave rotation (POST http://127.0.0.1:")
    assert out.message.endswith("/leave (from the host)): HTTP 503: no")


def test_leave_by_haproxy_then_drain(tmp_path):
    async def main() -> tuple[Drained, list[str]]:
        clock = FakeClock()
        async with runtime_api(tmp_path, lambda line: ""), http(Counts(["1", "0", "0"])) as srv:
            api_path = str(tmp_path / "admin.sock")
            d = DrainSpec(CallSpec("haproxy", api_path, input="set server qwen/gpu-1 state drain"),
                          CallSpec("haproxy", api_path, input="set server qwen/gpu-1 state ready"),
                          inflight=InflightSpec(srv.url("/metrics"), "sglang:num_running_reqs"), interval=0.5)
            return await rotation.leave_and_drain(T, d, clock=clock), [p for _, p, _ in srv.seen]
    out, asked = run(main())
    assert out == Drained(True, "no work in flight after 1.0s", 0.0, 1.0, None) and asked == ["/metrics"] * 3


def rejoin(tmp_path: Path, states: list[str], *, serving: bool = True, set_answer: str = "",
           timeout: float = 1.0) -> tuple[Rejoined, list[str], list[float]]:
    """rejoin on the virtual clock against the runtime API: `show stat` answers the next of
    `states` each time (the last one for ever)."""
    def answer(line: str) -> str:
        if line == "show stat":
            return stat(states.pop(0) if len(states) > 1 else states[0])
        return set_answer

    async def main() -> tuple[Rejoined, list[str], list[float]]:
        clock = FakeClock()
        async with runtime_api(tmp_path, answer) as api:
            d = DrainSpec(CallSpec("haproxy", api.path, input="set server qwen/gpu-1 state drain"),
                          CallSpec("haproxy", api.path, input="set server qwen/gpu-1 state ready"),
                          CallSpec("haproxy", api.path, input="show stat", server="qwen/gpu-1") if serving else None,
                          timeout=timeout)
            out = await rotation.rejoin(T, d, clock=clock, every=0.25)
            return out, [x.rstrip("\n") for x in api.lines], clock.slept
    return run(main())


def test_a_rejoin_waits_until_the_balancer_serves_the_host_again(tmp_path):
    out, lines, slept = rejoin(tmp_path, ["MAINT", "DOWN 1/2", "UP"])
    assert out == Rejoined(True, "serving again: qwen/gpu-1: UP", 0.0, 0.5)
    assert lines == ["set server qwen/gpu-1 state ready", "show stat", "show stat", "show stat"]
    assert slept == [0.25, 0.25]


def test_a_rejoin_the_balancer_never_serves_times_out_at_the_drain_timeout(tmp_path):
    out, lines, _ = rejoin(tmp_path, ["MAINT"], timeout=1.0)
    assert out == Rejoined(False, "not serving within 1s of the rejoin: qwen/gpu-1: MAINT", 0.0, 1.0)
    assert lines.count("show stat") == 5                    # at 0, 0.25, 0.5, 0.75 and 1.0


def test_a_rejoin_without_serving_declared_is_back_once_the_call_is_taken(tmp_path):
    out, lines, slept = rejoin(tmp_path, ["UP"], serving=False)
    assert out == Rejoined(True, "back in rotation", 0.0, 0.0)
    assert lines == ["set server qwen/gpu-1 state ready"] and slept == []


def test_a_rejoin_the_balancer_refuses_says_why_and_asks_nothing_more(tmp_path):
    out, lines, _ = rejoin(tmp_path, ["UP"], set_answer="No such server.\n")
    assert out == Rejoined(False, f"could not rejoin rotation (HAProxy {tmp_path / 'admin.sock'}: set server "
                                  f"qwen/gpu-1 state ready): No such server.", 0.0, 0.0)
    assert lines == ["set server qwen/gpu-1 state ready"]


def test_serving_asks_the_balancer_when_it_can_be_asked(tmp_path):
    async def main() -> tuple[bool | None, bool | None, bool | None]:
        state = ["UP"]
        async with runtime_api(tmp_path, lambda line: stat(state[0])) as api:
            leave = CallSpec("haproxy", api.path, input="set server qwen/gpu-1 state drain")
            ask = CallSpec("haproxy", api.path, input="show stat", server="qwen/gpu-1")
            up = await rotation.serving(T, DrainSpec(leave, leave, ask))
            state[0] = "DRAIN"
            drained = await rotation.serving(T, DrainSpec(leave, leave, ask))
            unknown = await rotation.serving(T, DrainSpec(leave, leave))
        return up, drained, unknown
    assert run(main()) == (True, False, None)

