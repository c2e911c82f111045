"""Properties of the planner over many passes: plan, let a simulated host carry the plan out,
observe, plan again. Level-based reconciliation must settle: one healthy pass converges any
host to quiet, a failed deploy is rolled back to the last good version once and then held
there (never flapping back to the bad version), and a failed deploy with nothing to roll back
to is held stopped.

`simulate` is a small, pure stand-in for a host (and for the controller's health watch): it
applies a plan's actions to `HostFacts` the way apply.py and reconcile.py would, so the next
plan sees what a fresh observation would.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.desired.spec import HostSpec, ServiceSpec, SSHSpec
from reconciler.plan.actions import plan_host
from reconciler.plan.facts import HostFacts, ServiceFacts
from reconciler.plan.files import desired_files, render_env_dropin, render_env_file
from reconciler.plan.layout import env_path, envfile_path, unit_path
from reconciler.plan.model import Action, Checks, Context, HostPlan, Kind, Reason, State
from reconciler.plan.records import (
    INCONCLUSIVE,
    MAX_UNJUDGED,
    Adopted,
    HostRecord,
    Pending,
    Quarantine,
    ServiceRecord,
    Verdict,
    judge,
)
from reconciler.plan.state import needs_last_good
from reconciler.values import replace

REV = "a" * 40        # the desired revision
OLD = "b" * 40        # what the host ran before
GOOD = "c" * 40       # the last good revision of a service
NOW = 1_700_000_000
HOST = "gpu-1"

# Fast enough to run with the unit tests; no deadline (a loaded CI machine is not a failure).
PROPERTY = settings(max_examples=100, deadline=None)

# Stands in for an adopted unit's original file when it is put back (the simulator keeps no copies).
RESTORED = "# the original unit, put back\n"


# ---- the simulated host ------------------------------------------------------------------------


def _props(f: ServiceFacts, **kv: str) -> ServiceFacts:
    return replace(f, props={**f.props, **kv})


def _write(f: ServiceFacts, path: str, content: str | None) -> ServiceFacts:
    """A file written (content) or removed (None): the unit, our env drop-in, or another drop-in;
    or the env file, which systemd reads at every start (no daemon-reload needed for it)."""
    if path == envfile_path(f.name):
        return replace(f, envfile_text=content)
    dropins = dict(f.dropins)
    if path == unit_path(f.name):
        f = replace(f, unit_text=content)
    elif content is None:
        dropins.pop(path, None)
    else:
        dropins[path] = content
    if path == env_path(f.name):
        f = replace(f, env_text=content)
    return _props(replace(f, dropins=dropins), NeedDaemonReload="yes")


def _reload(f: ServiceFacts) -> ServiceFacts:
    """daemon-reload: systemd reads the unit files again."""
    if f.unit_text is not None:
        return _props(f, NeedDaemonReload="no", LoadState="loaded", FragmentPath=unit_path(f.name))
    if f.props.get("FragmentPath") == unit_path(f.name):
        return _props(f, NeedDaemonReload="no", LoadState="not-found", FragmentPath="", ActiveState="inactive")
    return _props(f, NeedDaemonReload="no")


def _start(f: ServiceFacts, n: int, *, restart: bool) -> ServiceFacts:
    """A start of a running unit does nothing; a restart (or a start of a stopped one) runs a new
    invocation. A start resets NRestarts, a restart keeps counting (systemd)."""
    if f.running and not restart:
        return f
    return _props(f, ActiveState="active", SubState="running", InvocationID=f"inv-{n}",
                  NRestarts=f.props.get("NRestarts", "0") if restart else "0",
                  ActiveEnterTimestampMonotonic=str(n))


def _stop(f: ServiceFacts) -> ServiceFacts:
    """u_stop: stop, then reset-failed."""
    return _props(f, ActiveState="inactive", SubState="dead")


def simulate(facts: HostFacts, plan: HostPlan, healthy: bool, no_verdict: str | None = None,
             left: Mapping[str, str] | None = None) -> HostFacts:
    """PURE: the host after `plan` ran on it (and its watches reached a verdict).

    A watched service is healthy when `healthy` and it runs at the verdict. The verdict is
    recorded the way reconcile.py records it: `records.judge` on the service's first RECORD of
    the plan (else its record before the apply), and a failed verdict stops the unit.
    `no_verdict`: the watches come to no verdict for this reason instead, leaving the unit's
    systemd state as `left` says (systemd could not start its process).
    """
    svcs: dict[str, ServiceFacts] = dict(facts.services)
    host_record = facts.record
    n = int(max((f.props.get("ActiveEnterTimestampMonotonic", "0") or "0" for f in svcs.values()),
                key=int, default="0"))

    def get(name: str) -> ServiceFacts:
        return svcs.get(name) or ServiceFacts(name, props={"LoadState": "not-found", "ActiveState": "inactive"})

    for a in plan.actions:
        n += 1
        name = a.service
        if a.kind in (Kind.FETCH, Kind.HOLD, Kind.WAIT_GPUS, Kind.ARM, Kind.ARM_TIMER, Kind.DISARM):
            continue
        if name is None:
            if a.kind is Kind.DAEMON_RELOAD:
                svcs = {k: _reload(f) for k, f in svcs.items()}
            elif a.kind is Kind.RECORD:
                for gone in plan.dropped_records:
                    svcs[gone] = replace(get(gone), record=None)
                host_record = HostRecord(plan.revision, NOW)
            continue
        f = get(name)
        if a.kind in (Kind.INTENT, Kind.RECORD):
            assert a.record is not None
            rec = a.record
            if rec.pending is not None and not rec.pending.at:
                rec = replace(rec, pending=replace(rec.pending, at=NOW))
            f = replace(f, record=rec)
        elif a.kind is Kind.WRITE:
            assert a.path is not None and a.content is not None
            f = _write(f, a.path, a.content)
        elif a.kind is Kind.REMOVE:
            assert a.path is not None
            f = _write(f, a.path, None)
        elif a.kind is Kind.RESTORE:
            assert a.path is not None
            f = _write(f, a.path, RESTORED)
        elif a.kind is Kind.ADOPT:
            pass                      # a copy under adopted/: nothing systemd sees
        elif a.kind is Kind.STOP:
            f = _stop(f)
        elif a.kind is Kind.DISABLE:
            f = _props(f, UnitFileState="disabled")
        elif a.kind is Kind.ENABLE:
            f = _props(f, UnitFileState="enabled")
        elif a.kind in (Kind.START, Kind.RESTART):
            f = _start(f, n, restart=a.kind is Kind.RESTART)
        elif a.kind is Kind.WATCH:
            w = a.watch
            assert w is not None
            base = next((x.record for x in plan.actions if x.kind is Kind.RECORD and x.service == name
                         and x.record is not None), None)
            before = facts.services.get(name)
            base = base or (before.record if before is not None else None) or ServiceRecord()
            ok = healthy and f.running
            reason = no_verdict or ("Healthy" if ok else "CrashLoop")
            judged = judge(base, hash=w.hash, revision=w.revision, rollback=w.rollback, now=NOW,
                           verdict=Verdict(ok and not no_verdict, reason, None if ok else "boom"))
            f = replace(f, record=judged.record)
            if no_verdict:
                f = _props(f, **(left or {}))
            if judged.stop:
                f = _stop(f)
        else:  # pragma: no cover - a new Kind needs a line here
            raise AssertionError(f"simulate does not know {a.kind}")
        svcs[name] = f
    return HostFacts(services=svcs, record=host_record)


# ---- desired state and observed hosts ----------------------------------------------------------


def host_spec(*services: ServiceSpec) -> HostSpec:
    return HostSpec(name=HOST, ssh=SSHSpec(address="127.0.0.2"), services={s.name: s for s in services})


def ctx_for(desired: HostSpec, facts: HostFacts, renders: Mapping[str, ServiceSpec | None],
            **kw: object) -> Context:
    """The context reconcile.py builds: the last good versions the plan may need, rendered."""
    ctx = Context(REV, **kw)  # type: ignore[arg-type]
    wanted = needs_last_good(desired, facts, ctx)
    return replace(ctx, last_good={n: renders.get(rev) for n, rev in wanted.items()})


def installed(s: ServiceSpec, rec: ServiceRecord | None, *, active: str = "active", enabled: str = "enabled",
              **props: str) -> ServiceFacts:
    """A service whose files on the host are exactly those of `s`."""
    env = render_env_dropin(s.name) if s.env else None
    return ServiceFacts(
        name=s.name, unit_text=s.unit_text, env_text=env, envfile_text=render_env_file(s.env) if s.env else None,
        record=rec,
        props={"LoadState": "loaded", "FragmentPath": unit_path(s.name), "ActiveState": active,
               "UnitFileState": enabled, "NRestarts": "0", "InvocationID": "inv-0",
               "ActiveEnterTimestampMonotonic": "0", "NeedDaemonReload": "no", **props},
        dropins={env_path(s.name): env} if env else {})


def verified(s: ServiceSpec, revision: str = REV, **kw: object) -> ServiceRecord:
    h = s.content_hash()
    return ServiceRecord(hash=h, revision=revision, last_good_hash=h, last_good_revision=revision, **kw)  # type: ignore[arg-type]


LINES = ["ExecStart=/opt/sglang/bin/serve --port 30000", "ExecStart=/usr/bin/vllm serve --tp 2",
         "Restart=on-failure", "RestartSec=5", "User=model", "Environment=OMP_NUM_THREADS=8",
         "LimitNOFILE=65536", "MemoryMax=200G"]
KEYS = ["HF_HOME", "PORT", "CUDA_VISIBLE_DEVICES", "HF_TOKEN", "LOG"]
VALUES = st.sampled_from(["/models", "30000", "0,1", "hf_secret", 'a "quoted" value', "50%", "c:\\x", ""])

unit_texts = st.builds(
    lambda body, install: "[Unit]\nDescription=model\n\n[Service]\n" + "".join(f"{x}\n" for x in body)
    + ("\n[Install]\nWantedBy=multi-user.target\n" if install else ""),
    st.lists(st.sampled_from(LINES), min_size=1, max_size=4, unique=True), st.booleans())
envs = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=3)
FOREIGN_DROPINS = ["/etc/systemd/system/{}.service.d/override.conf", "/run/systemd/system/{}.service.d/x.conf",
                   "/etc/systemd/system.control/{}.service.d/50-MemoryMax.conf",
                   "/etc/systemd/system/{}.service.d/10-numa.conf"]

OBSERVED = ["absent", "not-found", "in-sync", "changed-env", "changed-unit", "drifted-unit", "drifted-env",
            "stopped", "failed", "not-enabled", "foreign-dropins", "pending-not-started", "pending-half-written",
            "pending-started", "pending-started-files-differ", "schema-1", "record-differs", "need-reload",
            "corrupt-record", "adopt-unit", "adopt-package", "adopt-masked", "foreign-unit", "foreign-package",
            "foreign-masked"]


@st.composite
def service(draw: st.DrawFn, name: str) -> ServiceSpec:
    allow = tuple(draw(st.lists(st.sampled_from(["10-numa.conf", "/run/systemd/system/m.service.d/x.conf"]),
                                max_size=1)))
    return ServiceSpec(name=name, unit_text=draw(unit_texts), env=draw(envs), allow_dropins=allow)


@st.composite
def observed(draw: st.DrawFn, s: ServiceSpec, kind: str | None = None) -> tuple[ServiceSpec, ServiceFacts | None]:
    """One service as a host might show it, relative to its desired version `s` (returned with
    adopt = true for the adopt-* kinds)."""
    kind = kind or draw(st.sampled_from(OBSERVED))
    other = ServiceSpec(s.name, unit_text=draw(unit_texts), env=draw(envs))
    old = verified(other, OLD)
    h = s.content_hash()
    if kind == "absent":
        return s, None
    if kind == "not-found":
        return s, ServiceFacts(s.name, props={"LoadState": "not-found", "ActiveState": "inactive"})
    if kind == "in-sync":
        return s, installed(s, verified(s))
    if kind == "changed-env":
        return s, installed(replace(s, env=other.env), old)
    if kind == "changed-unit":
        return s, installed(replace(s, unit_text=other.unit_text), old)
    if kind == "drifted-unit":
        return s, replace(installed(s, verified(s)), unit_text=s.unit_text + "# edited by hand\n")
    if kind == "drifted-env":
        f = installed(s, verified(s))
        return s, replace(f, envfile_text=render_env_file({**s.env, "HAND": "edit"}))
    if kind in ("stopped", "failed"):
        return s, installed(s, verified(s), active="inactive" if kind == "stopped" else "failed")
    if kind == "not-enabled":
        return s, installed(s, verified(s), enabled="disabled")
    if kind == "foreign-dropins":
        paths = draw(st.lists(st.sampled_from(FOREIGN_DROPINS), min_size=1, max_size=3, unique=True))
        f = installed(s, draw(st.sampled_from([verified(s), old])))
        return s, replace(f, dropins={**f.dropins, **{p.format(s.name): "[Service]\nNice=5\n" for p in paths}})
    if kind.startswith("pending"):
        started = kind.startswith("pending-started")
        pending = Pending(hash=h, revision=REV, replaces_hash=old.hash, replaces_revision=OLD, at=NOW - 60,
                          started=started)
        rec = replace(old, pending=pending, hash=h if started else old.hash, revision=REV if started else OLD)
        if kind == "pending-half-written":   # the unit was written, the env not yet
            return s, replace(installed(replace(s, env=other.env), rec), unit_text=s.unit_text)
        if kind == "pending-started-files-differ":
            return s, installed(other, rec)
        return s, installed(s, rec)
    if kind == "schema-1":
        return s, installed(s, ServiceRecord(hash=h, revision=REV, schema=1))
    if kind == "record-differs":
        return s, installed(s, old)
    if kind == "need-reload":
        return s, installed(s, verified(s), active="inactive", NeedDaemonReload="yes")
    if kind == "corrupt-record":
        return s, installed(s, ServiceRecord(corrupt=True))
    active = draw(st.sampled_from(["active", "inactive"]))
    enabled = draw(st.sampled_from(["enabled", "disabled"]))
    if kind.endswith("-unit"):         # a hand-made unit file at our path
        f = installed(other, None, active=active, enabled=enabled)
    elif kind.endswith("-package"):    # a package's unit, which our file would shadow
        f = ServiceFacts(s.name, props={"LoadState": "loaded", "FragmentPath": f"/lib/systemd/system/{s.name}.service",
                                        "ActiveState": active, "UnitFileState": enabled})
    else:
        assert kind.endswith("-masked")
        f = ServiceFacts(s.name, props={"LoadState": "masked", "FragmentPath": "", "ActiveState": "inactive",
                                        "UnitFileState": "masked"})
    return replace(s, adopt=kind.startswith("adopt")), f


@st.composite
def orphans(draw: st.DrawFn) -> ServiceFacts:
    """A service in the inventory that left the desired state (maybe one that was adopted)."""
    gone = ServiceSpec("orphan", unit_text=draw(unit_texts), env=draw(envs))
    adopted = draw(st.sampled_from([None, Adopted(files=(unit_path("orphan"),), was_enabled=True, was_active=True),
                                    Adopted(files=(), was_enabled=False, was_active=False,
                                            fragment="/lib/systemd/system/orphan.service")]))
    return installed(gone, verified(gone, OLD, adopted=adopted), active=draw(st.sampled_from(["active", "failed"])))


@st.composite
def hosts(draw: st.DrawFn, kind: str | None = None) -> tuple[HostSpec, HostFacts, Context]:
    """One or two desired services in random observed states (the first one in `kind`), maybe an
    orphan, maybe GPUs."""
    names = draw(st.lists(st.sampled_from(["m", "n"]), min_size=1, max_size=2, unique=True))
    specs: list[ServiceSpec] = []
    facts: dict[str, ServiceFacts] = {}
    for i, name in enumerate(names):
        s, f = draw(observed(draw(service(name)), kind if i == 0 else None))
        specs.append(s)
        if f is not None:
            facts[name] = f
    if draw(st.booleans()):
        facts["orphan"] = draw(orphans())
    host_rev = draw(st.sampled_from([None, OLD, REV]))
    desired = host_spec(*specs)
    hf = HostFacts(services=facts, record=HostRecord(host_rev) if host_rev else None)
    return desired, hf, Context(REV, checks=_checks(draw(st.booleans())))


def _checks(gpu_gate: bool) -> Checks:
    return Checks(gpu_gate=gpu_gate)


def show(plan: HostPlan) -> str:
    return "\n".join(f"  {a.kind.value} {a.service or ''} {a.path or ''} ({a.reason.value})" for a in plan.actions)


def written(plan: HostPlan, s: ServiceSpec) -> list[Action]:
    """WRITEs of `s`'s own content (a file that is the same in another version does not count)."""
    return [a for a in plan.actions if a.kind is Kind.WRITE and a.service == s.name
            and a.content is not None and desired_files(s).get(a.path or "") == a.content]


