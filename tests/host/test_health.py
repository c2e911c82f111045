"""Pure health judges: systemd states (../shared/SYSTEMD.md) and the journal line picker; the
watches of one host sharing one `systemctl show` per tick (over a scripted fake transport; the
real thing is in tests/e2e/test_e2e_health.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from reconciler.desired.spec import HealthSpec
from reconciler.errors import ConnectError
from reconciler.host.health import SYSTEMD_RAMP, SystemdWatch, watch_service
from reconciler.host.transport import Completed
from reconciler.plan.facts.journal import JournalEntry as E
from reconciler.plan.facts.journal import parse_journal
from reconciler.plan.judges import explain, judge_systemd, spawn_failure
from tests.clock import FakeClock
from tests.host.programs import headers


@pytest.mark.parametrize("props,baseline,state,reason", [
    ({"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "0"}, 0, "running", ""),
    ({"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart", "Result": "exit-code",
      "NRestarts": "3"}, 3, "crashed", "CrashLoop"),          # the incident's state
    ({"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart-queued"}, 0, "crashed",
     "CrashLoop"),
    ({"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "3"}, 2, "crashed",
     "CrashLoop"),
    ({"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "2"}, 2, "running", ""),
    ({"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code",
      "NRestarts": "5"}, 0, "crashed", "CrashLoop"),            # start limit hit, Result still exit-code
    ({"LoadState": "bad-setting", "ActiveState": "inactive"}, 0, "not-loaded", "UnitNotLoaded"),
    ({"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success"}, 0, "exited",
     "Exited"),
    ({"LoadState": "loaded", "ActiveState": "activating", "SubState": "start"}, 0, "starting", ""),
    ({}, 0, "starting", ""),                                    # missing keys are tolerated
])
def test_judge_systemd(props, baseline, state, reason):
    v = judge_systemd(props, baseline)
    assert (v.state, v.reason or "") == (state, reason)


# Captured on a test host (systemd 252): ExecStartPre= failing under Restart=always, and a
# Type=notify unit whose start timed out. Neither ever entered `active`.
PRE_FAILS = {"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart", "Result": "exit-code",
             "NRestarts": "0", "ActiveEnterTimestampMonotonic": "0", "InvocationID": "4b6e"}
NOTIFY_TIMEOUT = {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "timeout",
                  "NRestarts": "0", "ActiveEnterTimestampMonotonic": "0", "InvocationID": "0522"}


@pytest.mark.parametrize("props,kw,state,reason", [
    (PRE_FAILS, {}, "crashed", "StartFailed"),
    (NOTIFY_TIMEOUT, {}, "crashed", "StartFailed"),
    # a restart of a unit that was active: it never became active again since our restart
    ({**PRE_FAILS, "ActiveEnterTimestampMonotonic": "1230"}, {"baseline_active_enter": "1230"}, "crashed",
     "StartFailed"),
    # it did become active again, then crashed: a crash loop
    ({**PRE_FAILS, "ActiveEnterTimestampMonotonic": "1240"}, {"baseline_active_enter": "1230"}, "crashed",
     "CrashLoop"),
    # our queued (--no-block) start has not begun: the old process's state says nothing yet
    ({**PRE_FAILS, "InvocationID": "old"}, {"baseline_invocation": "old"}, "starting", ""),
    ({"LoadState": "loaded", "ActiveState": "deactivating", "SubState": "stop-sigterm", "InvocationID": "old"},
     {"baseline_invocation": "old"}, "starting", ""),
    # a start that timed out, caught while systemd stops what never came up
    ({**NOTIFY_TIMEOUT, "ActiveState": "deactivating", "SubState": "stop-sigterm"}, {}, "crashed", "StartFailed"),
    # a unit never started before, its first start queued (--no-block) and not yet run: the job
    # is pending, so inactive/dead says nothing yet (the apply's own last reading can see this)
    ({"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success",
      "ActiveEnterTimestampMonotonic": "0", "InvocationID": "", "Job": "81"}, {}, "starting", ""),
    # the same once the job is gone and it never came up: the start failed
    ({"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success",
      "ActiveEnterTimestampMonotonic": "0", "InvocationID": "", "Job": ""}, {}, "crashed", "StartFailed"),
    # our restart refused by systemd's start limit (captured on a test host after restarts in
    # quick succession): no new invocation will begin, so it is not "waiting for the start"
    ({"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "start-limit-hit",
      "NRestarts": "0", "InvocationID": "old", "Job": ""}, {"baseline_invocation": "old"}, "refused",
     "StartLimitHit"),
    # our restart of a unit in its crash loop (activating/auto-restart, its burst used up),
    # captured on a test host: refused the same, but Result= keeps the crash's exit-code
    ({"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code",
      "NRestarts": "4", "InvocationID": "old", "Job": ""}, {"baseline_invocation": "old"}, "refused",
     "StartLimitHit"),
    # the same state with our job still queued, or after a new invocation, is not a refusal
    ({"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "start-limit-hit",
      "NRestarts": "0", "InvocationID": "old", "Job": "93"}, {"baseline_invocation": "old"}, "starting", ""),
    ({"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "start-limit-hit",
      "NRestarts": "5", "InvocationID": "new", "ActiveEnterTimestampMonotonic": "1240", "Job": ""},
     {"baseline_invocation": "old", "baseline_active_enter": "1230"}, "crashed", "CrashLoop"),
    # a bad unit is reported even before the start begins
    ({"LoadState": "bad-setting", "InvocationID": "old"}, {"baseline_invocation": "old"}, "not-loaded",
     "UnitNotLoaded"),
])
def test_judge_systemd_start_failures(props, kw, state, reason):
    v = judge_systemd(props, 0, **kw)
    assert (v.state, v.reason or "") == (state, reason)


INCIDENT = "MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer and SGLANG_ENABLE_SPEC_V2=1"


def test_explain_prefers_the_service_line_that_says_what_is_needed():
    lines = [E("[standin] server_args=ServerArgs(model_path='/models/x')", True),
             E("Load weight begin. avail mem=79.1 GB", True),
             E(INCIDENT, True),
             E("sglang-qwen.service: Main process exited, code=exited, status=1/FAILURE", False),
             E("sglang-qwen.service: Failed with result 'exit-code'.", False)]
    assert explain(lines) == INCIDENT


@pytest.mark.parametrize("line", [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error",
    "OSError: [Errno 98] Address already in use",
])
def test_explain_picks_common_failures_over_noise(line):
    lines = [E("Traceback (most recent call last):", True), E('  File "x.py", line 3, in <module>', True),
             E(line, True), E("INFO: shutting down", True)]
    assert explain(lines) == line


def test_explain_falls_back_to_systemd_when_the_service_said_nothing():
    lines = [E("m.service: Failed to locate executable /usr/bin/nope: No such file or directory", False),
             E("m.service: Failed with result 'exit-code'.", False)]
    assert "Failed to locate executable" in explain(lines)


def test_parse_journal_marks_systemd_lines_and_decodes_bytes():
    out = "\n".join(json.dumps(e) for e in [
        {"MESSAGE": "hello", "_PID": "42"},
        {"MESSAGE": "Started m.service.", "_PID": "1", "SYSLOG_IDENTIFIER": "systemd"},
        {"MESSAGE": list(b"caf\xc3\xa9 \xff"), "_PID": "42"},
    ])
    got = parse_journal(out)
    assert got[0] == E("hello", True) and got[1] == E("Started m.service.", False)
    assert got[2].message.startswith("café")


# systemd's journal entries as captured on a test host (journalctl -u crashy -o json): its own
# lines carry INVOCATION_ID, the service's _SYSTEMD_INVOCATION_ID; the exit, EXIT_CODE/STATUS.
CAPTURED = [
    {"MESSAGE": "Started crashy.service.", "_PID": "1", "SYSLOG_IDENTIFIER": "systemd", "INVOCATION_ID": "i1"},
    {"MESSAGE": "hello", "_PID": "788", "SYSLOG_IDENTIFIER": "sh", "_SYSTEMD_INVOCATION_ID": "i1"},
    {"MESSAGE": "crashy.service: Main process exited, code=exited, status=3/NOTIMPLEMENTED", "_PID": "1",
     "SYSLOG_IDENTIFIER": "systemd", "INVOCATION_ID": "i1", "EXIT_CODE": "exited", "EXIT_STATUS": "3"},
]


def test_parse_journal_keeps_the_invocation_and_how_the_process_ended():
    got = parse_journal("\n".join(json.dumps(e) for e in CAPTURED))
    assert got == [E("Started crashy.service.", False, "i1"), E("hello", True, "i1"),
                   E("crashy.service: Main process exited, code=exited, status=3/NOTIMPLEMENTED", False, "i1",
                     "exited", "3")]


def exited(status: str, invocation: str = "i2", code: str = "exited") -> E:
    return E(f"m.service: Main process exited, code={code}, status={status}", False, invocation, code,
             status.split("/")[0])


AUTO_RESTART = {"ActiveState": "activating", "SubState": "auto-restart", "Result": "exit-code",
                "ExecMainCode": "1", "ExecMainStatus": "219", "NRestarts": "1"}


@pytest.mark.parametrize("props,entries,baseline,why", [
    # issue 32: the process could not be put in its cgroup, the service never ran: no verdict
    (AUTO_RESTART, [exited("219/CGROUP")], "i1", "exit status 219/CGROUP"),
    # ... seen from systemd's state alone (the journal read gave nothing)
    (AUTO_RESTART, [], "i1", "exit status 219/CGROUP"),
    ({**AUTO_RESTART, "ExecMainStatus": "204"}, [exited("204/MEMORY")], "", "exit status 204/MEMORY"),
    ({"ActiveState": "failed", "Result": "resources"}, [], "i1", "Result=resources"),
    # the service said something: it ran, the crash stands
    (AUTO_RESTART, [E("boom", True, "i2"), exited("219/CGROUP", "i3")], "i1", None),
    # an exit of its own (status 1), or a signal, beside a set-up failure: the crash stands
    (AUTO_RESTART, [exited("1/FAILURE"), exited("219/CGROUP", "i3")], "i1", None),
    ({**AUTO_RESTART, "ExecMainStatus": "0", "ExecMainCode": "2"}, [exited("9/KILL", code="killed")], "i1", None),
    # a unit mistake of systemd's range (203/EXEC: the binary is missing) is the version's own
    ({**AUTO_RESTART, "ExecMainStatus": "203"}, [exited("203/EXEC")], "i1", None),
    # lines of the process that ran before our start are not evidence either way
    (AUTO_RESTART, [E("old process says bye", True, "i1"), exited("219/CGROUP")], "i1", "219/CGROUP"),
    # nothing at all to go on but the state: the crash stands, as before
    ({"ActiveState": "failed", "Result": "exit-code", "ExecMainCode": "1", "ExecMainStatus": "1"}, [], "i1", None),
])
def test_a_crash_is_a_verdict_only_with_evidence_that_the_service_failed(props, entries, baseline, why):
    got = spawn_failure(props, entries, baseline)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got and "never ran" in got


# ---- one round trip per host per tick ----------------------------------------------------------
# On a virtual clock (tests/clock.py): the ticks, round trips and time-outs pass at once and the
# same way on every run, so the tests count round trips and read their virtual times exactly
# (the times are binary fractions: sums of them are exact).

POLL = 1 / 16                  # the tick
RTT = 1 / 128                  # one round trip to the host
RUNNING = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "0",
           "InvocationID": "new", "ActiveEnterTimestampMonotonic": "5"}
CRASHING = {**RUNNING, "ActiveState": "activating", "SubState": "auto-restart", "NRestarts": "1",
            "Result": "exit-code"}


class ScriptedHost:
    """A fake transport: `systemctl show` answers each unit from a script of readings (the n-th
    call that names it gets reading n, the last one repeats); journalctl answers one line. Each
    round trip takes RTT on the clock; `shows` has each `systemctl show`'s virtual time (when
    its answer came) and units."""

    host = "h1"

    def __init__(self, script: dict[str, list[dict[str, str]]], fail: bool = False,
                 journal: list[dict[str, str]] | None = None, clock: FakeClock | None = None):
        self.script, self.fail = script, fail
        self.clock = clock if clock is not None else FakeClock()
        self.journal = journal if journal is not None else [{"MESSAGE": "boom: needs --flag x", "_PID": "9"}]
        self.shows: list[tuple[float, list[str]]] = []
        self.seen: dict[str, int] = {}

    async def run(self, cmd, *, input=None, check=False, timeout=60.0, what="command"):
        await self.clock.sleep(RTT)
        params = headers(input)[-1]                   # journal.sh's or show.sh's named parameters
        token = params["token"][0]
        if "since" in params:
            return Completed(0, f"{token} J -\n" + "".join(json.dumps(e) + "\n" for e in self.journal)
                             + f"{token} END\n", "")
        assert "props" in params, input
        if self.fail:
            raise ConnectError(self.host, "connection lost")
        units = params["unit"]
        self.shows.append((self.clock.elapsed(), units))
        blocks = []
        for u in units:
            n = self.seen.get(u, 0)
            self.seen[u] = n + 1
            readings = self.script[u.removesuffix(".service")]
            props = readings[min(n, len(readings) - 1)]
            blocks.append("\n".join([f"Id={u}", *(f"{k}={v}" for k, v in props.items())]))
        return Completed(0, f"{token} S -\n" + "\n\n".join(blocks) + "\n", "")


def watch_all(t, names, health, *, shared=True):
    async def main():
        systemd = SystemdWatch(t, POLL, t.clock) if shared else None
        return await asyncio.gather(*(watch_service(t, n, health, baseline_restarts=0, since_epoch=0,
                                                    baseline_invocation="old", systemd_poll=POLL,
                                                    systemd=systemd, clock=t.clock) for n in names))
    return asyncio.run(main())


def test_the_watches_of_one_host_share_one_systemctl_show_per_tick():
    names = ["a", "b", "c", "d"]
    t = ScriptedHost({"a": [RUNNING], "b": [RUNNING], "c": [RUNNING], "d": [RUNNING]})
    out = watch_all(t, names, HealthSpec(stable_for=6 * POLL, startup_timeout=5))
    assert [o.reason for o in out] == ["Healthy"] * 4
    # every round trip reads all four units: the first reading, then one per tick of stable_for
    assert all(units == [f"{n}.service" for n in names] for _, units in t.shows)
    assert [at for at, _ in t.shows] == [RTT + i * POLL for i in range(7)]   # paced as a watch of its own
    assert all(o.seconds == RTT + 6 * POLL for o in out)

    alone = ScriptedHost({"a": [RUNNING], "b": [RUNNING], "c": [RUNNING], "d": [RUNNING]})
    watch_all(alone, names, HealthSpec(stable_for=6 * POLL, startup_timeout=5), shared=False)
    assert len(alone.shows) == 4 * 7 and all(len(units) == 1 for _, units in alone.shows)


def test_a_crash_is_caught_at_the_first_tick_that_shows_it_and_the_others_go_on():
    # b runs, then crash-loops from its third reading on; a and c stay healthy
    t = ScriptedHost({"a": [RUNNING], "b": [RUNNING, RUNNING, CRASHING], "c": [RUNNING]})
    out = watch_all(t, ["a", "b", "c"], HealthSpec(stable_for=8 * POLL, startup_timeout=5))
    by = {o.service: o for o in out}
    assert by["b"].reason == "Unstable" and by["b"].quote == "boom: needs --flag x"
    assert by["a"].healthy and by["c"].healthy
    assert t.seen["b.service"] == 3              # no reading after the crash showed
    crash_at = t.shows[2][0]
    assert by["b"].seconds == crash_at + RTT     # the verdict: the journal's round trip after that reading
    assert all(units == ["a.service", "c.service"] for _, units in t.shows[3:])   # b is no longer read
    assert len(t.shows) == 9 and by["a"].seconds == by["c"].seconds == RTT + 8 * POLL


def test_a_failed_round_trip_fails_every_watch_of_that_tick():
    t = ScriptedHost({"a": [RUNNING], "b": [RUNNING]}, fail=True)
    with pytest.raises(ConnectError):
        watch_all(t, ["a", "b"], HealthSpec(stable_for=1, startup_timeout=5))


def test_a_watch_that_never_runs_times_out_at_its_startup_timeout():
    starting = {**RUNNING, "ActiveState": "activating", "SubState": "start"}
    t = ScriptedHost({"a": [starting]})
    (out,) = watch_all(t, ["a"], HealthSpec(stable_for=0, startup_timeout=30))
    assert out.reason == "StartTimeout" and "within startup_timeout=30s" in out.message
    # read every tick until the first reading at or past 30 s, then the journal: no real wait
    assert t.shows[-1][0] == RTT + 480 * POLL and len(t.shows) == 481
    assert out.seconds == t.shows[-1][0] + RTT


def test_a_newer_revision_ends_every_shared_watch_at_once():
    clock = FakeClock()
    events: list[tuple[float, str]] = []

    async def main():
        t = ScriptedHost({"a": [{**RUNNING, "InvocationID": "old"}], "b": [{**RUNNING, "InvocationID": "old"}]},
                         clock=clock)
        cancel = asyncio.Event()
        systemd = SystemdWatch(t, 10.0, clock)          # a long tick: the watches wait on it
        watches = asyncio.gather(*(watch_service(t, n, HealthSpec(startup_timeout=60), baseline_restarts=0,
                                                 since_epoch=0, baseline_invocation="old", cancel=cancel,
                                                 systemd=systemd) for n in "ab"))
        await clock.sleep(1.0)          # the first reading and the ramp's came; the next tick is 10 s away
        events.append((clock.elapsed(), "newer revision"))
        cancel.set()
        out = await watches
        events.append((clock.elapsed(), "watches ended"))
        return out, len(t.shows)
    out, shows = asyncio.run(main())
    assert [o.reason for o in out] == ["Superseded", "Superseded"] and shows == 1 + len(SYSTEMD_RAMP)
    assert events == [(1.0, "newer revision"), (1.0, "watches ended")]    # no tick waited for
    assert all(o.seconds == 1.0 for o in out)


@pytest.mark.parametrize("stable_for,phases", [
    (0.3, ["starting", "healthy, checking it stays stable for 0.3s", "healthy"]),
    (0, ["starting", "healthy"]),       # no window to wait out: no phase that asks for one
])
def test_the_phases_a_watch_reports(stable_for, phases):
    seen: list[str] = []

    async def main():
        t = ScriptedHost({"a": [RUNNING]})
        return await watch_service(t, "a", HealthSpec(stable_for=stable_for, startup_timeout=5), baseline_restarts=0,
                                   since_epoch=0, baseline_invocation="old", systemd_poll=POLL,
                                   on_phase=lambda _n, p, _e, _t: seen.append(p), clock=t.clock)
    assert asyncio.run(main()).reason == "Healthy"
    assert seen == phases


SPAWN_FAILED = {**CRASHING, "ExecMainCode": "1", "ExecMainStatus": "219"}
SPAWN_JOURNAL = [{"MESSAGE": "a.service: Main process exited, code=exited, status=219/CGROUP", "_PID": "1",
                  "SYSLOG_IDENTIFIER": "systemd", "INVOCATION_ID": "new", "EXIT_CODE": "exited", "EXIT_STATUS": "219"}]


@pytest.mark.parametrize("journal,reason", [
    (SPAWN_JOURNAL, "Inconclusive"),                                    # the service never ran
    ([*SPAWN_JOURNAL, {"MESSAGE": "boom", "_PID": "9", "_SYSTEMD_INVOCATION_ID": "new"}], "CrashLoop"),
])
def test_a_crash_without_evidence_that_the_service_failed_is_no_verdict(journal, reason):
    t = ScriptedHost({"a": [SPAWN_FAILED]}, journal=journal)
    out = watch_all(t, ["a"], HealthSpec(stable_for=0, startup_timeout=5))[0]
    assert (out.healthy, out.reason) == (False, reason)
    if reason == "Inconclusive":
        assert "219/CGROUP" in out.message and "never ran" in out.message


def test_a_start_refused_for_the_start_limit_is_reported_not_retried_by_the_watch():
    refused = {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "start-limit-hit",
               "NRestarts": "0", "InvocationID": "old", "Job": ""}
    t = ScriptedHost({"a": [refused]})
    out = watch_all(t, ["a"], HealthSpec(stable_for=0, startup_timeout=5))[0]
    assert out.reason == "StartLimitHit"
    assert [u for _, u in t.shows] == [["a.service"]]     # one reading; no systemctl start of its own
