"""End-to-end: secrets (issue 13), on real hosts.

A canary value in each kind of secret (age-encrypted in git as a credential and as an environment
variable, a file on the host by reference as a credential and as an environment variable) reaches
the server process, and appears nowhere else: not in any command output, the state store, the
daemon's logs, a webhook body, the pushed stream, nor in anything a non-root user on the host can
read (checked as `nobody`). Rotating a secret restarts exactly the services that use it, and the
diff names the secret, not the value.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import secrets as pysecrets
import shlex
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from tests import engines
from tests import fleet as fleetlib
from tests.conftest import ROOT, DesiredRepo, write_fleet
from tests.e2e.test_e2e_push import Deploy

pytestmark = pytest.mark.fleet

CRED = "/run/credentials"


def canaries() -> dict[str, str]:
    tag = pysecrets.token_hex(6)
    return {"API_KEY": f"canary-api-{tag}",
            "DB_URL": f"postgres://app:canarypw{tag}@db.invalid/x",
            "HF_TOKEN": f"hf_canary{tag}CANARYCANARY",
            "S3_KEY": f"canary-s3-{tag}"}


def reconcile(*args: str, env: dict[str, str], stdin: str | None = None,
              codes: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "reconciler", *args], cwd=ROOT, env=env, input=stdin,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode in codes, f"reconcile {' '.join(args)} exited {res.returncode}\n{res.stdout}{res.stderr}"
    return res


class Secrets:
    """A controller identity, a repo with its recipients, and the encrypt step an operator runs."""

    def __init__(self, tmp: Path, repo: Path):
        self.key = tmp / "controller" / "age.key"
        self.key.parent.mkdir(parents=True, exist_ok=True)
        self.repo = repo
        self.env = {**os.environ, "RECONCILER_IDENTITY": str(fleetlib.client_key_path()),
                    "RECONCILER_AGE_IDENTITY": str(self.key), "COLUMNS": "200", "NO_COLOR": "1",
                    "RECONCILER_STATE_DIR": str(tmp / "state")}
        out = reconcile("secrets", "keygen", "--out", str(self.key), env=self.env).stdout
        public = re.search(r"age1[0-9a-z]+", out)
        assert public, out
        (repo / "secrets").mkdir(parents=True, exist_ok=True)
        (repo / "secrets" / "recipients.txt").write_text(f"# the controller\n{public.group(0)}\n")

    def encrypt(self, name: str, value: str) -> str:
        out = reconcile("secrets", "encrypt", name, "--repo", str(self.repo), env=self.env, stdin=value + "\n").stdout
        assert value not in out
        m = re.search(r'age = "([^"]+)"', out)
        assert m, out
        assert (self.repo / m.group(1)).read_text().startswith("-----BEGIN AGE ENCRYPTED FILE-----")
        return m.group(1)


SECRETS_A = ('[services.model-a.secrets]\nAPI_KEY = {{ age = "{api}" }}\nDB_URL = {{ age = "{db}", env = true }}\n'
             'HF_TOKEN = {{ file = "/etc/credstore/hf_token" }}\n'
             'S3_KEY = {{ file = "/etc/credstore/s3_key", env = true }}\n')
SECRETS_B = '[services.model-b.secrets]\nHF_TOKEN = { file = "/etc/credstore/hf_token" }\n'


def services(**a_env: str) -> dict:
    need = {"STANDIN_SECRETS": "API_KEY,DB_URL,HF_TOKEN,S3_KEY"}
    base = {"STANDIN_LOAD_SECONDS": "0.3"}
    return {"model-a": {"port": 30000, "env": {**base, "CUDA_VISIBLE_DEVICES": "0", **need, **a_env}},
            "model-b": {"port": 30001, "env": {**base, "CUDA_VISIBLE_DEVICES": "1", "STANDIN_SECRETS": "HF_TOKEN"}},
            "model-c": {"port": 30002, "env": {**base, "CUDA_VISIBLE_DEVICES": "2"}}}


def write(repo: DesiredRepo, hosts, paths: dict[str, str], **a_env: str) -> None:
    write_fleet(repo, hosts, services(**a_env))
    for h in hosts:
        p = repo.path / "hosts" / f"{h.name}.toml"
        p.write_text(p.read_text() + "\n" + SECRETS_A.format(**paths) + "\n" + SECRETS_B)


def provision(fleet, h, values: dict[str, str]) -> None:
    """The referenced secrets, put on the host by other means (root-only)."""
    fleet.ssh(h, "install -d -m 0700 /etc/credstore && umask 077 && "
                 f"printf '%s\\n' '{values['HF_TOKEN']}' > /etc/credstore/hf_token && "
                 f"printf '%s' '{values['S3_KEY']}' > /etc/credstore/s3_key")


def invocations(fleet, h) -> dict[str, str]:
    return {n: fleet.show(h, n, "InvocationID")["InvocationID"] for n in ("model-a", "model-b", "model-c")}


def as_nobody_sees(fleet, h, values: list[str]) -> str:
    """Everything a non-root user on the host can read that holds a canary ('' when nothing). The
    canaries reach the check on a pattern file in /dev/shm (not searched), so no command line of
    the check's own holds one."""
    pats = "/dev/shm/canaries"
    fleet.ssh(h, f"printf '%s\\n' {' '.join(shlex.quote(v) for v in values)} > {pats} && chmod 0644 {pats}")
    # /opt/engines is the engine packages the test fleet binds read-only into every host (6 GB,
    # tests/engines.py): nothing the reconciler or a service writes, so it is not searched.
    script = (f"grep -rlsaF -f {pats} /etc /var /run /tmp /srv /home $(find /opt -mindepth 1 -maxdepth 1 "
              f"! -path {engines.HOST_ROOT}) 2>/dev/null; "
              f"for p in /proc/[0-9]*; do cat $p/environ $p/cmdline 2>/dev/null | grep -qaF -f {pats} && echo $p; "
              f"done; "
              f"systemctl show model-a.service model-b.service 2>/dev/null | grep -aF -f {pats}; "
              f"journalctl --no-pager 2>/dev/null | grep -aF -f {pats}; true")
    try:
        return fleet.ssh(h, f"su -s /bin/sh nobody -c {shlex.quote(script)}", check=False).strip()
    finally:
        fleet.ssh(h, f"rm -f {pats}")


