"""The fleet page (reconciler/controller/web): its view of the store and of a live run, escaping and
redaction, the filters, a host's history, the server-sent events, and the server on a real
socket. Starlette's TestClient for the app; the browser test on real hosts is test_e2e_web.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from reconciler import redact
from reconciler.controller.config import ControllerConfig, parse_address
from reconciler.controller.store import Store
from reconciler.controller.web import view
from reconciler.controller.web.app import GitCommits, allowed_hosts, create_app
from reconciler.controller.web.hub import Hub
from reconciler.controller.web.server import serve_page
from reconciler.desired.spec import RolloutPolicy
from reconciler.host.health import Outcome
from reconciler.loop.results import Event, FleetResult, HostResult, ServiceEvent
from reconciler.plan.model import Kind
from reconciler.plan.records import Result
from reconciler.plan.rollout import GroupKey, RolloutPlan, RolloutResult, plan_waves
from reconciler.reasons import Reason

with warnings.catch_warnings():     # starlette 1.x asks for httpx2 in its test client; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

GOOD, BAD, OLD = "a" * 40, "b" * 40, "c" * 40
QUOTE = "ValueError: MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer"
SUBJECTS = {GOOD: "sglang: 0.5.12 everywhere", BAD: "qwen: enable MTP", OLD: "first deploy"}


def lookup(rev: str) -> view.CommitInfo | None:
    return view.CommitInfo(SUBJECTS[rev], time.time() - 630) if rev in SUBJECTS else None


def fleet_of(**hosts: dict[str, str]) -> dict[str, SimpleNamespace]:
    """Host-like objects for Hub.run_started: name -> labels, two services each."""
    return {name: SimpleNamespace(ssh=SimpleNamespace(address=f"127.0.0.{i + 50}"), labels=labels,
                                  services={"sglang": None, "vllm": None})
            for i, (name, labels) in enumerate(hosts.items())}


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A store as a run leaves it: gpu-1 in sync, gpu-2 rolled back with its journal line, gpu-3
    unreachable."""
    d = tmp_path / "state"
    s = Store(d)
    for svc in ("sglang", "vllm"):
        s.set_status("gpu-1", svc, desired_rev=GOOD, running_rev=GOOD, health="healthy", last_event="converged")
    s.set_status("gpu-2", "sglang", desired_rev=BAD, running_rev=GOOD, health="healthy",
                 last_event="rolled-back: sglang: CrashLoop: rolled back", quote=QUOTE)
    s.set_status("gpu-2", "vllm", desired_rev=GOOD, running_rev=GOOD, health="healthy", last_event="rolled-back")
    s.set_status("gpu-3", "*", desired_rev=GOOD, running_rev=None, health="unknown",
                 last_event="failed: Unreachable: connect timed out")
    s.add_attempt("gpu-2", "sglang", OLD, "h0", "deploy", "Healthy", "healthy after 40.2s", seconds=40.2)
    s.add_attempt("gpu-2", "sglang", BAD, "h1", "deploy", "CrashLoop", "NRestarts went from 0 to 3", QUOTE,
                  ["starting", QUOTE], 12.5)
    s.add_attempt("gpu-2", "sglang", GOOD, "h0", "rollback", "Healthy", "healthy after 31.0s", seconds=31.0)
    s.close()
    return d


@pytest.fixture
def hub() -> Hub:
    h = Hub()
    h.run_started(BAD, "push", fleet_of(**{"gpu-1": {"gpu": "h200", "canary": "true"}, "gpu-2": {"gpu": "h200"},
                                          "gpu-3": {"gpu": "h100"}}), None)
    return h


@pytest.fixture
def client(state: Path, hub: Hub):
    app = create_app(hub, state, repo="/srv/git/fleet.git", branch="main", commits=lookup)
    with TestClient(app, base_url="http://localhost") as c:
        yield c


def rollout(hosts: list[str], service: str = "sglang") -> RolloutResult:
    policy = RolloutPolicy(canary=1, max_unavailable=2)
    waves = plan_waves(hosts, {}, policy, len(hosts))
    return RolloutResult(RolloutPlan(GroupKey(service, "qwen"), policy, tuple(hosts), tuple(hosts), 2, waves),
                         status="running")


