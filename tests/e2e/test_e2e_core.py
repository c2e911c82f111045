"""End-to-end: the core loop on real systemd hosts over real SSH (issue 2).

Every test starts from freshly reset hosts (the `fleet` fixture) and a real git repo.
"""

from __future__ import annotations

import json
import shlex

import pytest

from tests import fleet as fleetlib
from tests.conftest import run_cli, run_json, write_fleet

pytestmark = pytest.mark.fleet

UNIT = "/etc/systemd/system/model-a.service"
ENV = "/etc/reconciler/env/model-a.env"     # the env file its drop-in names


def test_dry_run_apply_then_noop(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"model-a": {"port": 30000, "env": {"LOG_LEVEL": "info", "HF_HOME": "/srv/hf"}}})
    rev = repo.commit("first")

    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(2,))
    assert f"+++ {rev[:7]}:{UNIT}" in dry.stdout
    assert ("ExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /models/Qwen3-8B --host "
            + h.address) in dry.stdout
    assert '+LOG_LEVEL="info"' in dry.stdout and "EnvironmentFile=/etc/reconciler/env/model-a.env" in dry.stdout
    assert "start model-a" in dry.stdout and rev[:7] in dry.stdout
    # dry-run changed nothing
    assert not fleet.exists(h, UNIT) and fleet.no_records(h)

    run_cli("--repo", str(repo.path), check_codes=(0,))
    p = fleet.show(h, "model-a", "ActiveState", "SubState", "MainPID", "InvocationID", "UnitFileState")
    assert (p["ActiveState"], p["SubState"]) == ("active", "running")
    # what the process really got, from the env file (0600: root's alone)
    env = fleet.ssh(h, f"tr '\\0' '\\n' < /proc/{p['MainPID']}/environ").splitlines()
    assert "LOG_LEVEL=info" in env and "HF_HOME=/srv/hf" in env
    assert fleet.ssh(h, f"stat -c %a {ENV}").strip() == "600"
    assert p["UnitFileState"] == "enabled"
    stamp = fleet.ssh(h, f"stat -c %Y.%i {UNIT} {ENV} /var/lib/reconciler/host.json")

    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert out["hosts"][0]["status"] == "in-sync" and out["hosts"][0]["actions"] == []
    p2 = fleet.show(h, "model-a", "InvocationID")
    assert p2["InvocationID"] == p["InvocationID"]          # not restarted
    assert fleet.ssh(h, f"stat -c %Y.%i {UNIT} {ENV} /var/lib/reconciler/host.json") == stamp  # nothing written
    assert fleet.ssh(h, "cat /var/lib/reconciler/host.json").find(rev) >= 0


def test_env_change_restarts_exactly_that_service_on_those_hosts(fleet, repo):
    hosts = fleet.hosts[:3]
    services = {"model-a": {"port": 30000, "env": {"LOG_LEVEL": "info"}},
                "model-b": {"port": 30001, "env": {"LOG_LEVEL": "info"}}}
    write_fleet(repo, hosts, services)
    repo.commit("two services on three hosts")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    before = {(h.name, s): fleet.show(h, s, "InvocationID")["InvocationID"] for h in hosts for s in services}

    # change one env value of model-b on the second host only
    text = (repo.path / f"hosts/{hosts[1].name}.toml").read_text()
    head, tail = text.split("[services.model-b]")
    tail = tail.replace('LOG_LEVEL = "info"', 'LOG_LEVEL = "debug"')
    repo.write(f"hosts/{hosts[1].name}.toml", head + "[services.model-b]" + tail)
    repo.commit("debug logging for model-b on one host")

    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(2,))
    assert "env changed: LOG_LEVEL" in dry.stdout and "daemon-reload" not in dry.stdout
    reloads = reload_count(fleet, hosts[1])
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    statuses = {r["host"]: r["status"] for r in out["hosts"]}
    assert statuses == {hosts[0].name: "in-sync", hosts[1].name: "converged", hosts[2].name: "in-sync"}
    after = {(h.name, s): fleet.show(h, s, "InvocationID")["InvocationID"] for h in hosts for s in services}
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {(hosts[1].name, "model-b")}
    assert "LOG_LEVEL=debug" in fleet.environment(hosts[1], "model-b")
    # the env file is read at the start: systemd was never reloaded, the switch included
    assert reload_count(fleet, hosts[1]) == reloads


def reload_count(fleet, h: fleetlib.Host) -> int:
    """How many daemon-reloads systemd has logged since it booted."""
    return int(fleet.ssh(h, "journalctl -b _PID=1 -o cat --no-pager | grep -c '^Reloading[.]$' || true").strip())


