"""End-to-end: deploy status on the commit and from the hosts (issue 14, items 2 and 3), on real
hosts.

The daemon deploying from its bare repo writes git notes (refs/notes/reconciler) that a clone
fetches and `git log --notes=reconciler` shows, posts commit statuses to a fake forge on
127.0.0.1, and `reconcile status --live` from a fresh state dir shows what the controller's
store shows. The CLI writes notes only with --notes; `status --live` reads without writing, and
an unreachable host is a row that says so.
"""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, SPEC_FLAGS, run_cli, run_json, write_fleet
from tests.e2e.test_e2e_push import Deploy, git

pytestmark = pytest.mark.fleet

QWEN35 = "Qwen3.5-122B-A10B"
INCIDENT = "needs --mamba-scheduler-strategy extra_buffer"
# Fields of a status row that the store and the hosts both have, and that must agree.
SAME = ("desired_rev", "running_rev", "health", "quote")
# Fields both have that differ by nature: the store's last_event is the last run's event
# ("rolled-back: sglang: CrashLoop: ...; rolled back to c1"), the live one the record's state
# ("quarantined: desired c2 quarantined (CrashLoop), running c1"); updated_at is when the store
# wrote the row vs the host clock of the record's last change.
DIFFER_BY_NATURE = ("last_event", "updated_at")


class _Forge(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.got.append((self.path, self.headers["Authorization"], body))  # type: ignore[attr-defined]
        self.send_response(201)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def forge_server() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forge)
    server.got = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture
def deploy(tmp_path) -> Iterator[Deploy]:
    d = Deploy(tmp_path)
    yield d
    d.stop()