def test_grid_shows_health_revisions_subjects_and_the_journal_line(client):
    page = client.get("/").text
    for text in ("gpu-1", "gpu-2", "gpu-3", ">sglang<", ">vllm<", "aaaaaaa", "bbbbbbb", "sglang: 0.5.12 everywhere",
                 "qwen: enable MTP", "rolled back", "10 min ago", "failed: Unreachable: connect timed out"):
        assert text in page, text
    assert QUOTE in page                       # the rolled-back cell quotes the journal
    assert "gpu=h100" in page and "canary=true" in page
    # per commit, where it is live: GOOD runs everywhere reached, BAD nowhere (rolled back on gpu-2)
    commits = page.split('id="commits"')[1]
    assert "sglang live on 2 hosts:</span> gpu-1, gpu-2" in commits
    assert "rolled-back</span> on gpu-2/sglang" in commits


def test_every_text_is_escaped_and_secrets_are_masked(tmp_path, hub):
    secret = "S3cr3t-Value-For-The-Page"
    redact.register(secret)
    s = Store(tmp_path / "s")
    s.set_status("gpu-1", "sglang", desired_rev=BAD, running_rev=GOOD, health="unhealthy",
                 last_event=f"failed: <b>bold</b> {secret}", quote=f"<script>alert(1)</script> token={secret}")
    s.close()
    subjects = {BAD: f"leak hf_abcdefghijklmnopqrstuvwxyz <img src=x onerror=alert(1)> {secret}"}
    app = create_app(hub, tmp_path / "s", commits=lambda r: view.CommitInfo(subjects.get(r, "x"), time.time()))
    with TestClient(app, base_url="http://localhost") as c:
        page = c.get("/").text
        with c.stream("GET", "/events") as r:      # no versions: every section at once
            events = read_events(r, {"live", "grid", "commits"})
    for text in (page, *events.values()):
        assert secret not in text and secret.lower() not in text      # the search field is lowercased
        assert "hf_abcdefghijklmnop" not in text
        assert "<script>alert" not in text and "<img src=x" not in text and "<b>bold" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; token=***" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "leak ***" in page


def test_a_long_commit_subject_is_masked_before_it_is_cut(tmp_path):
    import pygit2
    repo = pygit2.init_repository(str(tmp_path / "r"))
    sig = pygit2.Signature("Dev", "dev@example.invalid")
    subject = "x" * 110 + " hf_abcdefghijklmnopqrstuvwxyz0123"
    rev = str(repo.create_commit("HEAD", sig, sig, subject + "\n\nbody", repo.TreeBuilder().write(), []))
    info = GitCommits(lambda: str(tmp_path / "r" / ".git"))(rev)
    assert info is not None and info.subject == "x" * 110 + " ***" and "hf_" not in info.subject


def test_label_filter_and_search_hide_rows_without_dropping_them(client):
    def hidden(page: str) -> dict[str, bool]:
        rows = [part.split(">", 1)[0] for part in page.split('<tr class="host-row" data-host="')[1:]]
        return {r.split('"', 1)[0]: " hidden" in r for r in rows}

    assert hidden(client.get("/").text) == {"gpu-1": False, "gpu-2": False, "gpu-3": False}
    assert hidden(client.get("/?label=gpu=h100").text) == {"gpu-1": True, "gpu-2": True, "gpu-3": False}
    assert hidden(client.get("/?q=CrashLoop").text) == {"gpu-1": True, "gpu-2": False, "gpu-3": True}
    assert hidden(client.get("/?label=gpu=h200&q=bbbbbbb").text) == {"gpu-1": True, "gpu-2": False, "gpu-3": True}
    page = client.get("/?label=gpu=h100&q=%3Cx%3E").text
    assert "<option selected>gpu=h100</option>" in page and 'value="&lt;x&gt;"' in page


def test_host_page_lists_every_attempt_with_duration_reason_and_journal_line(client):
    r = client.get("/hosts/gpu-2")
    assert r.status_code == 200
    page = r.text
    attempts = page.split("<h2>History</h2>")[1]
    assert attempts.index("rollback") < attempts.index("CrashLoop") < attempts.index("healthy after 40.2s")
    for text in ("12.5s", "31.0s", "NRestarts went from 0 to 3", QUOTE, "3 attempts shown, 1 failed health",
                 "first deploy", "gpu=h200"):
        assert text in page, text
    assert client.get("/hosts/nowhere").status_code == 404


