"""Pull mode's wave schedule, pure parts (reconciler/pull/schedule.py): which wave a host is in,
which revision it may deploy given the commits' ages and the earlier waves' reports, what its
own report says; and fleet.toml [pull] as the loader checks it."""

from __future__ import annotations

import pytest

from reconciler.desired.fields import parse_duration
from reconciler.desired.load import MemorySnapshot, load_desired
from reconciler.desired.spec import PullWave
from reconciler.errors import ConfigError
from reconciler.plan.records import Result
from reconciler.pull.schedule import (
    Commit,
    Report,
    Standing,
    blocker,
    choose,
    earlier_hosts,
    publishes,
    span,
    standing_of,
    wave_of,
)

NOW = 1_000_000
MIN = 60
CANARY = PullWave("canary", {"wave": "canary"}, 0)
EARLY = PullWave("early", {"wave": "early"}, 30 * MIN)
REST = PullWave("rest", {}, 4 * 3600)
WAVES = (CANARY, EARLY, REST)


def chain(*ages: int) -> list[Commit]:
    """Commits newest first, c0 (the head), c1, ..., each `age` seconds old."""
    return [Commit(f"c{i}".ljust(40, "0"), NOW - age) for i, age in enumerate(ages)]


def rev(i: int) -> str:
    return f"c{i}".ljust(40, "0")


def report(host: str, i: int, standing: Standing, **kw: object) -> Report:
    return Report(host, rev(i), standing, **kw)  # type: ignore[arg-type]


def reports(*rs: Report) -> dict[str, dict[str, Report]]:
    out: dict[str, dict[str, Report]] = {}
    for r in rs:
        out.setdefault(r.host, {})[r.revision] = r
    return out


# ---- which wave -----------------------------------------------------------------------------


@pytest.mark.parametrize("labels, want", [
    ({"wave": "canary"}, 0),
    ({"wave": "early", "rack": "b"}, 1),
    ({"wave": "late"}, 2),              # matches only the wave without labels
    ({}, 2),
])
def test_a_host_is_in_the_first_wave_whose_labels_it_carries(labels, want) -> None:
    assert wave_of(labels, WAVES) == want


def test_a_host_that_matches_no_wave_goes_with_the_last() -> None:
    waves = (CANARY, EARLY)
    assert wave_of({"wave": "other"}, waves) == 1
    assert wave_of({"wave": "canary"}, ()) is None


def test_earlier_hosts_are_those_of_the_waves_before() -> None:
    labels = {"a": {"wave": "canary"}, "b": {"wave": "early"}, "c": {}, "d": {"wave": "canary"}}
    assert earlier_hosts(labels, WAVES, 2) == {"a": 0, "b": 1, "d": 0}
    assert earlier_hosts(labels, WAVES, 1) == {"a": 0, "d": 0}
    assert earlier_hosts(labels, WAVES, 0) == {}


def test_only_waves_that_a_later_wave_reads_publish() -> None:
    assert publishes(0, WAVES) and publishes(1, WAVES)
    assert not publishes(2, WAVES)
    assert not publishes(None, ())


# ---- which revision -------------------------------------------------------------------------


@pytest.mark.parametrize("ages, applied, wave, rs, want, skipped", [
    # the canary wave waits for nothing: the head
    ((5, 100), rev(1), 0, {}, 0, 0),
    # the early wave: the head is 5s old, the one before 40m: that one
    ((5, 40 * MIN), None, 1, {}, 1, 1),
    # ... but never older than what it applied: it stays there
    ((5, 40 * MIN), rev(0), 1, {}, 0, 0),
    ((5, 10 * MIN, 40 * MIN), rev(1), 1, {}, 1, 1),
    # nothing old enough on a fresh host: nothing yet
    ((5, 10), None, 1, {}, None, 2),
    # a canary failed the head: the early wave takes the commit before it
    ((40 * MIN, 50 * MIN), None, 1, reports(report("a", 0, Standing.BAD, reason="CrashLoop")), 1, 1),
    # a canary failed an ancestor and nothing since cleared it: blocked too
    ((40 * MIN, 50 * MIN, 60 * MIN), rev(2), 1, reports(report("a", 1, Standing.BAD)), 2, 2),
    # ... until a later commit is healthy there: that one (and only that one) clears it
    ((40 * MIN, 50 * MIN, 60 * MIN), rev(2), 1,
     reports(report("a", 1, Standing.BAD), report("a", 0, Standing.OK)), 0, 0),
    # a canary deploying the head now (pending, due in the future) holds it back
    ((40 * MIN, 50 * MIN), rev(1), 1, reports(report("a", 0, Standing.PENDING, until=NOW + 60)), 1, 1),
    # a pending report past its deadline says nothing (the canary never came back): age alone
    ((40 * MIN, 50 * MIN), rev(1), 1, reports(report("a", 0, Standing.PENDING, until=NOW - 1)), 0, 0),
    # ... and a report before it decides again
    ((40 * MIN, 50 * MIN), None, 1,
     reports(report("a", 0, Standing.PENDING, until=NOW - 1), report("a", 1, Standing.BAD)), None, 2),
    # inconclusive (locked, blocked by pre-flight) says nothing either
    ((40 * MIN, 50 * MIN), None, 1,
     reports(report("a", 0, Standing.INCONCLUSIVE), report("a", 1, Standing.OK)), 0, 0),
    # every earlier host counts: one ok does not clear another's failure
    ((40 * MIN, 50 * MIN), rev(1), 1, reports(report("a", 0, Standing.OK), report("b", 0, Standing.BAD)), 1, 1),
    # no report at all is no failure: age alone gates
    ((5 * 3600,), None, 2, {}, 0, 0),
])
def test_choose(ages, applied, wave, rs, want, skipped) -> None:
    c = chain(*ages)
    got = choose(c, applied, wave=wave, waves=WAVES, now=NOW, reports=rs)
    assert got.revision == (rev(want) if want is not None else None), got
    assert len(got.skipped) == skipped, got