def status_json(env: dict[str, str], *args: str) -> list[dict]:
    res = subprocess.run([sys.executable, "-m", "reconciler", "status", *args, "--json"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def note(cwd: Path, rev: str) -> str:
    return git(cwd, "notes", "--ref=reconciler", "show", rev).stdout


@pytest.mark.timeout(240)
def test_notes_forge_statuses_and_live_status_after_a_good_deploy_and_a_rollback(fleet, deploy, forge_server,
                                                                                 tmp_path):
    good, bad = fleet.hosts[0], fleet.hosts[1]
    token = "forge-token-" + "k" * 20
    (tmp_path / "forge-token").write_text(token + "\n")
    (tmp_path / "config.toml").write_text(
        f'forge_url = "http://127.0.0.1:{forge_server.server_address[1]}/api/v1"\nforge_repo = "ops/fleet"\n'
        f'forge_token_file = "{tmp_path / "forge-token"}"\n')
    # The clone follows the notes as the README says: a glob refspec (a fetch before the first
    # deploy, when there is no notes ref yet, still works) and notes.displayRef for plain git log.
    git(deploy.clone, "config", "--add", "remote.origin.fetch", "+refs/notes/reconciler*:refs/notes/reconciler*")
    git(deploy.clone, "config", "notes.displayRef", "refs/notes/reconciler")
    git(deploy.clone, "fetch", "-q")
    svc = {"port": 30000, "model": QWEN35, "env": {"STANDIN_LOAD_SECONDS": "1"}}
    deploy.write([good, bad], {"sglang": svc})
    deploy.start()
    c1 = deploy.commit("qwen3.5 on two hosts")
    deploy.push()
    assert deploy.wait_exit_file(c1, timeout=60) == 0, deploy.daemon_log()[-3000:]
    git(deploy.clone, "fetch", "-q")
    log = git(deploy.clone, "log", "-1").stdout
    assert "Notes (reconciler):" in log and f"    {good.name}: converged {c1[:7]} " in log, log
    assert f"    {bad.name}: converged {c1[:7]} " in log, log
    print(f"\n$ git log --notes=reconciler -1    # after a good deploy\n{log}")

    # c2: a harmless change on `good`, the incident's flags on `bad` (crash loop, rolled back)
    deploy.write([good, bad], {"sglang": {**svc, "env": {"STANDIN_LOAD_SECONDS": "1", "V": "2"}}})
    host_file = deploy.clone / f"hosts/{bad.name}.toml"
    host_file.write_text(host_file.read_text().replace('args = ""', f'args = "{SPEC_FLAGS}"'))
    c2 = deploy.commit("speculative decoding on one host")
    deploy.push()
    assert deploy.wait_exit_file(c2, timeout=90) == 3, deploy.daemon_log()[-3000:]

    # A clone picks the notes up with one fetch (here the explicit refspec).
    git(deploy.clone, "fetch", "-q", "origin", "refs/notes/reconciler:refs/notes/reconciler")
    on_c2 = {ln.split(":", 1)[0]: ln for ln in note(deploy.clone, c2).splitlines()}
    on_c1 = {ln.split(":", 1)[0]: ln for ln in note(deploy.clone, c1).splitlines()}
    assert on_c2[good.name].startswith(f"{good.name}: converged {c2[:7]} ") and "sglang healthy" in on_c2[good.name]
    assert on_c2[bad.name].startswith(f"{bad.name}: rolled-back {c2[:7]} "), on_c2
    assert "sglang CrashLoop: \"" in on_c2[bad.name] and INCIDENT in on_c2[bad.name]
    # then what the restarts cost the host: the seconds the service was out of rotation (issue 42)
    assert re.search(rf"rolled back to {c1[:7]}; sglang unavailable [0-9]+[.][0-9]s$", on_c2[bad.name]), on_c2
    assert re.search(r"sglang healthy.*; sglang unavailable [0-9]+[.][0-9]s$", on_c2[good.name]), on_c2
    assert on_c1[good.name].startswith(f"{good.name}: converged {c1[:7]} ")          # its own deploy, kept
    assert on_c1[bad.name].startswith(f"{bad.name}: live-again {c1[:7]} ")            # why c1 runs there again
    assert on_c1[bad.name].endswith(f"sglang rolled back here after {c2[:7]} failed (CrashLoop)")
    log = git(deploy.clone, "log", "--notes=reconciler", "-2").stdout
    assert "Notes (reconciler):" in log and f"    {on_c2[bad.name]}" in log and f"    {on_c1[bad.name]}" in log
    print(f"\n$ git log --notes=reconciler -2    # after a rollback on {bad.name}\n{log}")

    # The forge got pending, then one status per host and one for the fleet, per commit.
    statuses = [(p, body) for p, auth, body in forge_server.got if auth == f"token {token}"]
    assert len(statuses) == len(forge_server.got)
    by = {(p.rsplit("/", 1)[1], b["context"]): b for p, b in statuses}      # the last of each
    assert all(p.startswith("/api/v1/repos/ops/fleet/statuses/") for p, _ in statuses)
    assert by[(c1, f"reconciler/{bad.name}")]["state"] == "success"
    assert by[(c2, f"reconciler/{good.name}")]["state"] == "success"
    assert by[(c2, f"reconciler/{bad.name}")]["state"] == "failure"
    assert "CrashLoop" in by[(c2, f"reconciler/{bad.name}")]["description"]
    assert by[(c2, "reconciler/fleet")]["state"] == "failure"
    assert "pending" in [b["state"] for _, b in statuses if b["context"] == "reconciler/fleet"]
    assert token not in deploy.daemon_log()

    # status --live from a fresh state dir shows what the controller's store shows.
    stored = status_json(deploy.env)
    fresh = {**deploy.env, "RECONCILER_STATE_DIR": str(tmp_path / "fresh-state")}
    live = status_json(fresh, "--live", "--repo", str(deploy.bare))
    key = lambda r: (r["host"], r["service"])      # noqa: E731
    assert sorted(map(key, stored)) == sorted(map(key, live)) == [(good.name, "sglang"), (bad.name, "sglang")]
    live_by = {key(r): r for r in live}
    for row in stored:
        other = live_by[key(row)]
        for f in SAME:
            assert row[f] == other[f], (f, row, other)
        assert set(DIFFER_BY_NATURE) <= set(other)       # the same shape
    assert live_by[(bad.name, "sglang")]["running_rev"] == c1
    assert INCIDENT in (live_by[(bad.name, "sglang")]["quote"] or "")
    assert {r["active_state"] for r in live} == {"active"}
    assert live_by[(bad.name, "sglang")]["last_event"] == (
        f"quarantined: desired {c2[:7]} quarantined (CrashLoop), running {c1[:7]}")
    table = subprocess.run([sys.executable, "-m", "reconciler", "status", "--live", "--repo", str(deploy.bare)],
                           env={**fresh, "COLUMNS": "200", "NO_COLOR": "1"}, cwd=ROOT, capture_output=True, text=True,
                           timeout=90)
    assert table.returncode == 0 and "active/running" in table.stdout, table.stderr
    print(f"\n$ reconcile status --live --repo deploy.git\n{table.stdout}")


@pytest.mark.timeout(150)
def test_cli_notes_only_when_asked_and_live_status_reads_without_writing(fleet, repo, tmp_path):
    h = fleet.hosts[2]
    write_fleet(repo, [h])
    repo.write("hosts/ghost.toml", 'address = "127.0.0.250"\n')      # nothing listens there
    c1 = repo.commit("one host and a ghost")
    run_cli("--repo", str(repo.path), check_codes=(4,))              # the ghost is unreachable: exit 4
    assert "refs/notes/reconciler" not in git(repo.path, "show-ref").stdout     # no --notes, no notes
    run_cli("--repo", str(repo.path), "--notes", check_codes=(4,))
    lines = {ln.split(":", 1)[0]: ln for ln in note(repo.path, c1).splitlines()}
    assert lines[h.name].startswith(f"{h.name}: in-sync {c1[:7]} ")
    assert lines["ghost"].startswith(f"ghost: failed {c1[:7]} ") and "Unreachable" in lines["ghost"]
    res = run_cli("--repo", "ssh://git@127.0.0.1/x.git", "--notes", check_codes=(1,))
    assert "--notes writes to a local repo" in res.stderr

    # status --live: read-only (nothing under /var/lib/reconciler or the units changes), no lock
    fleet.ssh(h, "touch /tmp/before-status; sleep 1")
    code, rows = run_json("status", "--live", "--repo", str(repo.path), check_codes=(0,))
    changed = fleet.ssh(h, "find /var/lib/reconciler /etc/systemd/system -newer /tmp/before-status")
    assert changed.strip() == "", changed
    by = {(r["host"], r["service"]): r for r in rows}
    assert by[(h.name, "model-a")]["health"] == "healthy" and by[(h.name, "model-a")]["last_event"] == "in-sync"
    assert by[(h.name, "model-a")]["active_state"] == "active"
    ghost = by[("ghost", "*")]
    assert ghost["health"] == "unknown" and ghost["last_event"].startswith("unreachable: ")
    code, rows = run_json("status", "--live", "--repo", str(repo.path), "--host", h.name, check_codes=(0,))
    assert {r["host"] for r in rows} == {h.name}
    table = run_cli("status", "--live", "--repo", str(repo.path), check_codes=(0,)).stdout
    assert f"fleet status at {c1[:7]} (live, from the hosts' records)" in table
    assert "active/running" in table and "unreachable" in table
    print(f"\n$ reconcile status --live --repo desired\n{table}")
    res = run_cli("status", "--rev", c1, check_codes=(1,))
    assert "without --live" in res.stderr
