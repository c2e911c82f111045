"""Deploy status on the commit (issue 14): the git notes' lines and how they merge, writing them
with pygit2 (compare-and-swap, shared-repo modes), the forge's commit-status payloads and its
sender against a fake forge on 127.0.0.1, the controller config, and the rows of
`status --live` from a host's facts. No test hosts: the end-to-end tests are in
tests/e2e/test_e2e_deploy_status.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pygit2
import pytest

from reconciler import redact
from reconciler.controller import forge, gitnotes
from reconciler.controller.config import load_config
from reconciler.controller.gitnotes import NoteLine, merge, run_lines
from reconciler.desired.load import MemorySnapshot, load_desired
from reconciler.errors import ConfigError
from reconciler.host.health import Outcome
from reconciler.loop import live
from reconciler.loop.results import FleetResult, HostResult, ServiceEvent
from reconciler.plan.facts import HostFacts, ServiceFacts
from reconciler.plan.model import HostPlan
from reconciler.plan.records import HostRecord, Pending, Quarantine, Result, ServiceRecord

B = "b" * 40          # the deployed commit
A = "a" * 40          # the last good one
NOW = 1_795_000_000   # 2026-11-18T11:06:40Z
QUOTE = "RuntimeError: MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer"


def _plan(host: str) -> HostPlan:
    return HostPlan(host, B, (), {})


def converged(host: str) -> HostResult:
    return HostResult(host, "127.0.0.5", Result.CONVERGED, plan=_plan(host),
                      events=[ServiceEvent("model-a", "deploy", B, "h1", Outcome("model-a", True, "Healthy", "ok"))])


def rolled_back(host: str) -> HostResult:
    return HostResult(host, "127.0.0.6", Result.ROLLED_BACK, plan=_plan(host), reason="RolledBack",
                      message=f"sglang: CrashLoop: {QUOTE}; rolled back to {A[:7]}",
                      events=[ServiceEvent("sglang", "deploy", B, "h2",
                                           Outcome("sglang", False, "CrashLoop", "crash loop", QUOTE)),
                              ServiceEvent("sglang", "rollback", A, "h1", Outcome("sglang", True, "Healthy", "ok"))])


def in_sync(host: str) -> HostResult:
    return HostResult(host, "127.0.0.5", Result.IN_SYNC, plan=_plan(host))


def quarantined(host: str) -> HostResult:
    return HostResult(host, "127.0.0.6", Result.QUARANTINED, plan=_plan(host), reason="Quarantined",
                      message=f"sglang: desired {B[:7]} quarantined (CrashLoop), running {A[:7]}",
                      events=[ServiceEvent("sglang", "quarantined", B, "",
                                           note=f"desired {B[:7]} quarantined (CrashLoop), running {A[:7]}",
                                           quote=QUOTE)])


def unreachable(host: str) -> HostResult:
    return HostResult(host, "127.0.0.7", Result.FAILED, reason="Unreachable",
                      message="cannot connect to 127.0.0.7:22: Connection refused")


def lines_of(text: str) -> dict[str, str]:
    return {ln.split(":", 1)[0]: ln for ln in text.splitlines()}


# ---- note lines ---------------------------------------------------------------------------------


def test_a_run_puts_one_line_per_host_on_the_commit_and_live_again_on_the_last_good() -> None:
    res = FleetResult(B, False, [converged("gpu-1"), rolled_back("gpu-2"), unreachable("gpu-10")])
    lines = run_lines(res, NOW)
    on_b = lines_of(merge(None, lines[B]))
    assert list(on_b) == ["gpu-1", "gpu-2", "gpu-10"]            # natural order
    assert on_b["gpu-1"] == "gpu-1: converged bbbbbbb 2026-11-18T11:06:40Z model-a healthy"
    assert on_b["gpu-2"] == (f'gpu-2: rolled-back bbbbbbb 2026-11-18T11:06:40Z sglang CrashLoop: "{QUOTE}", '
                             f"rolled back to aaaaaaa")
    assert on_b["gpu-10"] == ("gpu-10: failed bbbbbbb 2026-11-18T11:06:40Z Unreachable: cannot connect to "
                              "127.0.0.7:22: Connection refused")
    assert merge(None, lines[A]) == ("gpu-2: live-again aaaaaaa 2026-11-18T11:06:40Z sglang rolled back here "
                                     "after bbbbbbb failed (CrashLoop)\n")
    for text in (merge(None, lines[B]), merge(None, lines[A])):
        assert all(NoteLine.parse(ln) is not None for ln in text.splitlines())   # what merge reads back


def test_a_later_run_updates_its_host_and_keeps_the_others() -> None:
    first = merge(None, run_lines(FleetResult(B, False, [converged("gpu-1"), unreachable("gpu-2")]), NOW)[B])
    second = merge(first, run_lines(FleetResult(B, False, [converged("gpu-2")], ), NOW + 60)[B])
    got = lines_of(second)
    assert got["gpu-1"] == lines_of(first)["gpu-1"]                       # untouched
    assert got["gpu-2"].startswith("gpu-2: converged bbbbbbb 2026-11-18T11:07:40Z")


@pytest.mark.parametrize(("before", "after", "kept"), [
    (converged, in_sync, True),          # a periodic run finds it in sync: the deploy's line stays
    (rolled_back, quarantined, True),    # ... still on its last good: the rollback's line (and quote) stays
    (quarantined, quarantined, True),    # the same, a minute later: no new notes commit
    (unreachable, unreachable, True),    # still down: the same words, no rewrite
    (unreachable, in_sync, False),       # back: it says so
    (converged, unreachable, False),     # gone: it says so
    (in_sync, converged, False),         # a change at the same commit (drift reverted)
])
def test_steady_runs_do_not_rewrite_what_the_run_that_acted_wrote(before, after, kept) -> None:
    old = merge(None, run_lines(FleetResult(B, False, [before("gpu-1")]), NOW)[B])
    new = merge(old, run_lines(FleetResult(B, False, [after("gpu-1")]), NOW + 3600)[B])
    assert (new == old) is kept, (old, new)


def test_a_note_ends_with_what_each_restart_cost_and_the_requests_a_drain_left() -> None:
    r = rolled_back("gpu-1")
    r.costs = {"sglang": {"drain": 1.25, "restart": 2.5, "load": 40.0}, "router": {"restart": 0.5}}
    r.lost = {"sglang": 3}
    line = lines_of(merge("", run_lines(FleetResult(B, False, [r]), NOW)[B]))["gpu-1"]
    assert line.endswith(f"rolled back to {A[:7]}; router unavailable 0.5s; "
                         "sglang unavailable 43.8s, 3 requests in flight at the drain timeout"), line
    r.costs, r.lost = {}, {}
    assert lines_of(merge("", run_lines(FleetResult(B, False, [r]), NOW)[B]))["gpu-1"].endswith(
        f"rolled back to {A[:7]}")


def test_lines_that_are_not_ours_are_kept_and_text_is_one_line_and_redacted() -> None:
    secret = "hf_" + "Q" * 30
    r = rolled_back("gpu-1")
    r.events[0].outcome = Outcome("sglang", False, "CrashLoop", "x", f"token {secret} refused\nat line 2")
    text = merge("reviewed by ops\n", run_lines(FleetResult(B, False, [r]), NOW)[B])
    assert secret not in text and 'CrashLoop: "token *** refused at line 2"' in text
    assert text.splitlines()[-1] == "reviewed by ops"
    assert len(text.splitlines()) == 2


def test_a_note_is_redacted_before_it_is_cut_or_flattened() -> None:
    """Review M3: a token straddling the 300-character cut, or a registered value with a tab or
    two spaces in it, must not leak a prefix or come out re-spaced and unrecognized."""
    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWx"
    value = "pa  ss\tword-" + "2026-Xq9"
    redact.register(value)
    r = rolled_back("gpu-1")
    quote = "x" * (gitnotes.QUOTE_MAX - 15) + f" {token} and {value} after"
    r.events[0].outcome = Outcome("sglang", False, "CrashLoop", "x", quote)
    text = merge(None, run_lines(FleetResult(B, False, [r]), NOW)[B])
    assert "hf_AbCd" not in text                      # no prefix of the token
    assert "pa ss word" not in text and "2026-Xq9" not in text
    assert '"' + "x" * (gitnotes.QUOTE_MAX - 15) + " ***" in text
    assert gitnotes.one_line(f"a {value}") == "a ***"
    near_cut = "Zq9-vT3-" + "secret-value-77"          # a registered value the cut would halve
    redact.register(near_cut)
    cut = gitnotes.one_line("y" * (gitnotes.QUOTE_MAX - 12) + " " + near_cut)
    assert "Zq9" not in cut and cut == "y" * (gitnotes.QUOTE_MAX - 12) + " ***"


# ---- writing notes ------------------------------------------------------------------------------


@pytest.fixture
def bare(tmp_path: Path) -> tuple[pygit2.Repository, str, str]:
    repo = pygit2.init_repository(str(tmp_path / "deploy.git"), bare=True, initial_head="main")
    sig = pygit2.Signature("t", "t@example.invalid")
    tree = repo.TreeBuilder().write()
    c1 = repo.create_commit("refs/heads/main", sig, sig, "one", tree, [])
    c2 = repo.create_commit("refs/heads/main", sig, sig, "two", tree, [c1])
    return repo, str(c1), str(c2)


def test_write_merges_into_one_notes_commit_and_skips_restatements(bare) -> None:
    repo, c1, c2 = bare
    res = FleetResult(c2, False, [converged("gpu-1"), rolled_back("gpu-2")])
    res.hosts[1].events[1].revision = c1
    assert sorted(gitnotes.record_run(repo, res, now=NOW)) == sorted([c1, c2])
    tip = repo.references[gitnotes.NOTES_REF].target
    assert "gpu-2: live-again" in (gitnotes.read(repo, c1) or "")
    assert "gpu-1: converged" in (gitnotes.read(repo, c2) or "")
    # a periodic run an hour later: nothing new, no notes commit
    steady = FleetResult(c2, False, [in_sync("gpu-1"), quarantined("gpu-2")])
    assert gitnotes.record_run(repo, steady, now=NOW + 3600) == []
    assert repo.references[gitnotes.NOTES_REF].target == tip
    assert not [r for r in repo.references if "scratch" in r]        # the scratch ref is gone


def test_write_retries_when_another_writer_moved_the_ref(bare, monkeypatch) -> None:
    repo, _c1, c2 = bare
    gitnotes.write(repo, {c2: [NoteLine("gpu-1", "converged", c2[:7], "2026-11-18T11:06:40Z")]})
    other = pygit2.Repository(repo.path)
    real = gitnotes.merge
    raced = []

    def racing_merge(old, new):
        if not raced:        # between our read and our swap, another process adds gpu-9's line
            raced.append(1)
            sig = pygit2.Signature("x", "x@example.invalid")
            text = (gitnotes.read(other, c2) or "") + "gpu-9: converged bbbbbbb 2026-11-18T11:06:41Z\n"
            other.create_note(text, sig, sig, c2, gitnotes.NOTES_REF, True)
        return real(old, new)

    monkeypatch.setattr(gitnotes, "merge", racing_merge)
    gitnotes.write(repo, {c2: [NoteLine("gpu-2", "converged", c2[:7], "2026-11-18T11:06:42Z")]})
    assert set(lines_of(gitnotes.read(repo, c2) or "")) == {"gpu-1", "gpu-2", "gpu-9"}   # nobody's line lost


def test_a_shared_repo_gets_group_writable_directories_under_a_tight_umask(tmp_path: Path) -> None:
    repo = pygit2.init_repository(str(tmp_path / "shared.git"), bare=True, initial_head="main",
                                  mode=pygit2.enums.RepositoryInitMode.SHARED_GROUP)
    sig = pygit2.Signature("t", "t@example.invalid")
    c = str(repo.create_commit("refs/heads/main", sig, sig, "one", repo.TreeBuilder().write(), []))
    objects = Path(repo.path) / "objects"
    before = set(objects.iterdir())
    old = os.umask(0o077)               # the daemon's unit runs with UMask=0077
    try:
        gitnotes.write(repo, {c: [NoteLine("gpu-1", "converged", c[:7], "2026-11-18T11:06:40Z")]})
        assert os.umask(0o077) == 0o077     # put back
    finally:
        os.umask(old)
    fanout = [d for d in set(objects.iterdir()) - before if len(d.name) == 2]
    assert fanout and all(stat.S_IMODE(d.stat().st_mode) & 0o070 == 0o070 for d in fanout)   # a pusher can write
    assert stat.S_IMODE((Path(repo.path) / "refs" / "notes").stat().st_mode) & 0o070 == 0o070


@pytest.mark.parametrize(("value", "current", "want"), [
    ("group", 0o077, 0o007), ("true", 0o022, 0o002), ("1", 0o077, 0o007), ("all", 0o077, 0o002),
    ("0660", 0o077, 0o007), ("0640", 0o077, 0o027), ("umask", 0o077, 0o077), ("false", 0o022, 0o022),
])
def test_shared_umask_follows_core_shared_repository(value, current, want) -> None:
    assert gitnotes._shared_umask(value, current) == want


# ---- the forge ----------------------------------------------------------------------------------


def test_forge_payloads_have_the_commit_status_shape() -> None:
    res = FleetResult(B, False, [converged("gpu-1"), rolled_back("gpu-2")])
    assert forge.started(B, 2) == {"state": "pending", "context": "reconciler/fleet",
                                   "description": "deploying bbbbbbb to 2 hosts"}
    got = forge.finished(res, "https://fleet.example.invalid/{host}/{short}")
    assert [(p["context"], p["state"]) for p in got] == [
        ("reconciler/gpu-1", "success"), ("reconciler/gpu-2", "failure"), ("reconciler/fleet", "failure")]
    assert got[1]["description"].startswith('rolled-back: sglang CrashLoop: "RuntimeError: MTP')
    assert all(len(p["description"]) <= forge.DESCRIPTION_MAX for p in got)
    assert got[0]["target_url"] == "https://fleet.example.invalid/gpu-1/bbbbbbb"
    assert got[2]["description"] == "1 converged, 1 rolled-back (exit 3)"


class _Forge(http.server.BaseHTTPRequestHandler):
    """A forge that records each status; with the server's `gate` set to an Event it holds each
    request until the test sets it (or 10 s pass). `arrived`: a request came; `answered`: one
    was answered."""

    def do_POST(self) -> None:
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.got.append((self.path, self.headers["Authorization"], body))  # type: ignore[attr-defined]
        srv.arrived.set()  # type: ignore[attr-defined]
        if srv.gate is not None:  # type: ignore[attr-defined]
            srv.gate.wait(10)  # type: ignore[attr-defined]
        try:
            self.send_response(srv.code)  # type: ignore[attr-defined]
            self.end_headers()
            self.wfile.write(b"{}")
        except OSError:            # the client gave up on a slow forge (its timeout): that is the point
            pass
        srv.answered.set()  # type: ignore[attr-defined]

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_forge() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forge)
    server.got, server.gate, server.code = [], None, 201  # type: ignore[attr-defined]
    server.arrived, server.answered = threading.Event(), threading.Event()  # type: ignore[attr-defined]
    # shutdown() waits for serve_forever's next look at its flag: a short poll, a short wait
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield server
    if server.gate is not None:  # type: ignore[attr-defined]
        server.gate.set()  # type: ignore[attr-defined]
    server.shutdown()


def test_statuses_reach_a_forge_with_the_token_in_the_header_only(fake_forge, tmp_path, capsys) -> None:
    token = "forgetoken-" + "Z" * 24
    (tmp_path / "token").write_text(token + "\n")
    spec = forge.ForgeSpec(f"http://127.0.0.1:{fake_forge.server_address[1]}/api/v1", "ops/fleet",
                           token_file=str(tmp_path / "token"))
    sender = forge.ForgeStatus(spec)

    async def run() -> None:
        sender.send(B, forge.started(B, 2))
        for p in forge.finished(FleetResult(B, False, [converged("gpu-1"), rolled_back("gpu-2")])):
            sender.send(B, p)
        assert await sender.drain(10)
        await sender.close()
    asyncio.run(run())
    paths = {g[0] for g in fake_forge.got}
    assert paths == {f"/api/v1/repos/ops/fleet/statuses/{B}"}
    assert {g[1] for g in fake_forge.got} == {f"token {token}"}
    states = [(g[2]["context"], g[2]["state"]) for g in fake_forge.got]
    assert ("reconciler/gpu-2", "failure") in states and ("reconciler/gpu-1", "success") in states
    assert states[-1] == ("reconciler/fleet", "failure")        # after the pending one it replaced or followed
    assert sender.failures == type(sender.failures)()
    assert token not in capsys.readouterr().err
    assert redact.redact(f"x {token} y") == "x *** y"            # registered once read


def test_a_slow_or_failing_forge_never_holds_up_the_caller(fake_forge, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FORGE_TOKEN_FOR_TEST", "t0ken-value-1234")
    fake_forge.gate, fake_forge.code = threading.Event(), 500      # the forge holds each request, then fails it
    spec = forge.ForgeSpec(f"http://127.0.0.1:{fake_forge.server_address[1]}", "ops/fleet",
                           token_env="FORGE_TOKEN_FOR_TEST", timeout=30)
    sender = forge.ForgeStatus(spec)

    async def run() -> None:
        sender.send(B, forge.payload("failure", "reconciler/gpu-0", "x"))
        assert await asyncio.to_thread(fake_forge.arrived.wait, 10)   # the first status is at the forge, held
        for i in range(1, 50):                             # fifty runs' worth while the forge hangs
            sender.send(B, forge.payload("failure", f"reconciler/gpu-{i % 5}", "x"))
        assert not fake_forge.answered.is_set()           # every send returned while the forge held the first
        fake_forge.gate.set()
        assert await sender.drain(30)
        await sender.close()
    asyncio.run(run())
    assert len(fake_forge.got) == 6                    # the first, then the newest per context: not fifty
    assert sorted(g[2]["context"] for g in fake_forge.got[1:]) == [f"reconciler/gpu-{i}" for i in range(5)]
    err = capsys.readouterr().err
    assert "not delivered" in err and "HTTP 500" in err and "t0ken-value-1234" not in err
    assert "http://127.0.0.1:" in sender.failures[0] and "/repos/" not in sender.failures[0]


def test_a_forge_slower_than_the_timeout_is_a_warning(fake_forge, monkeypatch) -> None:
    monkeypatch.setenv("FORGE_TOKEN_FOR_TEST", "t0ken-value-1234")
    fake_forge.gate = threading.Event()                # never answers while the client waits
    spec = forge.ForgeSpec(f"http://127.0.0.1:{fake_forge.server_address[1]}", "ops/fleet",
                           token_env="FORGE_TOKEN_FOR_TEST", timeout=0.1)
    sender = forge.ForgeStatus(spec)

    async def run() -> None:
        sender.send(B, forge.started(B, 1))
        assert await sender.drain(30)                      # the client's own timeout ended the request
        await sender.close()
    asyncio.run(run())
    assert not fake_forge.answered.is_set() and sender.sent == 0
    assert len(sender.failures) == 1 and "not delivered" in sender.failures[0] and "timed out" in sender.failures[0]


def test_a_missing_token_is_a_warning_naming_the_file(tmp_path) -> None:
    sender = forge.ForgeStatus(forge.ForgeSpec("http://127.0.0.1:9", "o/r", token_file=str(tmp_path / "none")))

    async def run() -> None:
        sender.send(B, forge.started(B, 1))
        assert await sender.drain(5)
        await sender.close()
    asyncio.run(run())
    assert f"cannot read forge_token_file {tmp_path / 'none'}" in sender.failures[0]


def test_controller_config_forge_keys(tmp_path: Path, monkeypatch) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('forge_url = "https://gitea.example.invalid/api/v1"\nforge_repo = "ops/fleet"\n'
                   'forge_token_env = "FORGE_TOKEN"\n')
    c = load_config(cfg)
    assert (c.forge_url, c.forge_repo, c.forge_token_env, c.notes) == (
        "https://gitea.example.invalid/api/v1", "ops/fleet", "FORGE_TOKEN", True)
    cfg.write_text('forge_url = "https://gitea.example.invalid/api/v1"\nforge_repo = "ops/fleet"\n')
    with pytest.raises(ConfigError, match="exactly one of forge_token_file"):
        load_config(cfg)
    cfg.write_text('forge_url = "ftp://x"\nforge_repo = "ops/fleet"\nforge_token_env = "T"\n')
    with pytest.raises(ConfigError, match="http:// or https://"):
        load_config(cfg)
    cfg.write_text('forge_url = ""\n')
    assert load_config(cfg).forge_url is None


# ---- status --live rows -------------------------------------------------------------------------


def _state():
    files = {"units/s.service": "[Service]\nExecStart=/bin/true\n",
             "hosts/gpu-1.toml": 'address = "127.0.0.5"\n[services.good]\nunit_file = "units/s.service"\n'
                                 '[services.bad]\nunit_file = "units/s.service"\nenv = { X = "2" }\n'
                                 '[services.new]\nunit_file = "units/s.service"\nenv = { X = "3" }\n'}
    return load_desired(MemorySnapshot(files))


def test_live_rows_from_the_hosts_records() -> None:
    state = _state()
    h = state.hosts["gpu-1"]
    good_hash, bad_hash = h.services["good"].content_hash(), h.services["bad"].content_hash()
    up = {"ActiveState": "active", "SubState": "running"}
    facts = HostFacts(services={
        "good": ServiceFacts("good", record=ServiceRecord(hash=good_hash, revision=B, last_good_hash=good_hash,
                                                          last_good_revision=B), props=up),
        "bad": ServiceFacts("bad", record=ServiceRecord(
            hash="old", revision=A, last_good_hash="old", last_good_revision=A,
            quarantine=Quarantine(bad_hash, B, "CrashLoop", QUOTE, at=NOW)), props=up),
        "gone": ServiceFacts("gone", record=ServiceRecord(hash="x", revision=A, last_good_hash="x",
                                                          last_good_revision=A), props=up),
    }, record=HostRecord(B, NOW))
    rows = {r["service"]: r for r in live.host_rows(h, facts, B)}
    assert set(rows) == {"good", "bad", "new", "gone"}
    good, new = rows["good"], rows["new"]
    assert (good["running_rev"], good["health"], good["last_event"]) == (B, "healthy", "in-sync")
    bad = rows["bad"]
    assert (bad["running_rev"], bad["health"], bad["quote"], bad["last_good_rev"]) == (A, "healthy", QUOTE, A)
    assert bad["last_event"] == "quarantined: desired bbbbbbb quarantined (CrashLoop), running aaaaaaa"
    assert (new["health"], new["last_event"], new["running_rev"]) == (None, "not deployed", None)
    assert rows["gone"]["last_event"] == "not in the desired state at bbbbbbb: stopped and removed by the next run"
    assert all(r["active_state"] is not None for s, r in rows.items() if s != "new")
    starting = {"ActiveState": "activating", "SubState": "start"}
    pending = HostFacts(services={"new": ServiceFacts("new", record=ServiceRecord(
        hash="x", revision=A, last_good_hash="x", last_good_revision=A, pending=Pending("y", B, started=True)),
        props=starting)})
    row = next(r for r in live.host_rows(h, pending, B) if r["service"] == "new")
    assert (row["health"], row["running_rev"]) == ("pending", B)
    assert row["last_event"] == "pending: bbbbbbb started, no verdict yet"
    # the store's keys are all there: report.print_status reads both
    assert {"host", "service", "desired_rev", "running_rev", "health", "last_event", "quote",
            "updated_at"} <= set(rows["good"])


def test_live_row_of_an_unreachable_host_says_so() -> None:
    h = _state().hosts["gpu-1"]
    row = live.failed_row(h, B, "Unreachable", "cannot connect to 127.0.0.5:22: Connection refused")
    assert (row["service"], row["health"]) == ("*", "unknown")
    assert row["last_event"] == "unreachable: cannot connect to 127.0.0.5:22: Connection refused"


def test_periodic_runs_post_no_new_forge_statuses(tmp_path: Path) -> None:
    from reconciler.controller.commitstatus import CommitStatus
    from reconciler.controller.config import ControllerConfig
    cfg = ControllerConfig(repo=str(tmp_path), notes=False, forge_url="http://127.0.0.1:9/api/v1",
                           forge_repo="ops/fleet", forge_token_env="FORGE_TOKEN_FOR_TEST")
    cs = CommitStatus(cfg)
    sent: list[tuple[str, str]] = []
    assert cs.forge is not None
    cs.forge.send = lambda sha, status: sent.append((status["context"], status["state"]))  # type: ignore[method-assign]

    def run(*hosts: HostResult) -> list[tuple[str, str]]:
        sent.clear()
        cs.started(B, len(hosts))
        assert cs.finished(None, FleetResult(B, False, list(hosts))) == []
        return sorted(sent)

    assert run(converged("gpu-1"), rolled_back("gpu-2")) == sorted([
        ("reconciler/fleet", "pending"), ("reconciler/gpu-1", "success"), ("reconciler/gpu-2", "failure"),
        ("reconciler/fleet", "failure")])
    assert run(in_sync("gpu-1"), quarantined("gpu-2")) == []           # a periodic run: nothing new
    assert run(in_sync("gpu-1"), unreachable("gpu-2")) == [("reconciler/fleet", "failure"),   # new words
                                                          ("reconciler/gpu-2", "failure")]
    assert run(in_sync("gpu-1"), unreachable("gpu-2")) == []           # the same words: not again
    assert run(in_sync("gpu-1"), converged("gpu-2")) == [("reconciler/fleet", "success"),
                                                        ("reconciler/gpu-2", "success")]


def test_a_failed_host_leads_with_its_reason() -> None:
    first = HostResult("gpu-1", "127.0.0.5", Result.FAILED, plan=_plan("gpu-1"), reason="FirstDeployFailed",
                       message="sglang: CrashLoop: x; first deploy failed; service left stopped",
                       events=[ServiceEvent("sglang", "deploy", B, "h",
                                            Outcome("sglang", False, "CrashLoop", "m", QUOTE))])
    assert gitnotes.host_detail(first) == f'FirstDeployFailed: sglang CrashLoop: "{QUOTE}"'
    blocked = HostResult("gpu-1", "127.0.0.5", Result.FAILED, plan=_plan("gpu-1"), reason="PreflightFailed",
                         message="sglang: tp 8 > 4 GPUs",
                         events=[ServiceEvent("sglang", "blocked", B, "", note="tp 8 > 4 GPUs")])
    assert gitnotes.host_detail(blocked) == "PreflightFailed: sglang blocked (tp 8 > 4 GPUs)"
    cut = HostResult("gpu-1", "127.0.0.5", Result.FAILED, plan=_plan("gpu-1"), reason="ApplyFailed",
                     message="apply failed (exit 1): disk full", events=[])
    assert gitnotes.host_detail(cut) == "ApplyFailed: apply failed (exit 1): disk full"