def test_choose_says_why() -> None:
    c = chain(5, 40 * MIN)
    got = choose(c, rev(1), wave=1, waves=WAVES, now=NOW, reports={})
    assert got.why == "staying at the applied revision c100000 (nothing newer may deploy yet)"
    assert got.skipped[0].why == "5s old; wave early deploys a commit once it is 30m old"
    c = chain(40 * MIN, 50 * MIN)
    got = choose(c, None, wave=1, waves=WAVES, now=NOW,
                 reports=reports(report("gpu-1", 1, Standing.BAD, wave="canary", reason="CrashLoop")))
    assert got.skipped[0].why == "gpu-1 (canary) failed it at c100000, an ancestor: CrashLoop"
    assert got.revision is None and got.why == "no revision may deploy yet in wave early"
    got = choose(c, None, wave=1, waves=WAVES, now=NOW,
                 reports=reports(report("gpu-1", 0, Standing.PENDING, wave="canary", until=NOW + 125)))
    assert got.skipped[0].why == "gpu-1 (canary) is deploying it; its verdict is due within 2m5s"
    assert got.revision == rev(1)
    assert got.why == "c100000 is 50m old (wave early: 30m); no earlier wave stands against it"


def test_unusable_revisions_are_passed_over() -> None:
    c = chain(50 * MIN, 60 * MIN)
    got = choose(c, None, wave=1, waves=WAVES, now=NOW, reports={}, unusable={rev(0): "cannot be loaded"})
    assert got.revision == rev(1) and got.skipped[0].why == "cannot be loaded"


def test_blocker_reads_each_host_from_the_candidate_down() -> None:
    c = chain(1, 2, 3, 4)
    rs = reports(report("a", 2, Standing.BAD, reason="StartFailed"), report("a", 1, Standing.OK))
    assert blocker(c, 0, rs, NOW) is None          # a's newest at or below c0 is ok at c1
    assert blocker(c, 1, rs, NOW) is None
    assert blocker(c, 2, rs, NOW) == "a failed it: StartFailed"
    assert blocker(c, 3, rs, NOW) is None          # c3 is older than the failure


# ---- a host's own report --------------------------------------------------------------------


@pytest.mark.parametrize("result, failed, want", [
    (Result.IN_SYNC, False, Standing.OK),
    (Result.CONVERGED, False, Standing.OK),
    (Result.ROLLED_BACK, False, Standing.BAD),
    (Result.QUARANTINED, False, Standing.BAD),     # it holds a quarantined version: later waves wait
    (Result.FAILED, True, Standing.BAD),           # a first deploy that failed health, a failed rollback
    (Result.FAILED, False, Standing.INCONCLUSIVE), # locked, pre-flight, a secret: nothing about the content
    (Result.WOULD_CHANGE, False, Standing.INCONCLUSIVE),
])
def test_standing_of(result, failed, want) -> None:
    assert standing_of(result, failed_health=failed) is want


