"""Host output is data (review N5, N6) for the health watch: an exception in one watch is that
service's no verdict (Inconclusive), never the run's end, and what a watch quotes of the journal
is redacted whole, then cut. Over the scripted fake transport of test_health.py (the real thing:
tests/e2e/test_e2e_progress.py)."""

from __future__ import annotations

import asyncio

import pytest

from reconciler.desired.spec import HealthSpec
from reconciler.errors import ConnectError
from reconciler.host.health import SystemdWatch, watch_service
from reconciler.host.transport import Completed
from reconciler.plan.facts.journal import JOURNAL_BYTES, Journal, parse_journal
from reconciler.plan.facts.journal import JournalEntry as E
from reconciler.plan.judges import EXPLAIN_SCAN, explain
from tests.host.programs import headers
from tests.host.test_health import CRASHING, POLL, RUNNING, ScriptedHost, watch_all


def test_explain_matches_in_a_lines_first_characters_only_and_a_cut_first_entry_is_skipped():
    # a pattern with `.*` over a 48 KiB line of a hostile service takes seconds; past EXPLAIN_SCAN
    # a line is not searched (what it says there is still quoted, whole, if it is picked)
    late = "x" * EXPLAIN_SCAN + " needs --mamba-scheduler-strategy extra_buffer"
    assert explain([E("RuntimeError: boom", True), E(late, True)]) == "RuntimeError: boom"
    assert explain([E("RuntimeError: boom", True), E(late[-60:], True)]) == late[-60:].strip()
    # the read keeps the newest JOURNAL_BYTES: its first entry may be cut, and is no JSON
    assert Journal("m.service", 5).constants["BYTES"] == str(JOURNAL_BYTES)
    assert "| tail -c \"$BYTES\"" in Journal.text()
    assert [e.message for e in parse_journal('GE": "cut"}\n{"MESSAGE": "whole", "_PID": "9"}\n')] == ["whole"]


# ---- an exception in one watch: that service's no verdict, never the run's end (review N5) ------

INV_A, INV_B = "a" * 32, "b" * 32
E4 = "Loading safetensors checkpoint shards:  50% Completed | " + "9" * 400 + "/1 ["


class LoadingScriptedHost(ScriptedHost):
    """ScriptedHost, and the journal read of the services loading (progress.sh, put before the
    tick's `systemctl show`): each invocation's `lines`, framed as the program frames them."""

    def __init__(self, script, lines: dict[str, list[str]], **kw):
        super().__init__(script, **kw)
        self.lines = lines

    async def run(self, cmd, *, input=None, check=False, timeout=60.0, what="command"):
        programs = headers(input)                  # progress.sh's parameters first, where it runs
        if len(programs) == 1:
            return await super().run(cmd, input=input, check=check, timeout=timeout, what=what)
        token, reads = programs[0]["token"][0], [r.split()[0] for r in programs[0]["read"]]
        out = "".join(f"{token} U {inv}\n" + "".join(f"{token} L {x}\n" for x in self.lines.get(inv, []))
                      for inv in reads) + f"{token} END\n"
        res = await super().run(cmd, input=input.split("\n\n", 1)[1], timeout=timeout, what=what)
        return Completed(res.exit_status, out + res.stdout, res.stderr)


def test_an_exception_reading_one_services_progress_is_its_no_verdict_and_the_others_are_judged(monkeypatch):
    # RECONCILER_FAULT=progress-raises: reading a line with a count past the parser's raises, as
    # reading E4's line did (OverflowError, from the shared tick: every watch of the host, and
    # out of the run). Now b's watch ends in no verdict; a, on the same ticks, is judged.
    monkeypatch.setenv("RECONCILER_FAULT", "progress-raises")
    a, b = {**RUNNING, "InvocationID": INV_A}, {**RUNNING, "InvocationID": INV_B}
    t = LoadingScriptedHost({"a": [a], "b": [b]}, {INV_A: ["Load weight begin."], INV_B: [E4]})
    out = {o.service: o for o in watch_all(t, ["a", "b"], HealthSpec(stable_for=8 * POLL, startup_timeout=5))}
    assert out["a"].reason == "Healthy"
    assert (out["b"].healthy, out["b"].reason, out["b"].quote) == (False, "Inconclusive", None)
    assert out["b"].message.startswith("no verdict: the health watch failed (OverflowError at progress.py:")
    assert "injected fault progress-raises" in out["b"].message
    assert all(units == ["a.service"] for _, units in t.shows[3:])        # b is no longer read