def grep_tree(root: Path, values: list[str]) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            hits += [f"{p}: {v}" for v in values if v.encode() in data]
    return hits


@pytest.mark.timeout(150)
def test_canaries_reach_the_server_and_nowhere_else_and_rotation_restarts_exactly_their_services(
        fleet, repo, tmp_path):
    h = fleet.hosts[0]
    values = canaries()
    sec = Secrets(tmp_path, repo.path)
    paths = {"api": sec.encrypt("API_KEY", values["API_KEY"]), "db": sec.encrypt("DB_URL", values["DB_URL"])}
    provision(fleet, h, values)
    write(repo, [h], paths)
    repo.commit("model servers with secrets")
    env = sec.env
    outputs = [reconcile("--repo", str(repo.path), "--dry-run", env=env, codes=(2,)),
               reconcile("--repo", str(repo.path), env=env)]

    # delivered: the credentials in the service's $CREDENTIALS_DIRECTORY, the env ones in its environment
    pid = fleet.show(h, "model-a", "MainPID")["MainPID"]
    environ = fleet.ssh(h, f"tr '\\0' '\\n' < /proc/{pid}/environ")
    assert f"DB_URL={values['DB_URL']}" in environ.splitlines()
    assert f"S3_KEY={values['S3_KEY']}" in environ.splitlines()
    assert "API_KEY=" not in environ and "HF_TOKEN=" not in environ
    assert fleet.ssh(h, f"cat {CRED}/model-a.service/API_KEY") == values["API_KEY"]
    assert fleet.ssh(h, f"cat {CRED}/model-a.service/HF_TOKEN").strip() == values["HF_TOKEN"]
    assert fleet.ssh(h, f"cat {CRED}/model-b.service/HF_TOKEN").strip() == values["HF_TOKEN"]
    journal = fleet.ssh(h, "journalctl -u model-a --no-pager -o cat")
    assert "secret API_KEY: " in journal and "bytes from the credential" in journal
    assert "secret DB_URL: " in journal and "bytes from the environment" in journal
    # root-only on the host: the credstore and its files, the environment file
    modes = fleet.ssh(h, "stat -c '%a %U %n' /var/lib/reconciler/credstore /var/lib/reconciler/credstore/model-a "
                         "/var/lib/reconciler/credstore/model-a/API_KEY /var/lib/reconciler/credstore/model-a.env")
    assert [ln.split()[:2] for ln in modes.splitlines()] == [["700", "root"]] * 2 + [["600", "root"]] * 2, modes
    dropin = fleet.ssh(h, "cat /etc/systemd/system/model-a.service.d/60-reconciler-secrets.conf")
    assert "LoadCredential=API_KEY:" in dropin and "EnvironmentFile=" in dropin
    assert not any(v in dropin for v in values.values())

    # a second run: in sync, nothing restarted
    before = invocations(fleet, h)
    outputs.append(reconcile("--repo", str(repo.path), "--json", env=env))
    assert json.loads(outputs[-1].stdout)["hosts"][0]["status"] == "in-sync"
    assert invocations(fleet, h) == before

    # rotate the age secret: the diff names it, only model-a restarts
    rotated = dict(values, API_KEY=values["API_KEY"] + "-v2")
    paths["api"] = sec.encrypt("API_KEY", rotated["API_KEY"])
    write(repo, [h], paths)
    repo.commit("rotate API_KEY")
    dry = reconcile("--repo", str(repo.path), "--dry-run", env=env, codes=(2,))
    assert "secret API_KEY changed" in dry.stdout, dry.stdout
    outputs += [dry, reconcile("--repo", str(repo.path), env=env)]
    after = invocations(fleet, h)
    assert after["model-a"] != before["model-a"]
    assert (after["model-b"], after["model-c"]) == (before["model-b"], before["model-c"])
    assert fleet.ssh(h, f"cat {CRED}/model-a.service/API_KEY") == rotated["API_KEY"]

    # rotate the referenced file on the host: exactly the two services that use it restart
    rotated["HF_TOKEN"] = values["HF_TOKEN"] + "V2"
    provision(fleet, h, rotated)
    run = reconcile("--repo", str(repo.path), env=env)
    outputs.append(run)
    assert "secret HF_TOKEN changed" in run.stdout, run.stdout
    again = invocations(fleet, h)
    assert again["model-a"] != after["model-a"] and again["model-b"] != after["model-b"]
    assert again["model-c"] == after["model-c"]
    assert fleet.ssh(h, f"cat {CRED}/model-b.service/HF_TOKEN").strip() == rotated["HF_TOKEN"]

    every = [*values.values(), rotated["API_KEY"], rotated["HF_TOKEN"]]
    for res in outputs:
        for v in every:
            assert v not in res.stdout + res.stderr, f"{v} printed by reconcile:\n{res.stdout}{res.stderr}"
    assert grep_tree(tmp_path / "state", every) == []
    # the check itself finds what nobody can read (a control), then none of the canaries
    fleet.ssh(h, "echo control-visible > /tmp/control && chmod 0644 /tmp/control")
    assert "/tmp/control" in as_nobody_sees(fleet, h, ["control-visible"])
    assert as_nobody_sees(fleet, h, every) == ""