def test_live_rollout_shows_waves_phases_clocks_and_the_halt(client, hub):
    ro = rollout(["gpu-1", "gpu-2", "gpu-3"])
    hub.rollout("start", ro)
    hub.rollout("wave", ro)
    hub.phase("gpu-1", "sglang", "loading", 3.0, 10)
    live = client.get("/").text.split('id="live"')[1].split("</section>")[0]
    assert "wave 1 (canary)" in live and "wave 2" in live
    assert "watching health: loading" in live and 'data-timeout="10"' in live and "/ 10s" in live
    assert "waiting" in live and "canary = 1, max_unavailable = 2 (at most 2 at once)" in live
    # the canary fails, is rolled back, and the rollout halts with its journal line
    hub.phase("gpu-1", "sglang", "failed: CrashLoop", 4.0, 10)
    hub.phase("gpu-1", "sglang", "starting", 0.0, 10)
    live = client.get("/").text.split('id="live"')[1]
    assert "rolling back after failed: CrashLoop; watching health: starting" in live
    ro.status, ro.halted_at, ro.halted_wave, ro.reason, ro.quote = "halted", "gpu-1", 1, "CrashLoop", QUOTE
    ro.untouched = ("gpu-2", "gpu-3")
    hub.rollout("halted", ro)
    result = FleetResult(BAD, False, [
        HostResult("gpu-1", "127.0.0.50", Result.ROLLED_BACK, events=[
            ServiceEvent("sglang", Event.DEPLOY, BAD, "h1", Outcome("sglang", False, "CrashLoop", "crashed", QUOTE)),
            ServiceEvent("sglang", Event.ROLLBACK, GOOD, "h0", Outcome("sglang", True, "Healthy", "ok"))]),
        HostResult("gpu-2", "127.0.0.51", Result.QUARANTINED, reason="RolloutHalted", message="not restarted")],
        [ro])
    hub.run_finished(result)
    live = client.get("/").text.split('id="live"')[1].split("</section>")[0]
    assert "halted at" in live and QUOTE in live and "exit 3" in live
    assert "rolled back" in live and "not restarted (rollout halted)" in live
    assert "gpu-2</a>: <span class=\"tone-warn\">quarantined</span> RolloutHalted: not restarted" in live


def test_live_rollout_shows_a_budget_that_let_no_host_go(client, hub):
    ro = rollout(["gpu-1", "gpu-2"])
    hub.rollout("start", ro)
    why = "blocked: 2 of 3 ready, min_available = 2; gpu-1 waits: restarting gpu-1 would leave 1"
    ro.status, ro.reason, ro.message, ro.untouched = "halted", Reason.BUDGET_BLOCKED, f"sglang: {why}", ("gpu-1",)
    hub.rollout("halted", ro)
    live = client.get("/").text.split('id="live"')[1].split("</section>")[0]
    assert f"BudgetBlocked — sglang: {why}" in live and "not restarted: gpu-1" in live
    assert "halted at" not in live


def test_a_run_without_a_rollout_keeps_showing_the_last_rollout(client, hub):
    ro = rollout(["gpu-1", "gpu-2"])
    hub.rollout("start", ro)
    ro.status, ro.waves_done = "done", 2
    hub.rollout("done", ro)
    hub.run_ended(0)
    hub.run_started(BAD, "interval", fleet_of(**{"gpu-1": {}}), None)
    live = client.get("/").text.split('id="live"')[1].split("</section>")[0]
    assert "The last rollout" in live and "asked by interval" in live and "asked by push" in live


def read_events(r, want: set[str], timeout: float = 10) -> dict[str, str]:
    """Read a server-sent event stream until every event in `want` came: name -> data."""
    got: dict[str, str] = {}
    name, data = "", []
    deadline = time.monotonic() + timeout
    for line in r.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and name:
            got[name] = "\n".join(data)
            name, data = "", []
            if want <= set(got):
                return got
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"events {sorted(want - set(got))} did not come (got {sorted(got)})")


