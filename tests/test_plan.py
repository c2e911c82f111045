"""Pure planner tests: tables of (desired, observed) -> expected actions, like Flux's."""

from __future__ import annotations

import pytest

from reconciler.facts import HostFacts, ServiceFacts, env_path, unit_path
from reconciler.plan import Kind, State, mask_secrets, plan_host, render_env
from reconciler.spec import HostSpec, ServiceSpec, SSHSpec

REV = "a" * 40
UNIT = "[Service]\nExecStart=/bin/server\n\n[Install]\nWantedBy=multi-user.target\n"


def svc(name="m", unit=UNIT, env=None) -> ServiceSpec:
    return ServiceSpec(name=name, unit_text=unit, env=env if env is not None else {"A": "1"})


def host(*services: ServiceSpec) -> HostSpec:
    return HostSpec(name="h1", ssh=SSHSpec(address="127.0.0.2"), services={s.name: s for s in services})


def facts_for(s: ServiceSpec, *, active="active", enabled="enabled", record=True, unit=None, env=None,
              host_rev=REV) -> HostFacts:
    sf = ServiceFacts(
        name=s.name,
        unit_text=s.unit_text if unit is None else unit,
        env_text=(render_env(s.env) if s.env else None) if env is None else env,
        record={"hash": s.content_hash(), "revision": REV} if record else None,
        props={"ActiveState": active, "UnitFileState": enabled, "NeedDaemonReload": "no"},
    )
    return HostFacts(services={s.name: sf}, record={"applied_revision": host_rev})


def kinds(plan) -> list[tuple[str, str | None]]:
    return [(a.kind.value, a.service) for a in plan.actions]


def test_in_sync_host_has_no_action():
    s = svc()
    p = plan_host(host(s), facts_for(s), REV)
    assert p.actions == () and p.states == {"m": State.IN_SYNC} and p.summary() == "in sync"


def test_in_sync_at_new_revision_only_records():
    s = svc()
    p = plan_host(host(s), facts_for(s, host_rev="b" * 40), REV)
    assert kinds(p) == [("record", None)] and p.changes == ()


def test_empty_host_gets_files_reload_enable_start_record():
    s = svc()
    p = plan_host(host(s), HostFacts(services={}), REV)
    assert kinds(p) == [("write", "m"), ("write", "m"), ("daemon-reload", None), ("enable", "m"),
                        ("start", "m"), ("record", None)]
    assert {a.path for a in p.actions if a.kind is Kind.WRITE} == {unit_path("m"), env_path("m")}
    assert p.states["m"] is State.ABSENT
    assert p.records["m"]["hash"] == s.content_hash()


def test_env_change_restarts_with_reason_naming_the_key():
    old, new = svc(env={"A": "1", "B": "x"}), svc(env={"A": "2", "B": "x"})
    p = plan_host(host(new), facts_for(old), REV)
    assert kinds(p) == [("write", "m"), ("daemon-reload", None), ("restart", "m"), ("record", None)]
    assert p.actions[0].reason == "env changed: A"
    assert p.states["m"] is State.CHANGED


def test_hand_edit_is_drift():
    s = svc()
    p = plan_host(host(s), facts_for(s, unit=UNIT.replace("/bin/server", "/bin/server --bad")), REV)
    assert p.states["m"] is State.DRIFTED
    assert "drift" in p.actions[0].reason and "-ExecStart=/bin/server --bad" in p.actions[0].diff
    assert ("restart", "m") in kinds(p)


def test_stopped_service_is_started_without_writes():
    s = svc()
    p = plan_host(host(s), facts_for(s, active="failed"), REV)
    assert kinds(p) == [("start", "m")] and "ActiveState=failed" in p.actions[0].reason


def test_files_match_but_record_differs_restarts():
    """A run that wrote files but died before restarting: the next run restarts."""
    s = svc()
    p = plan_host(host(s), facts_for(s, record=False), REV)
    assert ("restart", "m") in kinds(p) and not any(a.kind is Kind.WRITE for a in p.actions)


def test_removed_service_in_inventory_is_stopped_disabled_removed():
    gone = svc("old")
    p = plan_host(host(), facts_for(gone), REV)
    assert kinds(p) == [("stop", "old"), ("disable", "old"), ("remove", "old"), ("remove", "old"),
                        ("daemon-reload", None), ("record", None)]
    assert p.dropped_records == ("old",) and p.states["old"] is State.ORPHANED


def test_unit_not_in_inventory_is_never_touched():
    foreign = svc("handmade")
    p = plan_host(host(), facts_for(foreign, record=False), REV)
    assert p.changes == ()


def test_env_removed_removes_dropin():
    old, new = svc(env={"A": "1"}), svc(env={})
    p = plan_host(host(new), facts_for(old), REV)
    assert [(a.kind.value, a.path) for a in p.actions if a.path] == [("remove", env_path("m"))]


@pytest.mark.parametrize("value,expected", [
    ('a"b', 'Environment="K=a\\"b"'), ("50%", 'Environment="K=50%%"'), ("c:\\x", 'Environment="K=c:\\\\x"')])
def test_env_values_are_escaped_for_systemd(value, expected):
    assert expected in render_env({"K": value})


def test_secrets_masked_in_diffs():
    text = '+Environment="HF_TOKEN=hf_abcdef"\n+Environment="LOG=info"\n'
    out = mask_secrets(text)
    assert "hf_abcdef" not in out and 'HF_TOKEN=***' in out and "LOG=info" in out


def test_split_for_gate_stops_first_then_starts_after_the_gate():
    old, new = svc(env={"A": "1"}), svc(env={"A": "2"})
    from reconciler.plan import split_for_gate
    p = plan_host(host(new), facts_for(old), REV)
    a, b = split_for_gate(p, {"m"})
    assert kinds(a) == [("stop", "m"), ("write", "m"), ("daemon-reload", None)]
    assert kinds(b) == [("start", "m"), ("record", None)]
    assert a.records == {} and b.records == p.records