# ---- (a) one healthy pass converges to quiet ---------------------------------------------------


@pytest.mark.parametrize("kind", OBSERVED)
@settings(max_examples=12, deadline=None)       # x every observed state
@given(data=st.data())
def test_a_healthy_pass_leaves_nothing_to_do(kind: str, data: st.DataObject) -> None:
    """From every observed state: plan, apply healthy, plan again -> nothing left to do."""
    desired, facts, ctx = data.draw(hosts(kind))
    first = plan_host(desired, facts, ctx)
    after = simulate(facts, first, healthy=True)
    second = plan_host(desired, after, ctx)
    assert second.changes == () and second.watches == [], \
        f"states {first.states} -> {second.states}\nfirst:\n{show(first)}\nsecond:\n{show(second)}"
    # Only a foreign unit is left as it is (and says so); everything else is in sync.
    foreign = {n for n, st_ in second.states.items() if st_ is State.FOREIGN}
    assert [(a.kind, a.service) for a in second.actions] == [(Kind.HOLD, n) for n in sorted(foreign)], show(second)
    assert set(second.states.values()) <= {State.IN_SYNC, State.FOREIGN}
    assert foreign == {n for n, st_ in first.states.items() if st_ is State.FOREIGN}
    assert "orphan" not in after.inventory