def test_without_the_fault_e4s_line_is_no_count_and_the_watch_is_healthy():
    a = {**RUNNING, "InvocationID": INV_A}
    t = LoadingScriptedHost({"a": [a]}, {INV_A: ["Load weight begin.", E4]})
    assert watch_all(t, ["a"], HealthSpec(stable_for=8 * POLL, startup_timeout=5))[0].reason == "Healthy"


def test_any_exception_a_watch_meets_is_its_no_verdict_but_a_hosts_own_error_is_not():
    said: list[tuple[str, str]] = []

    def phase(service: str, p: str, _e: float, _t: float) -> None:
        said.append((service, p))
        if service == "b" and p.startswith("healthy"):
            raise KeyError("a bug in a progress view")

    async def main():
        t = ScriptedHost({"a": [RUNNING], "b": [RUNNING]})
        systemd = SystemdWatch(t, POLL, t.clock)
        return await asyncio.gather(*(watch_service(t, n, HealthSpec(stable_for=4 * POLL, startup_timeout=5),
                                                    baseline_restarts=0, since_epoch=0, baseline_invocation="old",
                                                    systemd=systemd, on_phase=phase) for n in "ab"))
    a, b = asyncio.run(main())
    assert a.reason == "Healthy" and b.reason == "Inconclusive"
    assert b.message.startswith("no verdict: the health watch failed (KeyError at test_watch_containment.py:")
    assert said[-2:] == [("b", "no verdict: Inconclusive"), ("a", "healthy")]    # the view is told
    # a lost connection is the host's failure, not a verdict on a service: it still ends the host run
    with pytest.raises(ConnectError):
        watch_all(ScriptedHost({"a": [RUNNING]}, fail=True), ["a"], HealthSpec(stable_for=1, startup_timeout=5))


# ---- quotes: redacted whole, then cut (review N6) -------------------------------------------------

def test_a_secret_across_the_cut_of_a_journal_quote_or_a_start_error_leaves_no_fragment():
    from reconciler import redact
    from reconciler.host.health import QUOTE_MAX
    from tests.test_redact import fresh, leaked, straddling
    secret = fresh("Zq9-vT3")
    redact.register(secret)
    line = "RuntimeError: " + straddling(secret, QUOTE_MAX - 14, after=" " + "w" * 2000)
    assert secret not in line[:QUOTE_MAX] and leaked(secret, line[:QUOTE_MAX])
    t = ScriptedHost({"a": [CRASHING]}, journal=[{"MESSAGE": line, "_PID": "9", "_SYSTEMD_INVOCATION_ID": "new"}])
    out = watch_all(t, ["a"], HealthSpec(stable_for=0, startup_timeout=5))[0]
    assert out.reason == "CrashLoop" and out.quote is not None and out.quote.startswith("RuntimeError: x")
    assert len(out.quote) == QUOTE_MAX and "***" in out.quote and not leaked(secret, out.quote)
    assert out.journal == [out.quote]

    async def refused():
        t = ScriptedHost({"a": [RUNNING]})
        return await watch_service(t, "a", HealthSpec(startup_timeout=5), baseline_restarts=0, since_epoch=0,
                                   start_error=line, clock=t.clock)
    out = asyncio.run(refused())
    assert out.reason == "StartFailed" and out.quote == "boom: needs --flag x"
    assert "***" in out.message and not leaked(secret, out.message)