@pytest.mark.timeout(150)
def test_missing_reference_blocks_with_a_clear_message_and_writes_nothing(fleet, repo, tmp_path):
    h = fleet.hosts[0]
    values = canaries()
    sec = Secrets(tmp_path, repo.path)
    paths = {"api": sec.encrypt("API_KEY", values["API_KEY"]), "db": sec.encrypt("DB_URL", values["DB_URL"])}
    write(repo, [h], paths)
    repo.commit("the referenced files were never provisioned")
    res = reconcile("--repo", str(repo.path), "--json", env=sec.env, codes=(4,))
    host = json.loads(res.stdout)["hosts"][0]
    msg = json.dumps(host)
    assert "SecretMissing" in msg and "/etc/credstore/hf_token does not exist on the host" in msg
    assert not fleet.exists(h, "/etc/systemd/system/model-a.service")
    assert not fleet.exists(h, "/var/lib/reconciler/credstore/model-a")
    # model-c has no secrets: it deploys
    assert fleet.show(h, "model-c", "ActiveState")["ActiveState"] == "active"
    # another controller's key cannot decrypt: blocked, nothing written, the value never shown
    other = Secrets(tmp_path / "other", tmp_path / "other-repo")
    provision(fleet, h, values)
    res = reconcile("--repo", str(repo.path), "--json", env={**sec.env, "RECONCILER_AGE_IDENTITY": str(other.key)},
                    codes=(4,))
    msg = json.dumps(json.loads(res.stdout)["hosts"][0])
    assert "SecretUndecryptable" in msg and "secrets/api-key.age" in msg
    assert not fleet.exists(h, "/etc/systemd/system/model-a.service")