def test_report_round_trip_and_lenient_parse() -> None:
    r = Report("gpu-1", rev(0), Standing.PENDING, wave="canary", at=5, until=99, services={"m": "deploy"})
    back = Report.parse(r.dumps(), host="gpu-1", revision=rev(0))
    assert back == r
    # the host and revision are the notes ref's and the commit's, whatever the text says
    assert Report.parse(r.dumps(), host="gpu-2", revision=rev(1)) == Report(
        "gpu-2", rev(1), Standing.PENDING, wave="canary", at=5, until=99, services={"m": "deploy"})
    assert Report.parse("not json", host="h", revision="r") is None
    assert Report.parse('{"standing": "great"}', host="h", revision="r") is None
    assert Report.parse('["ok"]', host="h", revision="r") is None
    odd = Report.parse('{"standing": "ok", "at": "x", "services": {"m": 1}, "extra": true}', host="h", revision="r")
    assert odd == Report("h", "r", Standing.OK)


def test_same_report_is_not_written_twice() -> None:
    ok = Report("h", "r", Standing.OK, at=1, services={"m": "changed"})
    assert ok.same_as(Report("h", "r", Standing.OK, at=2, services={"m": "in-sync"}))
    assert not ok.same_as(Report("h", "r", Standing.BAD, at=1))
    assert not ok.same_as(None)
    pending = Report("h", "r", Standing.PENDING, at=1, until=10)
    assert not pending.same_as(Report("h", "r", Standing.PENDING, at=1, until=20))   # a new deadline counts


@pytest.mark.parametrize("seconds, want", [
    (0, "0s"), (59, "59s"), (60, "1m"), (125, "2m5s"), (900, "15m"), (3600, "1h"), (5400, "1h30m"),
    (86400 + 7200, "1d2h"), (-3, "0s"),
])
def test_span(seconds, want) -> None:
    assert span(seconds) == want


# ---- fleet.toml [pull] ----------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0), ("1d", 86400.0), ("1h30m", 5400.0), ("0.5s", 0.5),
    ("45", 45.0), ("0", 0.0), ("", None), ("5x", None), ("m", None), ("-1", None), ("1h 30m", None),
])
def test_parse_duration(text, want) -> None:
    assert parse_duration(text) == want


HOSTS = {
    "hosts/a.toml": 'address = "127.0.0.5"\nlabels = { wave = "canary" }\n',
    "hosts/b.toml": 'address = "127.0.0.6"\nlabels = { wave = "early" }\n',
    "hosts/c.toml": 'address = "127.0.0.7"\n',
}


def test_pull_waves_load() -> None:
    fleet = """
[pull]
waves = [
  { name = "canary", labels = { wave = "canary" }, after = "0s" },
  { labels = { wave = "early" }, after = "1h30m" },
  { name = "rest", after = 7200 },
]
"""
    state = load_desired(MemorySnapshot({"fleet.toml": fleet, **HOSTS}))
    assert state.settings.pull_waves == (PullWave("canary", {"wave": "canary"}, 0.0),
                                         PullWave("wave-2", {"wave": "early"}, 5400.0), PullWave("rest", {}, 7200.0))
    assert load_desired(MemorySnapshot(HOSTS)).settings.pull_waves == ()


@pytest.mark.parametrize("waves, key, message", [
    ('{ after = "5x" }', "pull.waves[#1].after", 'expected a duration like "30m"'),
    ("{ after = -1 }", "pull.waves[#1].after", "expected a duration"),
    ("{ after = true }", "pull.waves[#1].after", "expected a duration"),
    ('{ color = "red" }', "pull.waves[#1].color", "unknown key (allowed: name, labels, after)"),
    ('{ labels = { wave = "canry" } }', "pull.waves[#1].labels",
     "no host carries wave=canry (labels in use: wave=canary, wave=early)"),
    ('{ name = "x", labels = { wave = "canary" } }, { name = "x" }', "pull.waves[#2].name",
     "wave 'x' is named twice (also pull.waves[#1]); names must be unique"),
    ('{ labels = { wave = "canary" }, after = "1h" }, { after = "30m" }', "pull.waves[#2].after",
     "1800s is sooner than the wave before it (3600s)"),
    ('{ after = "1h" }, { labels = { wave = "canary" }, after = "2h" }', "pull.waves[#2]",
     "comes after pull.waves[#1], which has no labels and so takes every remaining host"),
])
def test_pull_waves_problems_name_file_and_key(waves, key, message) -> None:
    with pytest.raises(ConfigError) as e:
        load_desired(MemorySnapshot({"fleet.toml": f"[pull]\nwaves = [ {waves} ]\n", **HOSTS}))
    found = [p for p in e.value.problems if p.key == key]
    assert found and found[0].file == "fleet.toml" and message in found[0].message, e.value.problems