def test_a_host_with_the_env_in_environment_lines_moves_to_the_env_file_without_a_restart(fleet, repo):
    """A host an older reconciler deployed had the env as Environment= lines in the drop-in and
    no env file. The first run after the upgrade moves the files (and reloads), restarts
    nothing, and the process keeps the same env; the next run is in sync."""
    from reconciler.plan.files import legacy_env_dropin as _legacy_env_dropin
    h = fleet.hosts[0]
    write_fleet(repo, [h], {"model-a": {"port": 30000, "env": {"LOG_LEVEL": "info", "Q": 'a "b" 50% \\ $x'}}})
    repo.commit("v1")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    legacy = _legacy_env_dropin({"LOG_LEVEL": "info", "Q": 'a "b" 50% \\ $x'})
    fleet.ssh(h, f"printf '%s' {shlex.quote(legacy)} > /etc/systemd/system/model-a.service.d/50-reconciler-env.conf"
                 f" && rm {ENV} && systemctl daemon-reload")
    inv = fleet.show(h, "model-a", "InvocationID")["InvocationID"]
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    r = out["hosts"][0]
    assert r["status"] == "converged" and "no restart" in json.dumps(r["actions"]), r
    assert fleet.show(h, "model-a", "InvocationID")["InvocationID"] == inv
    assert fleet.exists(h, ENV) and 'LOG_LEVEL=info' in fleet.environment(h, "model-a")
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert out["hosts"][0]["status"] == "in-sync"


def test_hand_edit_is_drift_and_is_reverted(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h])
    repo.commit()
    run_cli("--repo", str(repo.path), check_codes=(0,))
    good = fleet.ssh(h, f"cat {UNIT}")
    # the incident's scp: someone edits the unit by hand and restarts
    fleet.ssh(h, f"sed -i 's/--port 30000/--port 30000 --speculative-algo NEXTN/' {UNIT} && "
                 "systemctl daemon-reload && systemctl restart model-a")

    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(2,))
    assert "drift" in dry.stdout
    assert "-ExecStart=/usr/bin/python3 -m sglang.launch_server" in dry.stdout
    assert "--speculative-algo NEXTN" in dry.stdout
    assert "--speculative-algo NEXTN" in fleet.ssh(h, f"cat {UNIT}")   # dry-run left it alone

    run_cli("--repo", str(repo.path), check_codes=(0,))
    assert fleet.ssh(h, f"cat {UNIT}") == good
    assert "--speculative-algo" not in fleet.show(h, "model-a", "ExecStart")["ExecStart"]
    assert fleet.show(h, "model-a", "ActiveState")["ActiveState"] == "active"


def test_removed_service_is_cleaned_up_and_foreign_units_left_alone(fleet, repo):
    h = fleet.hosts[0]
    services = {"model-a": {"port": 30000, "env": {"A": "1"}}, "model-b": {"port": 30001, "env": {"B": "1"}}}
    write_fleet(repo, [h], services)
    repo.commit()
    run_cli("--repo", str(repo.path), check_codes=(0,))
    # a unit the reconciler never installed
    fleet.ssh(h, "printf '[Service]\\nExecStart=/bin/sleep infinity\\n' > /etc/systemd/system/handmade.service && "
                 "systemctl daemon-reload && systemctl start handmade")
    hand_id = fleet.show(h, "handmade", "InvocationID")["InvocationID"]

    write_fleet(repo, [h], {"model-a": services["model-a"]})
    repo.commit("drop model-b")
    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(2,))
    assert "stop model-b" in dry.stdout and "handmade" not in dry.stdout
    run_cli("--repo", str(repo.path), check_codes=(0,))
    b = fleet.show(h, "model-b", "ActiveState", "LoadState", "UnitFileState")
    assert b["ActiveState"] == "inactive" and b["LoadState"] == "not-found"
    assert not fleet.exists(h, "/etc/systemd/system/model-b.service")
    assert not fleet.exists(h, "/etc/systemd/system/model-b.service.d")
    assert not fleet.exists(h, "/etc/systemd/system/multi-user.target.wants/model-b.service")
    assert not fleet.exists(h, "/var/lib/reconciler/services/model-b.json")
    assert fleet.show(h, "handmade", "InvocationID")["InvocationID"] == hand_id
    assert fleet.exists(h, "/etc/systemd/system/handmade.service")
    assert fleet.show(h, "model-a", "ActiveState")["ActiveState"] == "active"


