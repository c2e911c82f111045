"""A member of a min_available group read without a health URL (loop/waves.read_member): systemd's
ActiveState, read by the show program (reconciler/sh/show.sh), is what says it is up."""

from __future__ import annotations

import asyncio

import pytest

from reconciler.desired.spec import ServiceSpec
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