@PROPERTY
@given(hosts())
def test_a_plans_are_idempotent_once_converged(case: tuple[HostSpec, HostFacts, Context]) -> None:
    """A quiet host stays quiet: planning the same facts again changes nothing."""
    desired, facts, ctx = case
    after = simulate(facts, plan_host(desired, facts, ctx), healthy=True)
    again = simulate(after, plan_host(desired, after, ctx), healthy=True)
    assert again == after


# ---- (b) a failed deploy rolls back once to the last good, then stays there --------------------


@st.composite
def good_and_bad(draw: st.DrawFn) -> tuple[ServiceSpec, ServiceSpec, ServiceFacts]:
    """A service running its last good version G, and a desired version D != G."""
    good = draw(service("m"))
    bad = draw(service("m").filter(lambda d: d.content_hash() != good.content_hash()))
    f = installed(good, verified(good, GOOD))
    variant = draw(st.sampled_from(["in-sync", "stopped", "foreign-dropin", "not-enabled"]))
    if variant == "stopped":
        f = _stop(f)
    elif variant == "foreign-dropin":
        f = replace(f, dropins={**f.dropins, "/etc/systemd/system/m.service.d/override.conf": "[Service]\nNice=5\n"})
    elif variant == "not-enabled":
        f = _props(f, UnitFileState="disabled")
    return good, bad, f


