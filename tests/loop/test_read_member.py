"""A member of a min_available group read without a health URL (loop/waves.read_member): systemd's
ActiveState, read by the show program (reconciler/sh/show.sh), is what says it is up."""

from __future__ import annotations

import asyncio

import pytest

from reconciler.desired.spec import HealthSpec, ServiceSpec
from reconciler.loop.waves import read_member
from reconciler.plan.budget import Member
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