BAD_INPUTS = {
    "missing-address": ({"hosts/{h}.toml": '[services.model-a]\nunit = "[Service]\\nExecStart=/bin/true\\n"\n'},
                        ["hosts/{h}.toml", "address"]),
    "unknown-key": ({"hosts/{h}.toml": 'address = "{a}"\nadress2 = "x"\n'}, ["hosts/{h}.toml", "adress2"]),
    "wrong-type": ({"hosts/{h}.toml": 'address = "{a}"\n[ssh]\nport = "twenty-two"\n'}, ["hosts/{h}.toml", "ssh.port"]),
    "newline-in-env": ({"hosts/{h}.toml": 'address = "{a}"\n[services.model-a]\nunit_file = "units/standin.service"\n'
                                          'vars = {{ port = "1" }}\nmodel = {{ id = "m", path = "/m" }}\n'
                                          'env = {{ SECRET_TOKEN = "abc\\nExecStartPre=/bin/rm -rf /" }}\n'},
                       ["hosts/{h}.toml", "services.model-a.env.SECRET_TOKEN"]),
    "missing-unit-file": ({"hosts/{h}.toml": 'address = "{a}"\n[services.model-a]\nunit_file = "units/nope.service"\n'},
                          ["hosts/{h}.toml", "services.model-a.unit_file", "units/nope.service"]),
    "toml-syntax": ({"hosts/{h}.toml": 'address = "{a}"\n[services.model-a\n'}, ["hosts/{h}.toml", "line 2"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_1_names_file_and_key_and_touches_nothing(fleet, repo, case):
    h = fleet.hosts[0]
    write_fleet(repo, [h])
    files, expect = BAD_INPUTS[case]
    for rel, text in files.items():
        repo.write(rel.format(h=h.name), text.format(h=h.name, a=h.address))
    repo.commit(f"bad: {case}")
    for args in (("--dry-run",), ()):
        res = run_cli("--repo", str(repo.path), *args, check_codes=(1,))
        for word in expect:
            assert word.format(h=h.name) in res.stderr, res.stderr
        assert "abc" not in res.stderr and "rm -rf" not in res.stderr   # env values never echoed
    assert fleet.no_records(h) and not fleet.exists(h, UNIT)


def test_wrong_host_key_fails_that_host_only(fleet, repo):
    good, bad = fleet.hosts[0], fleet.hosts[1]
    write_fleet(repo, [good, bad])
    # a different ed25519 key recorded for the bad host
    other = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    repo.write("known_hosts", f"{good.known_hosts_line()}\n{bad.address} {other}\n")
    repo.commit()
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    res = {r["host"]: r for r in out["hosts"]}
    assert res[good.name]["status"] == "converged"
    assert res[bad.name]["status"] == "failed" and res[bad.name]["reason"] == "HostKeyUnverified"
    assert "host key" in res[bad.name]["message"] and "known_hosts" in res[bad.name]["message"]
    assert not fleet.exists(bad, UNIT)
    assert fleet.show(good, "model-a", "ActiveState")["ActiveState"] == "active"


def test_unreachable_host_does_not_stop_others(fleet, repo):
    h = fleet.hosts[0]
    write_fleet(repo, [h])
    repo.write("hosts/ghost.toml", 'address = "127.0.0.250"\n')
    repo.commit()
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    res = {r["host"]: r for r in out["hosts"]}
    assert res["ghost"]["reason"] == "Unreachable"
    assert res[h.name]["status"] == "converged"


def test_ten_hosts_converge_in_one_run_from_a_url(fleet, repo, tmp_path):
    hosts = fleet.hosts[:10]
    assert len(hosts) == 10
    write_fleet(repo, hosts)
    rev = repo.commit()
    url = f"file://{repo.path}"
    code, out = run_json("--repo", url, "--cache-dir", str(tmp_path / "cache"), check_codes=(0,))
    assert out["revision"] == rev
    assert [r["status"] for r in out["hosts"]] == ["converged"] * 10
    for h in hosts:
        assert fleet.show(h, "model-a", "ActiveState")["ActiveState"] == "active"
    # a later commit is fetched on the next run; --rev still reaches the old one
    write_fleet(repo, hosts, {"model-a": {"port": 30000, "env": {"LOG_LEVEL": "warning"}}})
    rev2 = repo.commit("warning")
    code, out = run_json("--repo", url, "--cache-dir", str(tmp_path / "cache"), "--dry-run", check_codes=(2,))
    assert out["revision"] == rev2
    code, out = run_json("--repo", url, "--cache-dir", str(tmp_path / "cache"), "--rev", rev[:10], "--dry-run",
                         check_codes=(0,))
    assert out["revision"] == rev


def test_a_host_expected_to_change_is_locked_without_a_first_look(fleet, repo):
    # The controller notes the revision each host was left in sync with. At that revision a run
    # reads each host once and locks none; at a new revision, where every host at least records
    # the revision, each is locked and read under the lock at once (one observation per host,
    # not two).
    import asyncio

    from reconciler.controller.store import Store, expect_changes
    from reconciler.loop.fleet import run_fleet
    from reconciler.loop.host_run import ssh_connector
    from reconciler.loop.options import RunIO, RunOptions
    from reconciler.loop.revision import load_revision

    hosts = fleet.hosts[:2]
    write_fleet(repo, hosts, {"model-a": {"port": 30000, "env": {"LOG_LEVEL": "info"}}})
    repo.commit("two hosts")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    connect = ssh_connector(str(fleetlib.client_key_path()))

    def run_recorded() -> tuple[dict[str, str], dict[str, list[str]], frozenset[str]]:
        opts = RunOptions(repo=str(repo.path))
        _snap, rev = load_revision(opts)
        state = rev.state
        store = Store()
        expect = expect_changes(store.in_sync(), state.revision, state.hosts)
        store.close()
        seen: dict[str, list[str]] = {}

        async def recording(host):
            t = await connect(host)
            run, spawn = t.run, t.spawn

            async def rec_run(cmd, **kw):
                seen.setdefault(host.name, []).append(kw.get("what", "command"))
                return await run(cmd, **kw)

            async def rec_spawn(cmd):
                seen.setdefault(host.name, []).append("lock")
                return await spawn(cmd)
            t.run, t.spawn = rec_run, rec_spawn
            return t

        res = asyncio.run(run_fleet(rev, opts, RunIO(connect=recording, expect_changes=expect)))
        return {r.host: str(r.status) for r in res.hosts}, seen, expect

    statuses, seen, expect = run_recorded()
    assert expect == frozenset() and set(statuses.values()) == {"in-sync"}
    assert seen == {h.name: ["observe"] for h in hosts}

    text = (repo.path / f"hosts/{hosts[1].name}.toml").read_text()
    repo.write(f"hosts/{hosts[1].name}.toml", text.replace('LOG_LEVEL = "info"', 'LOG_LEVEL = "debug"'))
    repo.commit("debug on the second host")
    statuses, seen, expect = run_recorded()
    assert expect == {h.name for h in hosts}
    assert statuses == {hosts[0].name: "in-sync", hosts[1].name: "converged"}
    for h in hosts:
        # Locked at once, and every command after that (pre-flight, apply, the verdict) went
        # through the lock holder's shell: no SSH channel of its own (session.py)
        assert seen[h.name] == ["lock"], seen
    assert "LOG_LEVEL=debug" in fleet.environment(hosts[1], "model-a")


def test_the_warm_daemons_standing_session_reads_a_host_as_a_channel_of_its_own_does(fleet, repo):
    # The daemon's pool runs a reused connection's observation in its standing session's bash
    # (host/pool.py, session.py; the loop's own shell, round after round), not in an sh of its own
    # on a channel: what it reads of a real
    # host is the same, to the byte: the unit, the env drop-in and file, the records, a foreign
    # drop-in whose last line has no newline and holds backslashes, a stale temp file, and
    # systemd's reading.
    import asyncio

    from reconciler.host.pool import Pool
    from reconciler.loop.host_run import observe, ssh_connector
    from reconciler.loop.options import RunOptions
    from reconciler.loop.revision import load_revision

    h = fleet.hosts[0]
    write_fleet(repo, [h], {"model-a": {"port": 30000, "env": {"LOG_LEVEL": "info"}}})
    repo.commit("one host")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    fleet.ssh(h, "mkdir -p /etc/systemd/system/model-a.service.d && "
                 "printf '[Service]\\nEnvironment=\"A=x\\\\\\\\y\"\\n\\n  Nice=5' "
                 "> /etc/systemd/system/model-a.service.d/zz-foreign.conf && "
                 "touch /etc/systemd/system/.reconciler-tmp.123.4")
    spec = load_revision(RunOptions(repo=str(repo.path)))[1].state.hosts[h.name]
    connect = ssh_connector(str(fleetlib.client_key_path()))

    async def both():
        own = await connect(spec)
        try:
            plain = await observe(own, spec)
        finally:
            await own.close()
        pool = Pool(connect, standing=True)
        try:
            await (await pool.lease(spec)).close()            # the first lease: no session yet
            t = await pool.lease(spec)
            in_session = await observe(t, spec)
            again = await observe(t, spec)         # a later round, in the same shell (session.sh's here())
            session = pool._entries[h.name].session
            await t.close()
            assert again == in_session
            return plain, in_session, session is not None and session.came_up and not session.broken
        finally:
            await pool.close()

    plain, in_session, used = asyncio.run(both())
    assert used                                                 # it did go through the session
    assert in_session == plain
    assert plain.services["model-a"].dropins["/etc/systemd/system/model-a.service.d/zz-foreign.conf"] == (
        '[Service]\nEnvironment="A=x\\\\y"\n\n  Nice=5')
    assert plain.stale_temps == ("/etc/systemd/system/.reconciler-tmp.123.4",)
    assert plain.services["model-a"].props["ActiveState"] == "active"