@PROPERTY
@given(good_and_bad(), st.booleans(), st.booleans())
def test_b_failed_deploy_substitutes_last_good_once_then_holds(
        case: tuple[ServiceSpec, ServiceSpec, ServiceFacts], gpu_gate: bool, neighbour: bool) -> None:
    good, bad, f = case
    other = ServiceSpec("n", unit_text="[Service]\nExecStart=/bin/n\n", env={"X": "1"})
    desired = host_spec(bad, other) if neighbour else host_spec(bad)
    svcs = {"m": f, "n": installed(other, verified(other))} if neighbour else {"m": f}
    facts = HostFacts(services=svcs, record=HostRecord(OLD))
    renders = {GOOD: good}
    checks = _checks(gpu_gate)

    first = plan_host(desired, facts, ctx_for(desired, facts, renders, checks=checks))
    assert first.states["m"] in (State.CHANGED, State.DRIFTED) and first.watches, show(first)
    facts = simulate(facts, first, healthy=False)
    rec = facts.services["m"].record
    assert rec is not None and rec.quarantine is not None and not facts.services["m"].running

    second = plan_host(desired, facts, ctx_for(desired, facts, renders, checks=checks))
    assert second.states["m"] is State.QUARANTINED, show(second)
    starts = [a for a in second.actions if a.kind in (Kind.START, Kind.RESTART) and a.service == "m"]
    assert [a.reason for a in starts] == [Reason.SUBSTITUTE], show(second)
    assert [w.watch.rollback for w in second.watches if w.service == "m"] == [True]  # type: ignore[union-attr]
    assert not written(second, bad) or written(second, good)  # only files G shares with D
    plans = [second]
    facts = simulate(facts, second, healthy=True)
    for _ in range(3):
        p = plan_host(desired, facts, ctx_for(desired, facts, renders, checks=checks))
        plans.append(p)
        assert p.states["m"] is State.QUARANTINED
        assert [(a.kind, a.reason) for a in p.actions] == [(Kind.HOLD, Reason.HOLD_LAST_GOOD)], show(p)
        facts = simulate(facts, p, healthy=True)
    assert facts.services["m"].running and facts.services["m"].unit_text == good.unit_text
    for p in plans:
        bad_only = [a for a in written(p, bad) if desired_files(good).get(a.path or "") != a.content]
        assert bad_only == [], f"the quarantined version was written again:\n{show(p)}"


