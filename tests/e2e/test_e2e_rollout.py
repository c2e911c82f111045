"""End-to-end: rollouts over hosts that share a definition, on real hosts (issue 6).

Canary first, at most max_unavailable hosts down at once (checked by sampling systemd and
/health on every host during the rollout, over plain ssh), stop at the first failure with the
change quarantined for the whole group, an unreachable host that blocks nobody, dry-run waves,
selectors, and the webhook (a real HTTP server on 127.0.0.1 in the test).
"""

from __future__ import annotations

import http.server
import json
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import fleet as fleetlib
from tests.conftest import (
    SPEC_FLAGS,
    STANDIN_UNIT,
    WITHOUT_INCIDENT_RULE,
    DesiredRepo,
    Fleet,
    fleet_known_hosts,
    run_cli,
    run_json,
)

pytestmark = pytest.mark.fleet

SERVICE = "sglang-qwen"
INCIDENT_LINE = ("MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer "
                 "and SGLANG_ENABLE_SPEC_V2=1")
QWEN35 = "Qwen3.5-122B-A10B"


def write_shared(repo: DesiredRepo, hosts: list[fleetlib.Host], *, args: str = "", env: dict[str, str] | None = None,
                 rollout: str = "canary = 1\nmax_unavailable = 2", load_seconds: float = 1,
                 labels: dict[str, str] | None = None, ghosts: dict[str, str] | None = None,
                 webhook: str | None = None) -> None:
    """One shared definition (services/qwen.toml) used by every host: the rollout group.

    labels: host name -> inline labels; ghosts: extra host name -> address (unreachable).
    """
    notify = f'\n[notify]\nwebhook = "{webhook}"\ntimeout = 3\n' if webhook else ""
    repo.write("fleet.toml", f'[ssh]\nknown_hosts = "known_hosts"\n\n[rollout]\n{rollout}\n{notify}')
    repo.write("known_hosts", fleet_known_hosts(hosts))
    repo.write("units/standin.service", STANDIN_UNIT)
    env_all = {"STANDIN_LOAD_SECONDS": str(load_seconds), **(env or {})}
    repo.write("services/qwen.toml", "\n".join([
        'unit_file = "units/standin.service"',
        f'model = {{ id = "Qwen/{QWEN35}", path = "/models/{QWEN35}" }}',
        f'vars = {{ port = "30000", args = "{args}" }}',
        "env = { " + ", ".join(f'{k} = "{v}"' for k, v in env_all.items()) + " }",
        'health = { http = "http://{host.address}:{vars.port}/health", startup_timeout = 10, '
        'stable_for = 1, interval = 0.5 }',
        ""]))
    all_hosts = [(h.name, h.address) for h in hosts] + list((ghosts or {}).items())
    for name, address in all_hosts:
        lab = f"labels = {{ {labels[name]} }}\n" if labels and name in labels else ""
        repo.write(f"hosts/{name}.toml", f'address = "{address}"\n{lab}\n[services.{SERVICE}]\nuse = "qwen"\n')
    for rel, text in WITHOUT_INCIDENT_RULE.items():   # let the bad change reach the hosts (see conftest)
        repo.write(rel, text)


def invocations(fleet: Fleet, hosts: list[fleetlib.Host]) -> dict[str, str]:
    with ThreadPoolExecutor(len(hosts)) as pool:
        ids = pool.map(lambda h: fleet.show(h, SERVICE, "InvocationID")["InvocationID"], hosts)
    return dict(zip((h.name for h in hosts), ids, strict=False))


def record(fleet: Fleet, h: fleetlib.Host) -> dict:
    return json.loads(fleet.ssh(h, f"cat /var/lib/reconciler/services/{SERVICE}.json"))


