"""PURE: what says a server is ready, by engine and release (plan/ready.py), the /v1/models body
check, and how one probe's answer is judged and named; loop/preflight.py `ready_probes`, which
reads the server from the unit and the version from the pre-flight."""

from __future__ import annotations

import json

import pytest

from reconciler.desired.spec import HealthSpec, ServiceSpec
from reconciler.loop.preflight import ready_probes
from reconciler.plan.ready import (
    MODELS_BODY_MAX,
    Probe,
    describe,
    failed,
    lists_a_model,
    readiness_probes,
    ready_detail,
)

HEALTH = HealthSpec(http="http://127.0.0.1:8000/health")
OWN = Probe("http://127.0.0.1:8000/health")
READY = Probe("http://127.0.0.1:8000/ready")
VLLM = (Probe("http://127.0.0.1:8000/health"), Probe("http://127.0.0.1:8000/v1/models", models=True))


@pytest.mark.parametrize("server,version,health,probes", [
    ("sglang", "0.5.20", HEALTH, (READY,)),
    ("sglang", "0.5.23.post1", HEALTH, (READY,)),
    ("sglang", "0.6.0rc1", HEALTH, (READY,)),
    ("sglang", "0.5.19", HEALTH, (OWN,)),                   # no /ready before 0.5.20
    ("sglang", "0.5.12", HEALTH, (OWN,)),
    ("sglang", None, HEALTH, (OWN,)),                       # version not read: the service's own
    ("sglang", "garbage", HEALTH, (OWN,)),
    ("vllm", None, HEALTH, VLLM),                           # any release
    ("vllm", "0.11.0", HEALTH, VLLM),
    (None, None, HEALTH, (OWN,)),                           # a server we do not know
    ("sglang", "0.5.20", HealthSpec(), ()),                 # no health URL: systemd's state alone
    ("vllm", None, HealthSpec(http="http://{host.address}:8000/health"),           # not rendered: its own
     (Probe("http://{host.address}:8000/health"),)),
    (None, None, HealthSpec(http="http://127.0.0.1:8000/h", expect_status=204, body_contains="ok"),
     (Probe("http://127.0.0.1:8000/h", status=204, contains="ok"),)),
    ("sglang", "0.5.20", HealthSpec(http="https://127.0.0.1:8443/health?x=1"), (Probe("https://127.0.0.1:8443/ready"),)),
])
def test_readiness_probes(server, version, health, probes):
    assert readiness_probes(server, version, health) == probes


MODEL = {"object": "list", "data": [{"id": "m", "object": "model"}]}


@pytest.mark.parametrize("body,lists", [
    (json.dumps(MODEL), True),
    (json.dumps({"data": [{"id": ""}, {"id": "m2"}]}), True),
    (json.dumps({"object": "list", "data": []}), False),     # up, and no model loaded
    (json.dumps({"data": [{"id": ""}]}), False),
    (json.dumps({"data": [{"name": "m"}]}), False),
    (json.dumps({"data": [{"id": 7}]}), False),
    (json.dumps({"data": ["m"]}), False),
    (json.dumps({"data": {"id": "m"}}), False),
    (json.dumps([MODEL]), False),
    (json.dumps("m"), False),
    ("", False),
    ("{\"data\": [", False),                                   # cut short
    ("not json", False),
    ("[" * 100_000, False),                                    # too deep: bounded, no RecursionError
    ("[" * 2000 + "]" * 2000, False),                          # deep and valid, still no model
    (json.dumps({"data": [{"id": "m", "pad": "x" * MODELS_BODY_MAX}]}), False),   # over the bound
    ("NaN", False),
])
def test_lists_a_model(body, lists):
    assert lists_a_model(body) is lists


@pytest.mark.parametrize("probe,status,body,why", [
    (READY, 200, "", None),
    (READY, 503, "", "http://127.0.0.1:8000/ready answered 503"),
    (READY, None, "connect: ConnectError: refused", "http://127.0.0.1:8000/ready did not answer "
                                                    "(connect: ConnectError: refused)"),
    (VLLM[1], 200, json.dumps(MODEL), None),
    (VLLM[1], 200, json.dumps({"data": []}), "http://127.0.0.1:8000/v1/models lists no model"),
    (VLLM[1], 200, "<html>", "http://127.0.0.1:8000/v1/models lists no model"),
    (VLLM[1], 404, json.dumps(MODEL), "http://127.0.0.1:8000/v1/models answered 404"),
    (Probe("http://127.0.0.1:8000/h", status=204, contains="ok"), 204, "all ok", None),
    (Probe("http://127.0.0.1:8000/h", status=204, contains="ok"), 200, "ok", "http://127.0.0.1:8000/h answered 200, "
                                                                             "not 204"),
    (Probe("http://127.0.0.1:8000/h", contains="ok"), 200, "bad", "http://127.0.0.1:8000/h answered 200 without 'ok'"),
])
def test_failed_names_the_probe_and_what_it_said(probe, status, body, why):
    assert failed(probe, status, body) == why


@pytest.mark.parametrize("probes,text", [
    ((READY,), "GET /ready"),
    (VLLM, "GET /health, then GET /v1/models (a model listed)"),
    ((Probe("http://127.0.0.1:8000/h", status=204),), "GET /h (204)"),
    ((), "systemd's state"),
])
def test_describe(probes, text):
    assert describe(probes) == text


@pytest.mark.parametrize("probes,text", [
    ((READY,), "GET /ready at http://127.0.0.1:8000, then stable for 30s"),
    (VLLM, "GET /health, then GET /v1/models (a model listed) at http://127.0.0.1:8000, then stable for 30s"),
    ((), "systemd's state, then stable for 30s"),
])
def test_ready_detail_for_a_dry_run(probes, text):
    assert ready_detail(probes, HEALTH) == text


SGLANG = "[Service]\nExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /m --port 8000\n"
VLLM_UNIT = "[Service]\nExecStart=/opt/vllm/bin/vllm serve /m --port 8000\n"
PLAIN = "[Service]\nExecStart=/usr/bin/sleep infinity\n"


@pytest.mark.parametrize("unit,versions,probes,noted", [
    (SGLANG, {"m": "0.5.20"}, (READY,), False),
    (SGLANG, {"m": "0.5.12"}, (OWN,), False),
    (SGLANG, {"m": None}, (OWN,), True),          # read, and not known
    (SGLANG, {}, (OWN,), True),                   # not read (no pre-flight this pass)
    (VLLM_UNIT, {}, VLLM, False),
    (PLAIN, {}, (OWN,), False),
])
def test_ready_probes_from_the_unit_and_the_version_read(unit, versions, probes, noted):
    svc = ServiceSpec("m", unit, health=HEALTH)
    got, note = ready_probes(svc, None, versions)
    assert got == probes
    assert note == ("m: the installed sglang version was not read: ready is judged by its health.http "
                    "(http://127.0.0.1:8000/health), not by /ready (SGLang 0.5.20 and later)" if noted else None)