@PROPERTY
@given(good_and_bad())
def test_b_failed_rollback_is_held_stopped(case: tuple[ServiceSpec, ServiceSpec, ServiceFacts]) -> None:
    """When the last good fails too, the service is left stopped: no third attempt at either."""
    good, bad, f = case
    desired = host_spec(bad)
    facts = HostFacts(services={"m": f}, record=HostRecord(OLD))
    renders = {GOOD: good}
    for healthy in (False, False):
        facts = simulate(facts, plan_host(desired, facts, ctx_for(desired, facts, renders)), healthy=healthy)
    for _ in range(3):
        p = plan_host(desired, facts, ctx_for(desired, facts, renders))
        assert p.states["m"] is State.ROLLBACK_FAILED, show(p)
        assert p.changes == () and p.watches == [], show(p)
        facts = simulate(facts, p, healthy=True)
        assert not facts.services["m"].running


# ---- (c) a failed deploy with nothing to roll back to is held stopped --------------------------


@st.composite
def without_last_good(draw: st.DrawFn) -> tuple[ServiceSpec, ServiceFacts | None, dict[str, ServiceSpec | None]]:
    bad = draw(service("m"))
    old = draw(st.builds(ServiceSpec, st.just("m"), unit_texts, envs)
               .filter(lambda o: o.content_hash() != bad.content_hash()))
    kind = draw(st.sampled_from(["absent", "schema-1", "never-good", "unrenderable"]))
    if kind == "absent":
        return bad, None, {}
    if kind == "schema-1":      # applied before verdicts were recorded: re-verified, and fails
        return bad, installed(bad, ServiceRecord(hash=bad.content_hash(), revision=REV, schema=1)), {}
    if kind == "never-good":    # an older version that never passed health either
        return bad, installed(old, ServiceRecord(hash=old.content_hash(), revision=OLD)), {}
    # a last good exists, but its revision no longer renders
    return bad, installed(old, verified(old, GOOD)), {GOOD: None}