class Sampler(threading.Thread):
    """Samples every host, all at once, round after round: systemd's ActiveState/SubState of the
    service and a GET /health from the host itself. Plain ssh (multiplexed, so a round is fast),
    not the reconciler's code. A host is up only when active/running and /health answers 200."""

    PROBE = ("systemctl show -p ActiveState,SubState {unit}; "
             "(exec 3<>/dev/tcp/{addr}/30000 && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && head -n1 <&3) "
             "2>/dev/null || echo NOHTTP")

    def __init__(self, fleet: Fleet, hosts: list[fleetlib.Host]):
        super().__init__(daemon=True)
        self.fleet, self.hosts = fleet, hosts
        self.stop = threading.Event()
        self.rounds: list[tuple[float, dict[str, bool]]] = []
        self.dir = tempfile.mkdtemp(prefix="rollout-sampler-")

    def ssh(self, h: fleetlib.Host) -> list[str]:
        base = fleetlib.ssh_base(h.address, self.fleet.known_hosts)
        return [*base[:-1], "-o", "ControlMaster=auto", "-o", f"ControlPath={self.dir}/%h",
                "-o", "ControlPersist=120", base[-1]]

    def up(self, h: fleetlib.Host) -> bool | None:
        """Up or down; None when the probe itself failed (ssh did not answer in time on a busy
        machine): that round says nothing about the host and is left out."""
        try:
            res = subprocess.run([*self.ssh(h), self.PROBE.format(unit=SERVICE, addr=h.address)],
                                 capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            return None
        out = res.stdout
        if res.returncode == 255 or "ActiveState=" not in out:
            return None
        return "ActiveState=active" in out and "SubState=running" in out and " 200 " in out

    def run(self) -> None:
        with ThreadPoolExecutor(len(self.hosts)) as pool:
            while not self.stop.is_set():
                states = list(pool.map(self.up, self.hosts))
                if None not in states:
                    self.rounds.append((time.monotonic(), {h.name: bool(s) for h, s in
                                                           zip(self.hosts, states, strict=True)}))

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        for h in self.hosts:
            subprocess.run([*self.ssh(h)[:-1], "-O", "exit", self.ssh(h)[-1]], capture_output=True, timeout=10)

    def max_down(self) -> int:
        return max((sum(not up for up in states.values()) for _, states in self.rounds), default=0)


class _Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.server.events.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))  # type: ignore[attr-defined]
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[dict]]]:
    monkeypatch.setenv("RECONCILER_WEBHOOK_ALLOW", "127.0.0.1/32")   # `reconcile` may reach a loopback webhook
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    server.events = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hooks/deploys", server.events  # type: ignore[attr-defined]
    server.shutdown()


