"""One host's cutover around a restart (reconciler/loop/cutover.py, issue 42): the drain before
the apply script, the smoke test after a healthy verdict, the rejoin, and the step times each
measured (what the git note, the fleet page and the next forecast read), on the virtual clock.

Real parts as in tests/host/test_rotation.py: LocalTransport (the drain's `host` calls run in
bash here; its HTTP goes to a server on 127.0.0.1 that records what it was asked)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from reconciler.desired.spec import CallSpec, DrainSpec, InflightSpec, ServiceSpec, SmokeCheck, SmokeSpec
from reconciler.host.health import Outcome
from reconciler.host.transport import LocalTransport
from reconciler.loop.cutover import Cutover, DrainError
from reconciler.plan.model import Action, HostPlan, Kind, ServicePlan, State, Target
from reconciler.reasons import Reason
from tests.clock import FakeClock
from tests.host.test_rotation import http

REV = "r" * 40


def host_drain(tmp_path: Path, *, leave: str = "", rejoin: str = "", timeout: float = 2.0,
               inflight: InflightSpec | None = None, serving: CallSpec | None = None) -> DrainSpec:
    """A drain whose leave and rejoin are shell lines on the host that note themselves in
    tmp_path/calls (and then run `leave` / `rejoin`)."""
    calls = tmp_path / "calls"
    return DrainSpec(CallSpec("host", f"echo leave >> {calls}; {leave or 'true'}"),
                     CallSpec("host", f"echo rejoin >> {calls}; {rejoin or 'true'}"), serving, inflight, timeout, 1.0)


def calls(tmp_path: Path) -> list[str]:
    f = tmp_path / "calls"
    return f.read_text().split() if f.exists() else []


def recorded_leave(tmp_path: Path, name: str = "qwen") -> dict[str, Any] | None:
    """The leave of rotation recorded on the host (NAME.left under the cutover's rotation_dir),
    without its time; None when there is none."""
    f = tmp_path / f"{name}.left"
    if not f.exists():
        return None
    assert f.stat().st_mode & 0o777 == 0o600          # root's alone
    data = json.loads(f.read_text())
    assert isinstance(data.pop("at"), int)
    return dict(data)


def spec(name: str, drain: DrainSpec | None, smoke: SmokeSpec | None = None) -> ServiceSpec:
    return ServiceSpec(name, "[Service]\nExecStart=/bin/true\n", drain=drain, smoke=smoke)


def plan(specs: list[ServiceSpec], *actions: tuple[Kind, str]) -> HostPlan:
    services = {s.name: ServicePlan(s.name, State.CHANGED, Target(s, REV)) for s in specs}
    return HostPlan("gpu-1", REV, tuple(Action(k, Reason.UNIT_CHANGED, n) for k, n in actions), services)


def healthy(name: str, seconds: float) -> Outcome:
    return Outcome(name, True, Reason.HEALTHY, f"healthy after {seconds:g}s", seconds=seconds)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_restart_with_a_drain_measures_each_step_and_says_what_it_cost(tmp_path):
    s = spec("qwen", host_drain(tmp_path, timeout=2.0))
    p = plan([s], (Kind.RESTART, "qwen"))

    async def main() -> tuple[Cutover, Outcome, str | None, float]:
        clock = FakeClock()
        c = Cutover(LocalTransport("gpu-1"), clock=clock, rotation_dir=str(tmp_path))
        await c.drain(p)                    # leave, then a fixed wait of the drain timeout (no in-flight read)
        assert c.left == {"qwen"} and calls(tmp_path) == ["leave"]
        assert recorded_leave(tmp_path) == {"revision": REV}     # recorded on the host until the rejoin
        await clock.sleep(3.5)              # the apply script: its stop and start
        c.applied(p)
        out = await c.judge(s, healthy("qwen", 40.0))
        back = await c.rejoin(s)
        return c, out, back, clock.elapsed()
    c, out, back, took = run(main())
    assert out == healthy("qwen", 40.0) and back is None and took == 5.5
    assert c.measured("qwen") == {"leave": 0.0, "drain": 2.0, "stop": 3.5, "start": 0.0, "ready": 40.0,
                                  "rejoin": 0.0}
    assert list(c.steps["qwen"]) == ["leave", "drain", "stop", "start", "ready", "rejoin"]
    assert c.left == set() and c.failed_requests == {} and calls(tmp_path) == ["leave", "rejoin"]
    assert recorded_leave(tmp_path) is None
    assert c.notes == ["qwen: left rotation; waited 2s (no in-flight read declared)",
                       "qwen: back in rotation; unavailable 45.5s"]


def test_the_gpu_gate_between_stop_and_start_is_inside_the_stop(tmp_path):
    s = spec("qwen", host_drain(tmp_path, timeout=1.0))
    p = plan([s], (Kind.STOP, "qwen"), (Kind.WAIT_GPUS, "qwen"), (Kind.START, "qwen"))

    async def main() -> dict[str, float]:
        clock = FakeClock()
        c = Cutover(LocalTransport("gpu-1"), clock=clock, rotation_dir=str(tmp_path))
        await c.drain(p)
        await clock.sleep(7.0)
        c.applied(p)
        return c.measured("qwen")
    assert run(main()) == {"leave": 0.0, "drain": 1.0, "stop": 7.0, "start": 0.0, "wait-gpus": 0.0}


def test_a_drain_that_times_out_keeps_what_was_still_in_flight(tmp_path):
    async def main() -> Cutover:
        clock = FakeClock()
        async with http(lambda m, path: ("200 OK", "sglang:num_running_reqs 2\n")) as srv:
            s = spec("qwen", host_drain(tmp_path, timeout=3.0,
                                        inflight=InflightSpec(srv.url("/metrics"), "sglang:num_running_reqs")))
            c = Cutover(LocalTransport("gpu-1"), clock=clock, rotation_dir=str(tmp_path))
            await c.drain(plan([s], (Kind.RESTART, "qwen")))
        return c
    c = run(main())
    assert c.failed_requests == {"qwen": 2.0} and c.measured("qwen") == {"leave": 0.0, "drain": 3.0}
    assert c.notes == ["qwen: left rotation; 2 still in flight after the drain timeout (3s): stopping anyway"]


def test_a_leave_that_fails_stops_the_run_before_anything_stopped(tmp_path):
    s = spec("qwen", host_drain(tmp_path, leave="echo 'balancer socket: permission denied' >&2; exit 3"))
    c = Cutover(LocalTransport("gpu-1"), clock=FakeClock(), rotation_dir=str(tmp_path))
    with pytest.raises(DrainError) as e:
        run(c.drain(plan([s], (Kind.RESTART, "qwen"))))
    assert e.value.reason is Reason.DRAIN_FAILED and e.value.host == "gpu-1"
    assert e.value.message == ("qwen: could not leave rotation (run on the host: echo leave >> "
                               f"{tmp_path / 'calls'}; echo 'balancer socket: permission denied' >&2; exit 3): "
                               "exit 3: balancer socket: permission denied; nothing was stopped")
    assert c.left == set() and c.stopping == {} and c.measured("qwen") == {"leave": 0.0}
    # recorded before the leave was asked: a leave that half happened is put back by the next run
    assert recorded_leave(tmp_path) == {"revision": REV}


def test_a_service_leaves_rotation_once_per_run_and_one_without_a_drain_never(tmp_path):
    """The rollback's plan stops the same service again: it is out of rotation already, so it is
    not asked to leave again, but its stop is measured again. A service with no drain declared
    and one only started (it was not running) are not drained."""
    s, plain, new = spec("qwen", host_drain(tmp_path, timeout=1.0)), spec("plain", None), spec("new", None)
    p = plan([s, plain, new], (Kind.RESTART, "qwen"), (Kind.RESTART, "plain"), (Kind.START, "new"))

    async def main() -> Cutover:
        clock = FakeClock()
        c = Cutover(LocalTransport("gpu-1"), clock=clock, rotation_dir=str(tmp_path))
        await c.drain(p)
        await clock.sleep(2.0)
        c.applied(p)
        await c.drain(p)                    # the rollback's round
        await clock.sleep(4.0)
        c.applied(p)
        return c
    c = run(main())
    assert calls(tmp_path) == ["leave"] and c.left == {"qwen"}
    assert c.measured("qwen") == {"leave": 0.0, "drain": 1.0, "stop": 4.0, "start": 0.0}
    assert "plain" not in c.steps and "new" not in c.steps


def test_a_verdict_that_is_not_healthy_is_not_judged_and_measures_no_ready(tmp_path):
    s = spec("qwen", host_drain(tmp_path), SmokeSpec("http://127.0.0.1:9/v1", (SmokeCheck("completion", "1+1=", "2"),)))
    bad = Outcome("qwen", False, Reason.CRASH_LOOP, "NRestarts went from 0 to 3", "Traceback", seconds=12.0)
    c = Cutover(LocalTransport("gpu-1"), clock=FakeClock(), rotation_dir=str(tmp_path))
    assert run(c.judge(s, bad)) is bad and c.steps == {}


def smoke_server(answer: str) -> Any:
    def reply(method: str, path: str) -> tuple[str, str]:
        return "200 OK", json.dumps({"choices": [{"text": answer}]})
    return http(reply)


@pytest.mark.parametrize(("answer", "healthy_after", "reason"), [
    (" 2", True, Reason.HEALTHY),
    (" 3", False, Reason.WRONG_ANSWER),
])
def test_a_healthy_verdict_is_judged_by_the_smoke_test_and_both_are_measured(tmp_path, answer, healthy_after, reason):
    async def main() -> tuple[Cutover, Outcome, list[tuple[str, str, str]]]:
        async with smoke_server(answer) as srv:
            s = spec("qwen", host_drain(tmp_path), SmokeSpec(srv.url("/v1"), (SmokeCheck("completion", "1+1=", "2"),),
                                                            model="qwen"))
            c = Cutover(LocalTransport("gpu-1"), clock=FakeClock(), rotation_dir=str(tmp_path))
            return c, await c.judge(s, healthy("qwen", 30.0)), srv.seen
    c, out, seen = run(main())
    assert [(m, p) for m, p, _ in seen] == [("POST", "/v1/completions")]
    assert c.measured("qwen") == {"ready": 30.0, "smoke": 0.0}
    assert (out.healthy, out.reason) == (healthy_after, reason)
    if healthy_after:
        assert out.message == "healthy after 30s; smoke test: 1 answer as expected"
    else:
        assert out.quote == " 3"
        assert "expected the answer to contain '2', got ' 3'" in out.message


def test_a_rejoin_that_fails_keeps_the_service_out_and_says_why(tmp_path):
    s = spec("qwen", host_drain(tmp_path, timeout=1.0, rejoin="echo 'no such server' >&2; exit 1"))
    p = plan([s], (Kind.RESTART, "qwen"))

    async def main() -> tuple[Cutover, str | None]:
        c = Cutover(LocalTransport("gpu-1"), clock=FakeClock(), rotation_dir=str(tmp_path))
        await c.drain(p)
        c.applied(p)
        return c, await c.rejoin(s)
    c, back = run(main())
    assert back is not None and back.startswith("could not rejoin rotation (run on the host: echo rejoin >> ")
    assert back.endswith("exit 1: no such server")
    assert c.left == {"qwen"} and "rejoin" in c.steps["qwen"]
    assert not any("back in rotation" in n for n in c.notes)
    assert recorded_leave(tmp_path) == {"revision": REV}      # still out: the next run tries again


def test_a_rejoin_with_serving_declared_measures_until_the_balancer_serves(tmp_path):
    serving = CallSpec("host", f"test -e {tmp_path / 'up'} || {{ touch {tmp_path / 'up'}; exit 1; }}")
    s = spec("qwen", host_drain(tmp_path, timeout=5.0, serving=serving))

    async def main() -> tuple[Cutover, str | None]:
        c = Cutover(LocalTransport("gpu-1"), clock=FakeClock(), rotation_dir=str(tmp_path))
        return c, await c.rejoin(s)
    c, back = run(main())
    assert back is None and c.measured("qwen") == {"rejoin": 0.0, "serving": 0.2}
    assert c.notes == ["qwen: serving again: exit 0:; unavailable 0.2s"]


def test_a_service_without_a_drain_rejoins_nothing(tmp_path):
    c = Cutover(LocalTransport("gpu-1"), clock=FakeClock(), rotation_dir=str(tmp_path))
    assert run(c.rejoin(spec("plain", None))) is None and c.steps == {} and c.notes == []


def rejoin_plan(s: ServiceSpec) -> HostPlan:
    """A plan whose one step is the REJOIN of a leave a killed run recorded (plan/rejoin.py)."""
    return HostPlan("gpu-1", REV, (Action(Kind.REJOIN, Reason.LEFT_ROTATION, s.name),),
                    {s.name: ServicePlan(s.name, State.IN_SYNC, Target(s, REV))})


def test_a_recorded_leave_rejoins_without_a_restart_and_its_record_goes(tmp_path):
    s = spec("qwen", host_drain(tmp_path))
    (tmp_path / "qwen.left").write_text(json.dumps({"revision": REV, "at": 1}))
    c = Cutover(LocalTransport("gpu-1"), clock=FakeClock(), rotation_dir=str(tmp_path))
    assert run(c.rejoin_recorded(rejoin_plan(s))) == []
    assert calls(tmp_path) == ["rejoin"] and recorded_leave(tmp_path) is None
    assert c.steps == {}                                       # no restart: no restart's cost
    assert c.notes == ["qwen: back in rotation (left by a run that did not finish; not restarted)"]


def test_a_recorded_leave_whose_rejoin_fails_stays_recorded(tmp_path):
    s = spec("qwen", host_drain(tmp_path, rejoin="echo 'no such server' >&2; exit 1"))
    (tmp_path / "qwen.left").write_text(json.dumps({"revision": REV, "at": 1}))
    c = Cutover(LocalTransport("gpu-1"), clock=FakeClock(), rotation_dir=str(tmp_path))
    [why] = run(c.rejoin_recorded(rejoin_plan(s)))
    assert why.startswith("qwen: could not rejoin rotation (run on the host: echo rejoin >> ")
    assert why.endswith("exit 1: no such server; still out of rotation (its leave stays recorded)")
    assert (tmp_path / "qwen.left").exists() and c.steps == {} and c.notes == []