@PROPERTY
@given(without_last_good(), st.booleans())
def test_c_failed_deploy_without_last_good_stays_stopped(
        case: tuple[ServiceSpec, ServiceFacts | None, dict[str, ServiceSpec | None]], gpu_gate: bool) -> None:
    bad, f, renders = case
    desired = host_spec(bad)
    facts = HostFacts(services={"m": f} if f is not None else {}, record=None)
    checks = _checks(gpu_gate)
    first = plan_host(desired, facts, ctx_for(desired, facts, renders, checks=checks))
    assert first.watches, show(first)
    facts = simulate(facts, first, healthy=False)
    for _ in range(3):
        p = plan_host(desired, facts, ctx_for(desired, facts, renders, checks=checks))
        assert p.states["m"] is State.QUARANTINED_NO_GOOD, show(p)
        assert not [a for a in p.actions if a.kind in (Kind.START, Kind.RESTART, Kind.WRITE, Kind.WATCH)], show(p)
        assert [a.kind for a in p.actions if a.service == "m"] == [Kind.HOLD], show(p)
        facts = simulate(facts, p, healthy=True)
        assert not facts.services["m"].running


# ---- (d) a pass cut short anywhere is finished by the next one ---------------------------------


@PROPERTY
@given(data=st.data())
def test_d_a_cut_short_pass_is_finished_by_the_next(data: st.DataObject) -> None:
    """The controller dies after any step of a plan: the next pass (healthy) still converges."""
    desired, facts, ctx = data.draw(hosts())
    first = plan_host(desired, facts, ctx)
    cut = data.draw(st.integers(0, len(first.actions)))
    facts = simulate(facts, replace(first, actions=first.actions[:cut]), healthy=True)
    second = plan_host(desired, facts, ctx)
    after = simulate(facts, second, healthy=True)
    third = plan_host(desired, after, ctx)
    assert third.changes == () and third.watches == [], \
        f"cut after {cut}:\n{show(first)}\nsecond:\n{show(second)}\nthird:\n{show(third)}"