@pytest.mark.timeout(240)
def test_bad_change_halts_at_the_canary(fleet, repo, webhook):
    hosts = fleet.hosts[:6]
    canary = hosts[4]                      # labelled: goes first although it is not first by name
    labels = {canary.name: 'canary = "true"'}
    url, events = webhook
    policy = "canary = 1\nmax_unavailable = 5"
    write_shared(repo, hosts, rollout=policy, labels=labels, webhook=url)
    c1 = repo.commit("qwen3.5 on six hosts")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    before = invocations(fleet, hosts)

    write_shared(repo, hosts, args=SPEC_FLAGS, rollout=policy, labels=labels, webhook=url)
    c2 = repo.commit("add MTP speculative decoding")
    res = run_cli("--repo", str(repo.path), check_codes=(3,))
    out = res.stdout
    assert f"halted at {canary.name} (wave 1, canary): CrashLoop" in out, out
    assert f"journal: {INCIDENT_LINE}" in out
    others = [h for h in hosts if h is not canary]
    assert f"not restarted, quarantined at {c2[:7]}: {', '.join(h.name for h in others)}" in out

    after = invocations(fleet, hosts)
    assert after[canary.name] != before[canary.name]                  # restarted, crashed, rolled back
    assert {h.name: after[h.name] for h in others} == {h.name: before[h.name] for h in others}
    assert "--speculative" not in fleet.show(canary, SERVICE, "ExecStart")["ExecStart"]
    rec = record(fleet, canary)
    assert rec["last_good_revision"] == c1 and rec["quarantine"]["revision"] == c2
    assert rec["quarantine"]["halted_at"] == canary.name and rec["quarantine"]["quote"] == INCIDENT_LINE
    for h in others:                                                   # the halt is on every host
        q = record(fleet, h)["quarantine"]
        assert (q["revision"], q["reason"], q["halted_at"], q["cause"]) == (
            c2, "RolloutHalted", canary.name, "CrashLoop")

    status = json.loads(run_cli("status", "--json", check_codes=(0,)).stdout)
    rows = {r["host"]: r for r in status if r["service"] == SERVICE}
    assert rows[canary.name]["quote"] == INCIDENT_LINE and "halted here" in rows[canary.name]["last_event"]
    for h in others:
        assert f"rollout halted at canary {canary.name}: CrashLoop" in rows[h.name]["last_event"]
        assert rows[h.name]["quote"] == INCIDENT_LINE and rows[h.name]["running_rev"] == c1
    table = run_cli("status", check_codes=(0,)).stdout
    assert f"rollout halted at canary {canary.name}" in table and INCIDENT_LINE in table

    kinds = [e["event"] for e in events]
    assert kinds[0] == "rollout.start" and "rollback" in kinds and kinds[-1] == "rollout.halt", kinds
    halt = events[-1]
    assert (halt["host"], halt["revision"], halt["reason"], halt["journal_line"]) == (canary.name, c2, "CrashLoop",
                                                                                      INCIDENT_LINE)
    assert halt["untouched"] == [h.name for h in others]
    rollback = next(e for e in events if e["event"] == "rollback")
    assert rollback["host"] == canary.name and rollback["rolled_back_to"] == c1

    # The same HEAD again: nothing restarts anywhere; no rollout starts.
    code, out2 = run_json("--repo", str(repo.path), check_codes=(3,))
    assert out2["rollouts"] == []
    assert {r["host"]: r["status"] for r in out2["hosts"]} == {h.name: "quarantined" for h in hosts}
    assert invocations(fleet, hosts) == after

    # A fix lifts it: a new rendering for every host, so the whole group rolls out.
    write_shared(repo, hosts, args=SPEC_FLAGS + " --mamba-scheduler-strategy extra_buffer",
                 env={"SGLANG_ENABLE_SPEC_V2": "1"}, rollout=policy, labels=labels)
    repo.commit("fix: extra_buffer and SGLANG_ENABLE_SPEC_V2")
    code, out3 = run_json("--repo", str(repo.path), check_codes=(0,))
    (ro,) = out3["rollouts"]
    assert ro["status"] == "done" and [w["hosts"] for w in ro["waves"]] == [[canary.name], [h.name for h in others]]
    final = invocations(fleet, hosts)
    assert all(final[h.name] != after[h.name] for h in hosts)


@pytest.mark.timeout(240)
def test_good_change_never_has_more_than_max_unavailable_down(fleet, repo):
    hosts = fleet.hosts[:6]
    write_shared(repo, hosts, load_seconds=2)
    repo.commit("six hosts")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    before = invocations(fleet, hosts)

    write_shared(repo, hosts, load_seconds=2, env={"SGLANG_LOG_LEVEL": "debug"})
    repo.commit("debug logging")
    sampler = Sampler(fleet, hosts)
    sampler.start()
    try:
        deadline = time.monotonic() + 30
        while len(sampler.rounds) < 3:         # every host up before the rollout begins
            assert time.monotonic() < deadline, "sampler did not start"
            time.sleep(0.1)
        assert sampler.max_down() == 0, sampler.rounds[-1]
        code, out = run_json("--repo", str(repo.path), check_codes=(0,))
        time.sleep(1)
    finally:
        sampler.finish()
    (ro,) = out["rollouts"]
    assert [len(w["hosts"]) for w in ro["waves"]] == [1, 2, 2, 1] and ro["status"] == "done"
    downs = [sum(not up for up in s.values()) for _, s in sampler.rounds]
    print(f"sampling: {len(downs)} rounds over {len(hosts)} hosts, most down at once: {max(downs)}")
    assert len(downs) >= 20, f"too few samples to judge: {len(downs)}"
    assert 1 <= max(downs) <= 2, f"down at once, per sampling round: {downs}"
    every_host_seen_down = {n for _, s in sampler.rounds for n, up in s.items() if not up}
    assert every_host_seen_down == {h.name for h in hosts}      # the sampling caught every restart
    assert {r["host"]: r["status"] for r in out["hosts"]} == {h.name: "converged" for h in hosts}
    after = invocations(fleet, hosts)
    assert all(after[h.name] != before[h.name] for h in hosts)
    for h in hosts:
        assert "SGLANG_LOG_LEVEL=debug" in fleet.environment(h, SERVICE)


