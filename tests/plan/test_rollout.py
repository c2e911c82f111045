"""Rollouts, pure parts: waves (tables), groups, the halt's reach, policy loading, selectors,
and the webhook notifier (against a real HTTP server on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest

from reconciler.desired.load import MemorySnapshot, load_desired
from reconciler.desired.spec import DesiredState, NotifySpec, RolloutPolicy
from reconciler.errors import ConfigError, SourceError
from reconciler.host.notify import ALLOW_ENV, Notifier, slack_text, where
from reconciler.loop.results import HostResult, ServiceEvent, merge_result
from reconciler.loop.select import select_hosts
from reconciler.plan.gpuhealth import GpuFault
from reconciler.plan.records import Quarantine
from reconciler.plan.rollout import (
    Excuse,
    GroupKey,
    Halt,
    HostOutcome,
    RolloutPlan,
    RolloutResult,
    RolloutStatus,
    Wave,
    excuses_on_record,
    halt,
    halted_reason,
    judge_wave,
    natural_key,
    order_hosts,
    plan_rollouts,
    plan_waves,
    quarantine_cover,
)
from reconciler.reasons import Reason

# ---- waves ----------------------------------------------------------------------------------


def hosts(n: int) -> list[str]:
    return [f"h{i}" for i in range(1, n + 1)]


@pytest.mark.parametrize("pending, labels, policy, members, want", [
    # the case: six hosts, canary 1, at most 2 at once
    (hosts(6), {}, RolloutPolicy(1, 2), 6, [["h1"], ["h2", "h3"], ["h4", "h5"], ["h6"]]),
    # default policy: 25% of 6 is 1.5 -> 1
    (hosts(6), {}, RolloutPolicy(), 6, [["h1"], ["h2"], ["h3"], ["h4"], ["h5"], ["h6"]]),
    # 30 hosts, max_unavailable 10: canary, then 10, 10, 9
    (hosts(30), {}, RolloutPolicy(1, 10), 30, [["h1"], hosts(11)[1:], [f"h{i}" for i in range(12, 22)],
                                               [f"h{i}" for i in range(22, 31)]]),
    # all at once
    (hosts(5), {}, RolloutPolicy(0, "100%"), 5, [hosts(5)]),
    # canary with everything else at once
    (hosts(5), {}, RolloutPolicy(1, "100%"), 5, [["h1"], ["h2", "h3", "h4", "h5"]]),
    # labelled canaries go first, in name order; then the rest in natural order (h2 < h10)
    (["h10", "h2", "h3", "h9"], {"h9": {"canary": "true"}, "h3": {"canary": "true"}}, RolloutPolicy(2, 1), 4,
     [["h3"], ["h9"], ["h2"], ["h10"]]),
    # more canaries than the bound: several canary waves
    (hosts(4), {}, RolloutPolicy(3, 2), 4, [["h1", "h2"], ["h3"], ["h4"]]),
    # a percentage counts every member, not only the pending ones: 50% of 8 is 4
    (hosts(3), {}, RolloutPolicy(0, "50%"), 8, [["h1", "h2", "h3"]]),
    # canary "true" only: another value is no canary
    (hosts(3), {"h3": {"canary": "yes"}}, RolloutPolicy(1, 1), 3, [["h1"], ["h2"], ["h3"]]),
    # one host to restart: no waves; none: no waves
    (["h1"], {}, RolloutPolicy(), 6, []),
    ([], {}, RolloutPolicy(), 6, []),
])
def test_plan_waves(pending, labels, policy, members, want) -> None:
    waves = plan_waves(pending, labels, policy, members)
    assert [list(w.hosts) for w in waves] == want
    assert [w.number for w in waves] == list(range(1, len(want) + 1))
    assert all(len(w.hosts) <= policy.bound(members) for w in waves)
    n_canary = min(policy.canary, len(pending)) if len(pending) >= 2 else 0
    assert sum(len(w.hosts) for w in waves if w.canary) == n_canary


@pytest.mark.parametrize("mu, members, bound", [
    (1, 6, 1), (2, 6, 2), (10, 3, 10), ("25%", 6, 1), ("25%", 50, 12), ("100%", 30, 30), ("1%", 30, 1),
    ("50%", 3, 1), ("34%", 3, 1), ("67%", 3, 2),
])
def test_bound(mu, members, bound) -> None:
    assert RolloutPolicy(1, mu).bound(members) == bound


def test_natural_order() -> None:
    assert sorted(["gpu-10", "gpu-2", "gpu-1", "a"], key=natural_key) == ["a", "gpu-1", "gpu-2", "gpu-10"]
    assert order_hosts(["b", "a", "c"], {"c": {"canary": "true"}}) == ["c", "a", "b"]


# ---- groups from a loaded desired state -----------------------------------------------------

UNIT = "[Service]\nExecStart=/bin/server --host {host.address} --port {vars.port}\n"


def repo(n: int = 4, fleet: str = "", definition_extra: str = "", host_extra: dict[int, str] | None = None,
         labels: dict[int, str] | None = None) -> dict[str, str]:
    files = {
        "fleet.toml": fleet,
        "units/s.service": UNIT,
        "services/shared.toml": 'unit_file = "units/s.service"\nvars = { port = "30000" }\n' + definition_extra,
        "services/other.toml": 'unit_file = "units/s.service"\nvars = { port = "30001" }\n',
    }
    for i in range(1, n + 1):
        lab = f"labels = {{ {labels[i]} }}\n" if labels and i in labels else ""
        files[f"hosts/h{i}.toml"] = (f'address = "127.0.0.{100 + i}"\n{lab}'
                                     f'[services.m]\nuse = "shared"\n{(host_extra or {}).get(i, "")}'
                                     f'[services.o]\nuse = "other"\n'
                                     f'[services.solo]\nunit_file = "units/s.service"\nvars = {{ port = "30002" }}\n')
    return files


def load(files: dict[str, str]) -> DesiredState:
    return load_desired(MemorySnapshot(files, revision="cd" * 20))


def problems(files: dict[str, str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(files)
    return [str(p) for p in info.value.problems]


def test_groups_are_per_service_and_definition() -> None:
    state = load(repo(4, fleet="[rollout]\ncanary = 1\nmax_unavailable = 2\n"))
    # h1..h4 restart m; h2 and h3 restart o; solo (no definition) never has waves; h4 restarts
    # only m among the o-group, so o has two pending hosts.
    restarts = {"h1": {"m", "solo"}, "h2": {"m", "o", "solo"}, "h3": {"m", "o"}, "h4": {"m"}}
    plans = {p.group: p for p in plan_rollouts(state, restarts)}
    assert set(plans) == {GroupKey("m", "shared"), GroupKey("o", "other")}
    m = plans[GroupKey("m", "shared")]
    assert [list(w.hosts) for w in m.waves] == [["h1"], ["h2", "h3"], ["h4"]]
    assert m.members == ("h1", "h2", "h3", "h4") and m.bound == 2
    o = plans[GroupKey("o", "other")]
    assert [list(w.hosts) for w in o.waves] == [["h2"], ["h3"]]


def test_a_change_on_one_host_needs_no_waves() -> None:
    state = load(repo(4))
    assert plan_rollouts(state, {"h3": {"m"}}) == []
    assert plan_rollouts(state, {}) == []


def test_labelled_canary_goes_first() -> None:
    state = load(repo(4, labels={3: 'canary = "true", gpu = "h200"'}))
    (m,) = [p for p in plan_rollouts(state, {h: {"m"} for h in ("h1", "h2", "h3", "h4")})]
    assert m.waves[0].hosts == ("h3",) and m.waves[0].canary


# ---- policy in the TOML ---------------------------------------------------------------------


def test_policy_layers_fleet_then_definition() -> None:
    state = load(repo(2, fleet='[rollout]\ncanary = 2\nmax_unavailable = "50%"\n',
                      definition_extra="rollout = { max_unavailable = 3 }\n"))
    assert state.hosts["h1"].services["m"].rollout == RolloutPolicy(2, 3)
    assert state.hosts["h1"].services["o"].rollout == RolloutPolicy(2, "50%")
    assert load(repo(1)).hosts["h1"].services["m"].rollout == RolloutPolicy(1, "25%")


def test_host_override_that_agrees_is_fine_one_that_differs_is_an_error() -> None:
    same = 'rollout = { canary = 0 }\n'
    state = load(repo(2, host_extra={1: same, 2: same}))
    assert state.hosts["h2"].services["m"].rollout.canary == 0
    probs = problems(repo(3, host_extra={2: 'rollout = { max_unavailable = 2 }\n'}))
    assert len(probs) == 1
    assert probs[0].startswith("hosts/h2.toml: services.m.rollout: this host's policy "
                               "(canary = 1, max_unavailable = 2) differs from the other hosts")
    assert "set rollout in services/shared.toml" in probs[0]


@pytest.mark.parametrize("toml, where, expected", [
    ('[rollout]\ncanary = -1\n', "fleet.toml: rollout.canary", "expected an integer >= 0, got -1"),
    ('[rollout]\ncanary = "1"\n', "fleet.toml: rollout.canary", "expected an integer >= 0, got '1'"),
    ('[rollout]\nmax_unavailable = 0\n', "fleet.toml: rollout.max_unavailable", "expected an integer >= 1 or a"),
    ('[rollout]\nmax_unavailable = "0%"\n', "fleet.toml: rollout.max_unavailable", "got '0%'"),
    ('[rollout]\nmax_unavailable = "101%"\n', "fleet.toml: rollout.max_unavailable", "got '101%'"),
    ('[rollout]\nmax_unavailable = "12.5%"\n', "fleet.toml: rollout.max_unavailable", "got '12.5%'"),
    ('[rollout]\nmax_unavailable = true\n', "fleet.toml: rollout.max_unavailable", "got true"),
    ('[rollout]\ncanaries = 1\n', "fleet.toml: rollout.canaries", "did you mean 'canary'?"),
    ('[notify]\nformat = "json"\n', "fleet.toml: notify.webhook", "required key missing"),
    ('[notify]\nwebhook = "ftp://127.0.0.1/x"\n', "fleet.toml: notify.webhook", "expected an http:// or https:// URL"),
    ('[notify]\nwebhook = "http://127.0.0.1:9/x"\nformat = "teams"\n', "fleet.toml: notify.format",
     "expected 'json' or 'slack', got 'teams'"),
    ('[notify]\nwebhook = "http://127.0.0.1:9/x"\nretries = 3\n', "fleet.toml: notify.retries", "unknown key"),
])
def test_bad_policy_names_file_and_key(toml, where, expected) -> None:
    probs = problems(repo(1, fleet=toml))
    assert any(p.startswith(where + ": ") and expected in p for p in probs), probs


def test_bad_policy_in_a_definition_and_on_a_service_without_one() -> None:
    probs = problems(repo(1, definition_extra='rollout = { max_unavailable = "all" }\n'))
    assert any(p.startswith("services/shared.toml: rollout.max_unavailable: expected") for p in probs), probs
    files = repo(1)
    files["hosts/h1.toml"] += "rollout = { canary = 0 }\n"      # lands in [services.solo]
    probs = problems(files)
    assert any(p.startswith("hosts/h1.toml: services.solo.rollout: has no effect here") for p in probs), probs


def test_webhook_secret_is_not_echoed() -> None:
    probs = problems(repo(1, fleet='[notify]\nwebhook = "https:///T000/SECRET"\n'))
    assert any("notify.webhook" in p for p in probs) and not any("SECRET" in p for p in probs)


def test_notify_settings_load() -> None:
    state = load(repo(1, fleet='[notify]\nwebhook = "http://127.0.0.1:9/hook"\nformat = "slack"\ntimeout = 2\n'))
    assert state.settings.notify == NotifySpec("http://127.0.0.1:9/hook", "slack", 2.0)
    assert load(repo(1)).settings.notify is None


# ---- the halt's reach -----------------------------------------------------------------------

G = GroupKey("m", "shared")
HALT = {"hash": "c1", "revision": "R1", "reason": "CrashLoop", "quote": "needs --flag", "halted_at": "h1"}


@pytest.mark.parametrize("desired, halts, revision, then, want", [
    # same revision: every pending member is covered, with the canary's cause and quote
    ({"h2": "b2", "h3": "b3"}, [Halt("h1", HALT)], "R1", {}, {"h2", "h3"}),
    # a later commit that did not change h2's rendering keeps it covered; h3's changed: lifted
    ({"h2": "b2", "h3": "b3-new"}, [Halt("h1", HALT)], "R2", {("R1", "h2"): "b2", ("R1", "h3"): "b3"}, {"h2"}),
    # a failure outside a waved rollout (no halted_at) stays on its own host
    ({"h2": "b2"}, [Halt("h1", {**HALT, "halted_at": None})], "R1", {}, set()),
    # a record written on an untouched host carries the halt on
    ({"h3": "b3"}, [Halt("h2", {**HALT, "hash": "b2", "reason": "RolloutHalted", "cause": "CrashLoop"})],
     "R1", {}, {"h3"}),
    # the revision cannot be rendered any more: nothing is assumed
    ({"h2": "b2"}, [Halt("h1", HALT)], "R2", {}, set()),
])
def test_quarantine_cover(desired, halts, revision, then, want) -> None:
    out = quarantine_cover(G, desired, halts, revision, lambda rev, host, svc: then.get((rev, host)))
    assert set(out) == want
    for host, q in out.items():
        assert q["hash"] == desired[host] and q["revision"] == "R1" and q["reason"] == "RolloutHalted"
        assert q["halted_at"] in ("h1",) and q["cause"] == "CrashLoop" and q["quote"] == "needs --flag"


# ---- merging passes -------------------------------------------------------------------------


def test_merge_keeps_the_worst_and_adds_failures() -> None:
    r = HostResult("h1", "127.0.0.101", "in-sync")
    merge_result(r, HostResult("h1", "127.0.0.101", "converged", events=[ServiceEvent("o", "deploy", "R", "x")]))
    assert r.status == "converged" and len(r.events) == 1
    merge_result(r, HostResult("h1", "127.0.0.101", "rolled-back", reason="RolledBack", message="m: bad"))
    merge_result(r, HostResult("h1", "127.0.0.101", "quarantined", reason="Quarantined", message="q"))
    assert (r.status, r.reason, r.message) == ("rolled-back", "RolledBack", "m: bad")
    merge_result(r, HostResult("h1", "127.0.0.101", "failed", reason="ApplyFailed", message="a"))
    merge_result(r, HostResult("h1", "127.0.0.101", "failed", reason="RollbackFailed", message="b"))
    assert (r.status, r.reason, r.message) == ("failed", "ApplyFailed", "a; b")


# ---- selectors ------------------------------------------------------------------------------


def test_select_hosts_by_name_and_label() -> None:
    state = load(repo(4, labels={1: 'gpu = "h200", rack = "a"', 2: 'gpu = "h200", rack = "b"', 3: 'gpu = "a100"'}))
    assert select_hosts(state, None, None) is None
    assert select_hosts(state, None, ["gpu=h200"]) == ["h1", "h2"]
    assert select_hosts(state, None, ["gpu=h200", "rack=b"]) == ["h2"]
    assert select_hosts(state, ["h1", "h3"], ["gpu=h200"]) == ["h1"]
    assert select_hosts(state, ["h4"], None) == ["h4"]
    with pytest.raises(SourceError, match=r"no host matches --label gpu=b200 .*labels in use: gpu=a100, gpu=h200"):
        select_hosts(state, None, ["gpu=b200"])
    with pytest.raises(SourceError, match="KEY=VALUE"):
        select_hosts(state, None, ["gpu"])
    with pytest.raises(SourceError, match="unknown host"):
        select_hosts(state, ["h9"], None)


# ---- notifications --------------------------------------------------------------------------


class _Hook(http.server.BaseHTTPRequestHandler):
    """A webhook that records each event; with `gate` set to an Event, it holds each request
    until the test sets it (or 10 s pass). `arrived`: a request came; `answered`: one was answered."""

    received: ClassVar[list[dict[str, object]]] = []
    status = 200
    gate: ClassVar[threading.Event | None] = None
    arrived: ClassVar[threading.Event] = threading.Event()
    answered: ClassVar[threading.Event] = threading.Event()

    def do_POST(self) -> None:  # http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).arrived.set()
        gate = type(self).gate
        if gate is not None:
            gate.wait(10)
        type(self).received.append(json.loads(body))
        self.send_response(type(self).status)
        self.end_headers()
        type(self).answered.set()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, type[_Hook]]]:
    monkeypatch.setenv(ALLOW_ENV, "127.0.0.1/32")     # a loopback webhook, allowed as the controller's config would
    handler: type[_Hook] = type("Hook", (_Hook,), {"received": [], "status": 200, "gate": None,
                                                   "arrived": threading.Event(), "answered": threading.Event()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # shutdown() waits for serve_forever's next look at its flag: a short poll, a short wait
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hooks/T0/SECRET", handler
    if handler.gate is not None:
        handler.gate.set()
    server.shutdown()


def test_json_events_arrive_in_order(hook) -> None:
    url, handler = hook

    async def run() -> Notifier:
        n = Notifier(NotifySpec(url))
        n.send("rollout.start", service="m", short="abc1234", hosts=["h1", "h2"])
        n.send("rollout.halt", service="m", host="h1", reason="CrashLoop", journal_line="needs --x")
        await n.close(5)
        return n
    n = asyncio.run(run())
    assert [e["event"] for e in handler.received] == ["rollout.start", "rollout.halt"]
    assert handler.received[1]["journal_line"] == "needs --x" and n.failures == []


def test_slack_shape(hook) -> None:
    url, handler = hook

    async def run() -> None:
        n = Notifier(NotifySpec(url, "slack"))
        n.send("rollback", host="h1", service="m", short="abc1234", reason="CrashLoop", result="rolled-back",
               rolled_back_to="def5678aaaa", journal_line="needs --x")
        await n.close(5)
    asyncio.run(run())
    (msg,) = handler.received
    assert set(msg) == {"text"} and "rolled back to `def5678`" in msg["text"] and "> needs --x" in msg["text"]


def test_failing_or_slow_webhook_never_blocks(hook) -> None:
    url, handler = hook
    asyncio.run(_failing_or_slow(url, handler))


async def _failing_or_slow(url: str, handler: type[_Hook]) -> None:
    handler.status, handler.gate = 500, threading.Event()      # the webhook holds the request
    n = Notifier(NotifySpec(url))
    n.send("rollout.finish", service="m")
    assert not handler.answered.is_set()         # send returned before the webhook answered: it never waits
    handler.gate.set()
    await n.close(5)
    assert len(n.failures) == 1 and "500" in n.failures[0]
    assert "SECRET" not in n.failures[0] and where(url) in n.failures[0]
    # nothing listens: refused, reported, not raised
    closed = Notifier(NotifySpec("http://127.0.0.1:9/x", timeout=1))
    closed.send("rollout.start", service="m")
    await closed.close(5)
    assert closed.failures and "not delivered" in closed.failures[0]
    # a webhook slower than the wait at the end: the run goes on; the event is dropped
    handler.status, handler.gate = 200, threading.Event()
    handler.arrived.clear()
    handler.answered.clear()
    slow = Notifier(NotifySpec(url, timeout=10))
    slow.send("rollout.start", service="m")
    slow.send("rollout.finish", service="m")
    assert await asyncio.to_thread(handler.arrived.wait, 10)   # the first is at the webhook, which holds it
    await slow.close(0)                          # the wait at the end, spent
    assert not handler.answered.is_set()         # close returned while the webhook still held it
    assert "still busy" in slow.failures[-1] and "1 event(s) dropped" in slow.failures[-1]


def test_slack_text_for_each_event() -> None:
    start = slack_text({"event": "rollout.start", "service": "m", "short": "abc", "hosts": ["a", "b"],
                        "waves": [{"canary": True, "hosts": ["a"]}, {"canary": False, "hosts": ["b"]}],
                        "policy": {"bound": 1}})
    assert "2 hosts in 2 waves (canary: a" in start
    halt = slack_text({"event": "rollout.halt", "service": "m", "short": "abc", "host": "a", "wave": 1,
                       "reason": "CrashLoop", "untouched": ["b"], "journal_line": "boom"})
    assert "halted at *a*" in halt and "1 hosts left" in halt and halt.endswith("> boom")


def test_a_hosts_sick_gpus_are_not_the_changes_failure() -> None:
    from reconciler.plan.rollout import host_fault
    assert host_fault("GpuFault")
    assert not any(host_fault(r) for r in ("CrashLoop", "StartFailed", "ApplyFailed", "Unreachable", None))


# ---- the wave verdict -------------------------------------------------------------------------

CANARY, WAVE = Wave(1, ("h1",), canary=True), Wave(3, ("h4", "h5"))
ECC = "GPU 00000000:18:00.0: ECC Errors / Volatile / DRAM Uncorrectable: 2"


def ok(h: str) -> HostOutcome:
    return HostOutcome(h)


def gpu(h: str, *, started: bool = True) -> HostOutcome:
    """Its start failed with its GPUs sick (started), or it was blocked before (a fault seen first)."""
    return HostOutcome(h, "GpuFault", f"GpuFault: the start failed ({h})", f"{ECC} ({h})", started=started)


def crash(h: str) -> HostOutcome:
    return HostOutcome(h, "CrashLoop", "exited 3 times", "ValueError: bad flag", started=True)


def early(h: str) -> Excuse:
    """A start of this revision that failed with sick GPUs before this wave (or in an earlier run)."""
    return Excuse(h, f"{ECC} ({h})")


@pytest.mark.parametrize("wave, outcomes, before, halt, excused, faulted, skipped", [
    # every host healthy: it goes on
    (CANARY, [ok("h1")], [], [], [], [], []),
    (WAVE, [ok("h4"), ok("h5")], [early("h2")], [], [], [], []),
    # the change's failure halts, at the first failed host, as ever
    (CANARY, [crash("h1")], [], [("h1", "CrashLoop")], [], [], []),
    (WAVE, [crash("h4"), crash("h5")], [], [("h4", "CrashLoop"), ("h5", "CrashLoop")], [], [], []),
    # ... also when a wave host's GPUs excuse it: that host stays excused, and its fault counted
    (WAVE, [gpu("h4"), crash("h5")], [], [("h5", "CrashLoop")], ["h4"], ["h4"], []),
    # an apply that failed (nothing started) is the change's too; a host never observed is skipped
    (WAVE, [HostOutcome("h4", "ApplyFailed", "write failed"), ok("h5")], [], [("h4", "ApplyFailed")], [], [], []),
    (WAVE, [HostOutcome("h4", "Unreachable", "", observed=False), ok("h5")], [], [], [], [], ["h4"]),
    # a GPU fault alone on a later wave's host: excused, the rollout goes on
    (WAVE, [gpu("h4"), ok("h5")], [], [], ["h4"], ["h4"], []),
    # the canary's start failed with sick GPUs: no excuse, it halts there
    (CANARY, [gpu("h1")], [], [("h1", "GpuFault")], [], ["h1"], []),
    # the canary was blocked before its start (nothing of the revision ran): excused, not counted
    (CANARY, [gpu("h1", started=False)], [], [], ["h1"], [], []),
    # a second host's start of this revision failed so: it halts there, across waves ...
    (WAVE, [gpu("h4"), ok("h5")], [early("h2")], [("h4", "GpuFault")], [], ["h4"], []),
    # ... or within one wave (both quarantined, the first named)
    (WAVE, [gpu("h4"), gpu("h5")], [], [("h4", "GpuFault"), ("h5", "GpuFault")], [], ["h4", "h5"], []),
    # a host blocked before its start counts towards nothing; one host is counted once
    (WAVE, [gpu("h4", started=False), ok("h5")], [early("h2")], [], ["h4"], [], []),
    (WAVE, [gpu("h4"), ok("h5")], [early("h4")], [], ["h4"], ["h4"], []),
])
def test_the_wave_verdict(wave, outcomes, before, halt, excused, faulted, skipped) -> None:
    v = judge_wave(wave, outcomes, before)
    assert [(o.host, o.reason) for o in v.halt] == halt
    assert (list(v.excused), [e.host for e in v.faulted], list(v.skipped)) == (excused, faulted, skipped)


def test_a_halt_for_gpu_faults_says_why_and_quotes_them() -> None:
    [at] = judge_wave(CANARY, [gpu("h1")]).halt
    assert at == HostOutcome("h1", "GpuFault", f"the canary's start failed while its GPUs were sick ({ECC} (h1)): "
                                               "a revision can provoke a GPU fault, so a canary's is no excuse",
                             f"{ECC} (h1)", started=True)
    [at] = judge_wave(WAVE, [ok("h5"), gpu("h4")], [early("h2")]).halt
    assert at.host == "h4" and at.quote == f"{ECC} (h4)"
    assert at.message == (f"GPU faults on 2 hosts at this revision (h2: {ECC} (h2); h4: {ECC} (h4)): a revision "
                          "that provokes GPU faults is not excused twice")
    # a failure of the change keeps its own words
    assert judge_wave(CANARY, [crash("h1")]).halt == (crash("h1"),)


def test_the_starts_that_failed_with_sick_gpus_at_this_revision_on_record() -> None:
    rev, other = "c2" * 20, "c1" * 20
    marks = {"h10": GpuFault(ECC, 5, service="m", revision=rev), "h2": GpuFault("xid", 6, service="m", revision=rev),
             "h3": GpuFault(ECC, 7, service="m", revision=other), "h4": GpuFault(ECC, 8, service="n", revision=rev),
             "h5": GpuFault(ECC, 9), "h6": None}
    assert excuses_on_record("m", rev, marks) == (Excuse("h2", "xid"), Excuse("h10", ECC))


# ---- the halt: which host gets which quarantine, and how its result says it -------------------

def rollout_of(*waves: Wave) -> RolloutPlan:
    members = tuple(h for w in waves for h in w.hosts)
    return RolloutPlan(GroupKey("m", "sglang"), RolloutPolicy(1, 2), members, members, 2, waves)


W1, W2, W3 = Wave(1, ("h1",), canary=True), Wave(2, ("h2", "h3")), Wave(3, ("h4",))
HASHES = {f"h{i}": f"hash{i}" for i in range(1, 5)}
REV = "c3" * 20


def q(h: str, reason: str, at: HostOutcome, wave: Wave) -> Quarantine:
    return Quarantine(hash=HASHES[h], revision=REV, reason=Reason(reason), quote=at.quote, at=77, halted_at=at.host,
                      canary=wave.canary, wave=wave.number, cause=at.reason)


@pytest.mark.parametrize("wave, failed, untouched, reasons", [
    # the canary fails: it is quarantined for its own reason, every later wave's host as RolloutHalted
    (W1, [crash("h1")], ("h2", "h3", "h4"),
     {"h1": "CrashLoop", "h2": "RolloutHalted", "h3": "RolloutHalted", "h4": "RolloutHalted"}),
    # two hosts of a middle wave: both for the first one's reason (it halted there); the last wave untouched
    (W2, [crash("h3"), HostOutcome("h2", Reason.APPLY_FAILED, "write failed")], ("h4",),
     {"h3": "CrashLoop", "h2": "CrashLoop", "h4": "RolloutHalted"}),
    # the last wave: nothing left untouched
    (W3, [gpu("h4")], (), {"h4": "GpuFault"}),
    # a failure without a reason is Failed
    (W3, [HostOutcome("h4", None, "?")], (), {"h4": "Failed"}),
])
def test_the_halt(wave: Wave, failed: list[HostOutcome], untouched: tuple[str, ...], reasons: dict[str, str]) -> None:
    stop = halt(rollout_of(W1, W2, W3), wave, failed, REV, HASHES, now=77)
    at = failed[0]
    assert (stop.at.host, stop.failed, stop.untouched) == (at.host, tuple(o.host for o in failed), untouched)
    assert stop.at.reason == (at.reason or Reason.FAILED)
    cause = HostOutcome(at.host, at.reason or Reason.FAILED, at.message, at.quote)
    assert dict(stop.quarantines) == {h: q(h, r, cause, wave) for h, r in reasons.items()}


def test_the_halt_in_the_results_words() -> None:
    canary = halt(rollout_of(W1, W2, W3), W1, [crash("h1")], REV, HASHES, now=77)
    assert canary.failed_message(None) == "rollout halted here, 3 hosts left untouched"
    assert canary.failed_message("m: CrashLoop: ValueError: bad flag") == \
        "m: CrashLoop: ValueError: bad flag; rollout halted here, 3 hosts left untouched"
    assert canary.untouched_message("m", "c1" * 20) == \
        "m: rollout halted at canary h1: CrashLoop; not restarted, still running c1c1c1c"
    middle = halt(rollout_of(W1, W2, W3), W2, [crash("h3")], REV, HASHES, now=77)
    assert middle.failed_message("") == "rollout halted here, 1 host left untouched"
    assert middle.untouched_message("m", None) == "m: rollout halted at h3 (wave 2): CrashLoop; not restarted, " \
                                                  "still running ?"


@pytest.mark.parametrize("before, after", [
    (None, Reason.ROLLOUT_HALTED),                        # the halt is the host's only news
    (Reason.QUARANTINED, Reason.ROLLOUT_HALTED),          # another service on its last good is no failure
    (Reason.ROLLOUT_HALTED, Reason.ROLLOUT_HALTED),
    (Reason.CRASH_LOOP, Reason.CRASH_LOOP),               # a failure of its own keeps its reason
    (Reason.GPU_BUSY, Reason.GPU_BUSY),
])
def test_an_untouched_hosts_reason(before: Reason | None, after: Reason) -> None:
    assert halted_reason(before) == after


def test_a_rollout_result_takes_the_halt() -> None:
    ro = RolloutResult(rollout_of(W1, W2, W3), RolloutStatus.RUNNING)
    ro.halted(halt(rollout_of(W1, W2, W3), W2, [crash("h2")], REV, HASHES, now=77))
    assert (ro.status, ro.halted_at, ro.halted_wave, ro.reason, ro.quote, ro.untouched) == \
        (RolloutStatus.HALTED, "h2", 2, Reason.CRASH_LOOP, "ValueError: bad flag", ("h4",))
    assert ro.to_json()["status"] == "halted" and json.loads(json.dumps(ro.to_json()))["halted"]["reason"] == \
        "CrashLoop"