@PROPERTY
@given(good_and_bad())
def test_a_fleet_quarantine_is_durable_before_the_verdict(case: tuple[ServiceSpec, ServiceSpec, ServiceFacts]) -> None:
    """The rollout halted on another host; this host's plan records the halt and (re)starts its
    last good. The controller dies before the verdict: one that never heard of the halt (another
    controller, a fresh state store) must still not deploy the halted version here."""
    good, bad, f = case
    desired = host_spec(bad)
    facts = HostFacts(services={"m": f}, record=HostRecord(OLD))
    halt = Quarantine(hash=bad.content_hash(), revision=REV, reason="RolloutHalted", halted_at="gpu-9", wave=1,
                      cause="CrashLoop")
    plan = plan_host(desired, facts, ctx_for(desired, facts, {GOOD: good}, fleet_quarantine={"m": halt}))
    cut = replace(plan, actions=tuple(a for a in plan.actions if a.kind is not Kind.WATCH))
    facts = simulate(facts, cut, healthy=True)
    later = plan_host(desired, facts, ctx_for(desired, facts, {GOOD: good}))
    assert not written(later, bad), f"first:\n{show(plan)}\nlater, without the fleet's halt:\n{show(later)}"


# ---- (d) a watch with no verdict is started again, never quarantined, never a loop (issue 32) ----

LEFT = {"failed": {"ActiveState": "failed", "SubState": "failed"},
        "auto-restart": {"ActiveState": "activating", "SubState": "auto-restart"},
        "up again": {"ActiveState": "active", "SubState": "running"}}


@PROPERTY
@given(service("m"), st.lists(st.sampled_from([INCONCLUSIVE, "Healthy"]), min_size=1, max_size=8),
       st.sampled_from(sorted(LEFT)))
def test_d_no_verdict_starts_it_again_at_most_max_times_and_never_quarantines(
        s: ServiceSpec, verdicts: list[str], left: str) -> None:
    """systemd could not start the deploy's process (219/CGROUP): each watch without a verdict
    leads to one more start (or a watch again, when systemd brought it up), at most MAX_UNJUDGED
    watches in all; a healthy one makes it the last good. Never quarantined, never a loop."""
    other = ServiceSpec("m", unit_text=s.unit_text + "# older\n", env=s.env)
    facts = HostFacts(services={"m": installed(other, verified(other, OLD))}, record=HostRecord(OLD))
    desired = host_spec(s)
    watched = 0
    for _ in range(MAX_UNJUDGED + 3):
        p = plan_host(desired, facts, Context(REV))
        if not p.watches:
            break
        verdict = verdicts[min(watched, len(verdicts) - 1)]
        watched += 1
        facts = simulate(facts, p, healthy=True, no_verdict=None if verdict == "Healthy" else verdict,
                         left=LEFT[left])
    else:
        raise AssertionError("still watching after MAX_UNJUDGED + 3 plans")
    rec = facts.services["m"].record
    assert rec is not None and rec.quarantine is None
    healthy_at = verdicts.index("Healthy") if "Healthy" in verdicts[:MAX_UNJUDGED] else None
    if healthy_at is not None:
        assert watched == healthy_at + 1 and rec.last_good_hash == s.content_hash() and rec.pending is None
        assert p.states["m"] is State.IN_SYNC
    else:
        assert watched == MAX_UNJUDGED and rec.pending is not None and rec.pending.attempts == MAX_UNJUDGED
        assert p.states["m"] is State.INCONCLUSIVE and p.changes == ()