@pytest.mark.timeout(180)
def test_unreachable_host_is_reported_and_blocks_nobody(fleet, repo):
    hosts = fleet.hosts[:3]
    write_shared(repo, hosts, ghosts={"ghost": "127.0.0.250"})
    repo.commit("three hosts and one that is down")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    st = {r["host"]: r for r in out["hosts"]}
    assert st["ghost"]["status"] == "failed" and st["ghost"]["reason"] == "Unreachable"
    assert all(st[h.name]["status"] == "converged" for h in hosts)
    (ro,) = out["rollouts"]
    assert ro["status"] == "done" and "ghost" not in ro["pending"] and "ghost" in ro["members"]
    for h in hosts:
        assert fleet.show(h, SERVICE, "ActiveState")["ActiveState"] == "active"
    res = run_cli("--repo", str(repo.path), check_codes=(4,))
    assert "ghost" in res.stdout and "Unreachable" in res.stdout


@pytest.mark.timeout(120)
def test_dry_run_prints_the_waves_and_selectors_limit_them(fleet, repo):
    hosts = fleet.hosts[:6]
    labels = {h.name: f'rack = "{"a" if i < 4 else "b"}"' for i, h in enumerate(hosts)}
    labels[hosts[2].name] = 'rack = "a", canary = "true"'
    write_shared(repo, hosts, labels=labels)
    rev = repo.commit("six hosts, two racks")
    res = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(2,))
    n = [h.name for h in hosts]
    assert (f"rollout of {SERVICE} (services/qwen.toml) at {rev[:7]}: 6 of 6 hosts restart, "
            f'canary = 1, max_unavailable = 2 (at most 2 at once)') in res.stdout, res.stdout
    assert f"wave 1 (canary): {n[2]}\n" in res.stdout
    assert f"wave 2: {n[0]}, {n[1]}\n" in res.stdout and f"wave 3: {n[3]}, {n[4]}\n" in res.stdout
    assert f"wave 4: {n[5]}\n" in res.stdout
    code, out = run_json("--repo", str(repo.path), "--dry-run", "--label", "rack=a", check_codes=(2,))
    (ro,) = out["rollouts"]
    assert [w["hosts"] for w in ro["waves"]] == [[n[2]], [n[0], n[1]], [n[3]]]
    assert sorted(r["host"] for r in out["hosts"]) == sorted(n[:4])
    code, out = run_json("--repo", str(repo.path), "--dry-run", "--label", "rack=a", "--label", "canary=true",
                         check_codes=(2,))
    assert [r["host"] for r in out["hosts"]] == [n[2]] and out["rollouts"] == []   # one host: no waves
    res = run_cli("--repo", str(repo.path), "--dry-run", "--label", "rack=c", check_codes=(1,))
    assert "no host matches --label rack=c" in res.stderr + res.stdout
    for h in hosts:                                                  # a dry run changes nothing
        assert not fleet.exists(h, f"/etc/systemd/system/{SERVICE}.service")