@pytest.mark.timeout(30)
def test_event_stream_sends_only_what_changed_as_html(client, hub):
    v = hub.snapshot().versions
    with client.stream("GET", f"/events?live={v['live']}&grid={v['grid']}&commits={v['commits']}") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        hub.phase("gpu-2", "sglang", "loading", 1.0, 1200)          # from another thread than the server's
        got = read_events(r, {"live", "grid"})
    assert "commits" not in got                                     # unchanged: not sent
    assert "gpu-2</a> sglang: <span class=\"phase tone-busy\">watching health: loading</span>" in got["live"]
    assert "now: <span class=\"phase tone-busy\">watching health: loading" in got["grid"]
    with client.stream("GET", "/events?live=-1&grid=-1&commits=-1") as r:    # a client that is behind: all of it
        assert set(read_events(r, {"live", "grid", "commits"})) == {"live", "grid", "commits"}


def test_read_only_loopback_names_and_security_headers(client, state, hub):
    assert client.post("/").status_code == 405
    r = client.get("/")
    assert r.headers["x-frame-options"] == "DENY" and "default-src 'self'" in r.headers["content-security-policy"]
    assert client.get("/", headers={"host": "attacker.example"}).status_code == 400    # DNS rebinding
    assert client.get("/static/fleet.js").status_code == 200
    assert allowed_hosts("127.0.0.1") == ["127.0.0.1", "[::1]", "localhost"]
    assert allowed_hosts("0.0.0.0") == ["*"]
    assert parse_address(":9188") == ("127.0.0.1", 9188) and parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="expected host:port"):
        parse_address("9188")


def test_page_server_on_a_real_socket_and_an_address_in_use(state, hub, capsys):
    async def main() -> None:
        page = await serve_page("127.0.0.1:0", hub, state, repo="r", branch="main")
        assert page is not None
        try:
            async with httpx.AsyncClient() as c:
                r = await c.get(page.url)
            assert r.status_code == 200 and "gpu-2" in r.text
            port = page.url.rsplit(":", 1)[1].strip("/")
            assert await serve_page(f"127.0.0.1:{port}", hub, state) is None    # said once, the daemon goes on
        finally:
            await page.stop(hub)
    asyncio.run(main())
    assert "fleet page off: cannot listen on 127.0.0.1:" in capsys.readouterr().out


def test_config_and_cold_start():
    assert ControllerConfig().web == "127.0.0.1:9188"
    code = ("import sys, reconciler.cli, reconciler.controller.daemon; "
            "print(sorted(m for m in ('starlette', 'uvicorn', 'jinja2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"            # only `reconcile watch` with the page on imports them


def test_phase_tee_tells_the_log_view_and_the_page(hub):
    calls: list[tuple] = []

    class LogView:                          # report.PhaseView's shape: phases, and plans before they apply
        def __call__(self, *args: object) -> None:
            calls.append(("phase", *args))

        def planned(self, r: object) -> None:
            calls.append(("planned", r.host))  # type: ignore[attr-defined]

    tee = hub.tee(LogView())
    restart = SimpleNamespace(kind=Kind.RESTART, service="sglang", reason=None)
    tee.planned(SimpleNamespace(host="gpu-1", plan=SimpleNamespace(
        actions=[restart], services={"sglang": SimpleNamespace(target=object())})))
    snap = hub.snapshot()
    assert view.phase_model(snap.run.phases[("gpu-1", "sglang")], snap.mono)["text"] == "deploying"
    tee("gpu-1", "sglang", "starting", 0.5, 10)
    snap = hub.snapshot()
    assert view.phase_model(snap.run.phases[("gpu-1", "sglang")], snap.mono)["text"] == "watching health: starting"
    assert calls == [("planned", "gpu-1"), ("phase", "gpu-1", "sglang", "starting", 0.5, 10)]


def test_bookkeeping_bug_never_reaches_the_run(hub, capsys):
    hub.rollout("wave", object())          # not a rollout: the page says so once, the caller goes on
    hub.rollout("wave", object())
    assert capsys.readouterr().out.count("fleet page: bookkeeping failed") == 1


def test_a_secret_that_is_a_field_name_masks_text_but_not_the_page_structure(client):
    """A registered value that happens to be a word of the view model ("second") masks nothing
    (a plain word shorter than 8 letters never is: redact.maskable), and the page's fields (each
    attempt's duration under the key "seconds") still show."""
    from reconciler import redact
    redact.register("second")
    try:
        page = client.get("/hosts/gpu-2").text
        assert 'data-col="time">12.5s<' in page and "31.0s" in page
    finally:
        redact._values.discard("second")
