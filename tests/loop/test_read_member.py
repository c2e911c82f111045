"""A member of a min_available group read without a health URL (loop/waves.read_member): systemd's
ActiveState, read by the show program (reconciler/sh/show.sh), is what says it is up."""

from __future__ import annotations

import asyncio

import pytest

from reconciler.desired.spec import CallSpec, DrainSpec, HealthSpec, ServiceSpec
from reconciler.host.transport import Completed
from reconciler.loop.waves import read_member
from reconciler.plan.budget import Member
from reconciler.plan.drain import a_preview_may_ask
from tests.host.test_health import ScriptedHost


@pytest.mark.parametrize(("props", "member"), [
    ({"ActiveState": "active"}, Member("gpu-1", True)),
    ({"ActiveState": "activating"}, Member("gpu-1", False, "down (activating)")),
    ({"ActiveState": "failed"}, Member("gpu-1", False, "down (failed)")),
    ({}, Member("gpu-1", False, "down (not loaded)")),
])
def test_a_member_without_a_health_url_is_ready_when_systemd_says_active(props, member) -> None:
    host = ScriptedHost({"m": [props]})
    assert asyncio.run(read_member("gpu-1", host, ServiceSpec("m", "[Service]\n"))) == member
    assert [units for _, units in host.shows] == [["m.service"]]


def test_a_read_that_fails_says_not_ready_and_why() -> None:
    host = ScriptedHost({"m": [{"ActiveState": "active"}]}, fail=True)
    assert asyncio.run(read_member("gpu-1", host, ServiceSpec("m", "[Service]\n"))) == \
        Member("gpu-1", False, "not read (ConnectError)")


VLLM = ("[Service]\nExecStart=/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server "
        "--model /models/Qwen3-8B --port 8000\n")


def _vllm() -> ServiceSpec:
    return ServiceSpec("m", VLLM, health=HealthSpec(http="http://127.0.0.1:8000/health"))


def _answers(by_url: dict[str, tuple[int | None, str]], asked: list[str]):
    async def get(t, url: str, ca_pem: str | None) -> tuple[int | None, str]:
        asked.append(url)
        return by_url[url]
    return get


@pytest.mark.parametrize(("answers", "member", "asked"), [
    ({"/health": (200, ""), "/v1/models": (200, '{"data": [{"id": "qwen"}]}')}, Member("gpu-1", True),
     ["/health", "/v1/models"]),
    ({"/health": (200, ""), "/v1/models": (200, '{"data": []}')},
     Member("gpu-1", False, "unhealthy (http://127.0.0.1:8000/v1/models lists no model)"), ["/health", "/v1/models"]),
    ({"/health": (503, "")}, Member("gpu-1", False, "unhealthy (http://127.0.0.1:8000/health answered 503)"),
     ["/health"]),
])
def test_a_vllm_member_is_ready_by_the_engines_own_reads(answers, member, asked) -> None:
    """The budget counts a member as the health watch judges one: vLLM's /health, then
    /v1/models listing a model (plan/ready.py), in order, the first miss saying why."""
    got: list[str] = []
    base = "http://127.0.0.1:8000"
    get = _answers({base + k: v for k, v in answers.items()}, got)
    host = ScriptedHost({})
    assert asyncio.run(read_member("gpu-1", host, _vllm(), get=get)) == member
    assert got == [base + u for u in asked] and host.shows == []


@pytest.mark.parametrize(("serving", "asks"), [
    (None, True),
    (CallSpec("haproxy", "/run/haproxy/admin.sock", input="show stat\n", server="qwen/gpu-1"), True),
    (CallSpec("http", "http://127.0.0.1:8000/serving", method="GET"), True),
    (CallSpec("http", "http://127.0.0.1:8000/serving"), False),               # POST: it may change the router
    (CallSpec("http", "http://127.0.0.1:8000/serving", method="DELETE"), False),
    (CallSpec("host", "touch /tmp/pwned"), False),                          # the revision's code, as root
    (CallSpec("controller", argv=("socat", "-", "EXEC:/bin/sh")), False),    # the revision's arguments
])
def test_a_dry_run_asks_the_balancer_only_by_a_read_that_runs_nothing_of_the_revision(serving, asks) -> None:
    assert a_preview_may_ask(serving) is asks


def test_a_dry_runs_budget_read_runs_no_host_call_of_the_revision() -> None:
    """A member whose `serving` is a shell line on the host: a real run asks it (and here it cannot
    be made: not read), a dry run counts the member by its readiness alone and runs nothing."""
    drain = DrainSpec(leave=CallSpec("host", "true"), rejoin=CallSpec("host", "true"),
                      serving=CallSpec("host", "touch /tmp/pwned"))
    spec = ServiceSpec("m", "[Service]\n", drain=drain)
    host = ShellHost({"m": [{"ActiveState": "active"}]})
    assert asyncio.run(read_member("gpu-1", host, spec, preview=True)) == Member("gpu-1", True)
    assert host.lines == []
    assert asyncio.run(read_member("gpu-1", host, spec)) == Member("gpu-1", False, "out of rotation")
    assert host.lines == ["touch /tmp/pwned"]


class ShellHost(ScriptedHost):
    """ScriptedHost that also takes a shell line (a `host` call): recorded, answered exit 1."""

    def __init__(self, script):
        super().__init__(script)
        self.lines: list[str] = []

    async def run(self, cmd, *, input=None, check=False, timeout=60.0, what="command"):
        if what == "drain call":
            self.lines.append(cmd)
            return Completed(1, "", "")
        return await super().run(cmd, input=input, check=check, timeout=timeout, what=what)