class Hook(http.server.BaseHTTPRequestHandler):
    bodies: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        Hook.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *a) -> None:
        pass


@pytest.mark.timeout(180)
def test_a_pushed_deploy_that_leaks_its_token_is_masked_in_every_output(fleet, tmp_path):
    """The server echoes the rejected token in its last journal line: the rollback quotes that
    line, and the value is masked in the push stream, the daemon's log, the webhook body, the store
    and `reconcile status`/`history`."""
    h = fleet.hosts[0]
    values = canaries()
    d = Deploy(tmp_path)
    sec = Secrets(tmp_path, d.clone)
    # the webhook listens on loopback: the daemon's config allows it (fleet.toml alone cannot)
    (tmp_path / "config.toml").write_text(f'age_identity = "{sec.key}"\nwebhook_allow = ["127.0.0.1/32"]\n')
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    Hook.bodies = []
    provision(fleet, h, values)
    paths = {"api": sec.encrypt("API_KEY", values["API_KEY"]), "db": sec.encrypt("DB_URL", values["DB_URL"])}
    try:
        notify = f'\n[notify]\nwebhook = "http://127.0.0.1:{srv.server_address[1]}/hook"\ntimeout = 3\n'
        fleet_toml = d.clone / "fleet.toml"
        write(d.repo, [h], paths)
        fleet_toml.write_text(fleet_toml.read_text() + notify)
        d.commit("v1")
        d.start()
        first = d.push("-o", "reconcile.wait")
        assert "finished with exit 0" in first.stdout + first.stderr, first.stdout + first.stderr
        write(d.repo, [h], paths, STANDIN_REJECT_SECRET="API_KEY")
        fleet_toml.write_text(fleet_toml.read_text() + notify)
        d.commit("v2 rejects its token")
        second = d.push("-o", "reconcile.wait", check=False)
        stream = second.stdout + second.stderr
        assert "upstream rejected the token *** for API_KEY" in stream, stream
        assert "rolled back" in stream or "rolled-back" in stream, stream
        status = reconcile("status", env={**d.env, "COLUMNS": "200"})
        hist = reconcile("history", h.name, env={**d.env, "COLUMNS": "200"})
    finally:
        d.stop()
        srv.shutdown()
    assert any(b"upstream rejected the token *** for API_KEY" in b for b in Hook.bodies), Hook.bodies
    texts = {"push v1": first.stdout + first.stderr, "push v2": stream, "daemon log": d.daemon_log(),
             "webhook": b"\n".join(Hook.bodies).decode(errors="replace"),
             "status": status.stdout + status.stderr, "history": hist.stdout + hist.stderr}
    for what, text in texts.items():
        for v in values.values():
            assert v not in text, f"{v} in the {what}:\n{text}"
    assert grep_tree(d.state, list(values.values())) == []
    assert as_nobody_sees(fleet, h, list(values.values())) == ""
