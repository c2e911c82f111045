"""plan/drain.py: the steps of a host's restart with and without a drain (tables), the drain's
wait for in-flight work, and the readings it waits on (the engines' /metrics, HAProxy's stats)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.desired.spec import (
    CallSpec,
    DrainSpec,
    HealthSpec,
    InflightSpec,
    ServiceSpec,
    SmokeCheck,
    SmokeSpec,
)
from reconciler.plan.drain import (
    DrainDecision,
    DrainState,
    Reading,
    ServerStat,
    StepKind,
    drain_decision,
    inflight_of,
    parse_show_stat,
    restart_steps,
)
from reconciler.values import replace

HAPROXY = DrainSpec(
    leave=CallSpec("haproxy", "/run/haproxy/admin.sock", input="set server models/h1 state drain", server="models/h1",
                   timeout=10.0),
    rejoin=CallSpec("haproxy", "/run/haproxy/admin.sock", input="set server models/h1 state ready", server="models/h1",
                    timeout=10.0),
    serving=CallSpec("haproxy", "/run/haproxy/admin.sock", input="show stat", server="models/h1", timeout=10.0),
    inflight=InflightSpec("http://127.0.0.21:30000/metrics", "sglang:num_running_reqs"), timeout=60.0)
SMOKE = SmokeSpec("http://127.0.0.21:30000/v1", (SmokeCheck("completion", "The capital of France is", "Paris"),),
                  ttft=5.0, timeout=30.0)
BASE = ServiceSpec("qwen", "[Service]\nExecStart=/bin/true\n",
                   health=HealthSpec(http="http://127.0.0.21:30000/health", startup_timeout=600, stable_for=10))
FULL = replace(BASE, drain=HAPROXY, smoke=SMOKE)
K = StepKind


@pytest.mark.parametrize(("spec", "kw", "want"), [
    # today's restart: no drain, no smoke
    (BASE, {}, [K.STOP, K.START, K.READY]),
    (BASE, {"gpu_gate": True}, [K.STOP, K.WAIT_GPUS, K.START, K.READY]),
    # a first start: nothing runs, nothing to stop
    (BASE, {"running": False}, [K.START, K.READY]),
    # a smoke test alone judges before the restart counts as done
    (replace(BASE, smoke=SMOKE), {}, [K.STOP, K.START, K.READY, K.SMOKE]),
    # the whole drain: out of rotation, drained, restarted, judged, back, and serving again
    (FULL, {}, [K.LEAVE, K.DRAIN, K.STOP, K.START, K.READY, K.SMOKE, K.REJOIN, K.SERVING]),
    (FULL, {"gpu_gate": True}, [K.LEAVE, K.DRAIN, K.STOP, K.WAIT_GPUS, K.START, K.READY, K.SMOKE, K.REJOIN,
                                K.SERVING]),
    # a rollback of a server that failed its smoke test: it never rejoined, so no leave, no drain
    (FULL, {"in_rotation": False, "rollback": True}, [K.STOP, K.START, K.READY, K.SMOKE, K.REJOIN, K.SERVING]),
    # a new service with a drain: it joins rotation once judged
    (FULL, {"running": False}, [K.START, K.READY, K.SMOKE, K.REJOIN, K.SERVING]),
    # a drain whose balancer cannot be asked whether it serves: rejoin is the last step
    (replace(FULL, drain=replace(HAPROXY, serving=None)), {}, [K.LEAVE, K.DRAIN, K.STOP, K.START, K.READY, K.SMOKE,
                                                               K.REJOIN]),
])
def test_restart_steps(spec: ServiceSpec, kw: dict[str, bool], want: list[StepKind]) -> None:
    assert [s.kind for s in restart_steps(spec, **kw)] == want


def test_the_steps_as_a_dry_run_prints_them() -> None:
    assert [s.describe() for s in restart_steps(FULL, rollback=True)] == [
        "leave: HAProxy /run/haproxy/admin.sock: set server models/h1 state drain (at most 10s)",
        "drain: wait for sglang:num_running_reqs at http://127.0.0.21:30000/metrics to reach 0, read every 1s "
        "(at most 60s)",
        "stop: systemctl stop qwen.service",
        "start: systemctl start qwen.service (the last good version)",
        "ready: http://127.0.0.21:30000/health healthy, then stable for 10s (at most 600s)",
        "smoke: 1 greedy answer from http://127.0.0.21:30000/v1, first token within 5s (at most 30s)",
        "rejoin: HAProxy /run/haproxy/admin.sock: set server models/h1 state ready (at most 10s)",
        "serving: until HAProxy /run/haproxy/admin.sock: show stat says it is in rotation (at most 60s)",
    ]



# ---- the wait -------------------------------------------------------------------------------

D = HAPROXY            # timeout 60, interval 1


@pytest.mark.parametrize(("readings", "now", "want"), [
    ([], 0.0, DrainDecision(DrainState.WAITING, 1.0)),
    ([Reading(0.0, 3)], 1.0, DrainDecision(DrainState.WAITING, 1.0)),
    # one zero may race a request forwarded just before the leave: a second one settles it
    ([Reading(0.0, 3), Reading(1.0, 0)], 1.0, DrainDecision(DrainState.WAITING, 1.0)),
    ([Reading(1.0, 0), Reading(2.0, 0)], 2.0, DrainDecision(DrainState.DRAINED, 0.0,
                                                            "no work in flight after 2.0s")),
    ([Reading(1.0, 0), Reading(2.0, 1), Reading(3.0, 0)], 3.0, DrainDecision(DrainState.WAITING, 1.0)),
    # the last wait never runs past the timeout
    ([Reading(59.5, 2)], 59.5, DrainDecision(DrainState.WAITING, 0.5)),
    ([Reading(59.0, 2), Reading(60.0, 1)], 60.0,
     DrainDecision(DrainState.TIMED_OUT, 0.0, "1 still in flight after the drain timeout (60s): stopping anyway")),
    # an unreadable read is waited through, and named if nothing else came back
    ([Reading(1.0, None, "connection refused"), Reading(2.0, 0), Reading(3.0, 0)], 3.0,
     DrainDecision(DrainState.DRAINED, 0.0, "no work in flight after 3.0s")),
    ([Reading(59.0, None, "HTTP 404"), Reading(60.0, None, "HTTP 404")], 60.0,
     DrainDecision(DrainState.TIMED_OUT, 0.0, "in-flight work could not be read within the drain timeout (60s): "
                                              "HTTP 404")),
    ([Reading(30.0, 4), Reading(60.0, None, "timed out")], 61.0,
     DrainDecision(DrainState.TIMED_OUT, 0.0, "4 still in flight after the drain timeout (60s): stopping anyway")),
])
def test_drain_decision(readings: list[Reading], now: float, want: DrainDecision) -> None:
    assert drain_decision(D, readings, now) == want


def test_without_an_inflight_read_the_drain_is_a_fixed_wait() -> None:
    d = replace(D, inflight=None, timeout=20.0)
    assert drain_decision(d, [], 5.0) == DrainDecision(DrainState.WAITING, 15.0)
    assert drain_decision(d, [], 20.0) == DrainDecision(DrainState.DRAINED, 0.0,
                                                        "waited 20s (no in-flight read declared)")


# ---- readings -------------------------------------------------------------------------------

SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",tp_rank="0"} 3.0
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",tp_rank="1"} 2.0
sglang:num_running_reqs_offline_batch{model_name="Qwen/Qwen3-8B"} 40.0
sglang:num_queue_reqs{model_name="Qwen/Qwen3-8B"} 7.0
"""
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 0.0
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 0.0
"""


@pytest.mark.parametrize(("body", "metric", "want"), [
    (SGLANG_METRICS, "sglang:num_running_reqs", 5.0),       # summed over ranks; not the _offline_batch one
    (VLLM_METRICS, "vllm:num_requests_running", 0.0),
    (VLLM_METRICS, "sglang:num_running_reqs", None),        # not there: the read says nothing
    ("plain_metric 4\n", "plain_metric", 4.0),
    ("m{a=\"1\"} NaN\n", "m", None),
    ("m{a=\"1\"} -1\n", "m", None),
    ("m{a=\"1\" 3\n", "m", None),
    ("m{a=\"1\"} 2 1700000000000\n", "m", 2.0),             # with a timestamp
    ("  7\n", None, 7.0),                                    # a URL that answers a number
    ("seven", None, None),
    ("", None, None),
])
def test_inflight_of(body: str, metric: str | None, want: float | None) -> None:
    assert inflight_of(body, metric) == want


@settings(max_examples=300, deadline=None)
@given(body=st.text(), metric=st.one_of(st.none(), st.sampled_from(["m", "sglang:num_running_reqs"])))
def test_inflight_of_is_total(body: str, metric: str | None) -> None:
    got = inflight_of(body, metric)
    assert got is None or (math.isfinite(got) and got >= 0)


SHOW_STAT = """\
# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,weight
models,FRONTEND,,,4,9,3000,120,0,0,0,0,0,,,,,OPEN,
models,h1,0,0,2,5,,40,0,0,,0,,0,0,0,0,UP,1
models,h2,0,0,0,3,,38,0,0,,0,,0,0,0,0,DRAIN,1
models,h3,0,0,0,3,,38,0,0,,0,,0,0,0,0,DOWN 1/2,1
models,h4,0,0,1,3,,38,0,0,,0,,0,0,0,0,UP 1/3,1
models,h5,0,0,0,0,,0,0,0,,0,,0,0,0,0,MAINT,1
models,h6,0,0,0,0,,0,0,0,,0,,0,0,0,0,no check,1
models,BACKEND,0,0,3,9,300,120,0,0,0,0,,0,0,0,0,UP,5
"""


def test_parse_show_stat_keeps_servers_and_their_rotation() -> None:
    stats = parse_show_stat(SHOW_STAT)
    assert stats == {"models/h1": ServerStat("UP", 2), "models/h2": ServerStat("DRAIN", 0),
                     "models/h3": ServerStat("DOWN 1/2", 0), "models/h4": ServerStat("UP 1/3", 1),
                     "models/h5": ServerStat("MAINT", 0), "models/h6": ServerStat("no check", 0)}
    assert sorted(k for k, v in stats.items() if v.serving) == ["models/h1", "models/h4", "models/h6"]


@pytest.mark.parametrize("text", ["", "pxname,svname\n", "# a,b,c\nx,y,z\n", "# pxname,svname,status\nm,h1\n"])
def test_parse_show_stat_of_something_else_is_empty(text: str) -> None:
    assert parse_show_stat(text) == {}
