"""plan/unit.py: a unit's `systemctl show` properties, typed and total (pure)."""

from __future__ import annotations

import pytest

from reconciler.plan.facts import ServiceFacts, parse_show
from reconciler.plan.unit import UnitState

# `systemctl show m.service` on a test host, a crash-looping unit (captured, trimmed)
SHOWN = """Id=m.service
LoadState=loaded
ActiveState=activating
SubState=auto-restart
Result=exit-code
NRestarts=3
ExecMainPID=0
ExecMainCode=1
ExecMainStatus=1
InvocationID=6f1c0b0e3f2a4a3c9f7e2d1b0a9c8d7e
ActiveEnterTimestampMonotonic=0
Job=
UnitFileState=enabled
FragmentPath=/etc/systemd/system/m.service
NeedDaemonReload=no
"""


def test_a_captured_reading() -> None:
    u = UnitState.parse(parse_show(SHOWN)["m.service"])
    assert u == UnitState(load_state="loaded", active_state="activating", sub_state="auto-restart", n_restarts=3,
                          exec_main_pid=0, invocation_id="6f1c0b0e3f2a4a3c9f7e2d1b0a9c8d7e", active_enter="0",
                          need_daemon_reload=False)
    assert not u.up


@pytest.mark.parametrize("props, want", [
    ({}, UnitState()),                                                   # nothing said: every field empty
    ({"NRestarts": "12", "ExecMainPID": "4242"}, UnitState(n_restarts=12, exec_main_pid=4242)),
    # what systemd never prints reads as 0, never raises
    ({"NRestarts": "", "ExecMainPID": "x"}, UnitState()),
    ({"NRestarts": "-1", "ExecMainPID": "٣"}, UnitState()),
    ({"NRestarts": "9" * 40}, UnitState()),
    ({"ActiveEnterTimestampMonotonic": ""}, UnitState(active_enter="")),
    ({"NeedDaemonReload": "yes"}, UnitState(need_daemon_reload=True)),
])
def test_parse_is_total(props: dict[str, str], want: UnitState) -> None:
    assert UnitState.parse(props) == want


@pytest.mark.parametrize("active, sub, up", [
    ("active", "running", True), ("activating", "start", True), ("reloading", "reload", True),
    ("activating", "auto-restart", False), ("activating", "auto-restart-queued", False),
    ("failed", "failed", False), ("inactive", "dead", False), ("", "", False),
])
def test_up(active: str, sub: str, up: bool) -> None:
    assert UnitState(active_state=active, sub_state=sub).up is up


def test_a_services_unit_is_parsed_once() -> None:
    f = ServiceFacts("m", props={"ActiveState": "active", "SubState": "running", "ExecMainPID": "7"})
    assert f.unit is f.unit and f.unit.exec_main_pid == 7 and f.unit.up
