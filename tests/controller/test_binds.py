"""Where the daemon's page and metrics listen: loopback unless the config says so in so many
words (review L8), and a port someone else holds never keeps the daemon from starting (L2)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pygit2
import pytest

from reconciler.controller.config import (
    ControllerConfig,
    cannot_listen,
    is_loopback,
    load_config,
    parse_address,
    public_note,
)
from reconciler.errors import ConfigError
from tests.conftest import ROOT


@pytest.fixture(autouse=True)
def no_env_overrides(monkeypatch):
    """The RECONCILER_* keys of the environment running the tests must not leak in."""
    for key in ControllerConfig.model_fields:
        monkeypatch.delenv(f"RECONCILER_{key.upper()}", raising=False)


def problems(path: Path, text: str, **overrides: object) -> list[tuple[str, str, str]]:
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return [(p.file, p.key, p.message) for p in e.value.problems]


@pytest.mark.parametrize("key", ["web", "metrics"])
@pytest.mark.parametrize("address", ["0.0.0.0:9188", "[::]:9188", "192.0.2.7:9188", "gpu-ctl.example:9188"])
def test_a_public_bind_is_refused_naming_the_file_and_the_key(tmp_path, key, address):
    cfg = tmp_path / "config.toml"
    [(file, where, message)] = problems(cfg, f'{key} = "{address}"\n')
    assert (file, where) == (str(cfg), key)
    assert f"'{address}' is not a loopback address" in message
    assert f"set {key}_public = true" in message and "no login" in message and "plain HTTP" in message


@pytest.mark.parametrize("key", ["web", "metrics"])
def test_a_public_bind_is_served_when_the_config_says_so(tmp_path, key):
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'{key} = "0.0.0.0:9188"\n{key}_public = true\n')
    assert getattr(load_config(cfg), key) == "0.0.0.0:9188"


@pytest.mark.parametrize("address", ["127.0.0.1:9188", "127.8.9.10:1", "localhost:9188", "[::1]:9188", ":9188",
                                     "127.0.0.1:0", ""])
def test_loopback_binds_and_off_need_nothing(tmp_path, address):
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'web = "{address}"\nmetrics = "{address}"\n')
    c = load_config(cfg)
    assert (c.web, c.metrics, c.web_public, c.metrics_public) == (address, address, False, False)


def test_a_malformed_address_is_a_problem_of_its_key(tmp_path):
    cfg = tmp_path / "config.toml"
    [(file, key, message)] = problems(cfg, 'metrics = "9187"\n')
    assert (file, key) == (str(cfg), "metrics") and "expected host:port" in message


def test_the_environment_and_the_command_line_meet_the_same_rule_and_are_named(tmp_path, monkeypatch):
    cfg = tmp_path / "config.toml"
    monkeypatch.setenv("RECONCILER_METRICS", "0.0.0.0:9187")
    got = problems(cfg, "", web="0.0.0.0:9188", labels=["shard=a"])
    assert [(f, k) for f, k, _ in got] == [("environment", "RECONCILER_METRICS"), ("command line", "--web")]
    monkeypatch.setenv("RECONCILER_METRICS_PUBLIC", "true")
    cfg.write_text("web_public = true\n")
    c = load_config(cfg, {"web": "0.0.0.0:9188"})
    assert (c.web, c.metrics) == ("0.0.0.0:9188", "0.0.0.0:9187")


def test_watch_refuses_a_public_web_option_and_starts_nothing(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'repo = "{tmp_path / "repo.git"}"\nstate_dir = "{tmp_path / "state"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECONCILER_")}
    res = subprocess.run([sys.executable, "-m", "reconciler", "watch", "--config", str(cfg), "--web", "0.0.0.0:9188"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env={**env, "COLUMNS": "200"})
    assert res.returncode == 1
    assert "command line: --web: " in res.stderr and "web_public = true" in res.stderr
    assert "reconciler watching" not in res.stdout and not (tmp_path / "state").exists()


def test_the_log_line_of_a_public_bind_and_of_a_squatted_port():
    assert public_note("web", "127.0.0.1") == "" and public_note("metrics", "::1") == ""
    assert public_note("web", "0.0.0.0") == (" (PUBLIC: web_public = true; open to the network, with no login "
                                             "and over plain HTTP)")
    taken = OSError(errno.EADDRINUSE, "Address already in use")
    assert cannot_listen("127.0.0.1:9187", taken) == (
        "cannot listen on 127.0.0.1:9187: Address already in use: another process listens there, and tunnels to "
        "this port reach it, not this daemon")
    assert is_loopback("127.1.2.3") and not is_loopback("::ffff:127.0.0.1") and not is_loopback("localhost.")
    assert parse_address("[::1]:0") == ("::1", 0)


@contextlib.contextmanager
def squatter():
    """A port on 127.0.0.1 that another process (here: this test) listens on first."""
    s = socket.create_server(("127.0.0.1", 0))
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


@pytest.mark.timeout(60)
def test_the_daemon_says_ready_when_someone_else_holds_both_ports(tmp_path, monkeypatch, capsys):
    """Review L2: a local user who binds the metrics port first must not crash-loop the daemon."""
    from reconciler.controller.daemon import Daemon
    pygit2.init_repository(str(tmp_path / "repo.git"), bare=True)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)

    async def main(metrics: int, web: int) -> str:
        cfg = ControllerConfig(repo=str(tmp_path / "repo.git"), state_dir=str(tmp_path / "state"),
                               metrics=f"127.0.0.1:{metrics}", web=f"127.0.0.1:{web}")
        d = Daemon(cfg, interval=60)
        serving = asyncio.create_task(d.serve())
        loop = asyncio.get_running_loop()
        try:
            ready = (await asyncio.wait_for(loop.sock_recv(notify, 4096), 30)).decode()
        finally:
            d.stopping.set()
            await asyncio.wait_for(serving, 30)
        return ready

    with squatter() as metrics, squatter() as web:
        ready = asyncio.run(main(metrics, web))
    notify.close()
    out = capsys.readouterr().out
    assert ready.startswith("READY=1")
    assert f"metrics off: cannot listen on 127.0.0.1:{metrics}: Address already in use" in out
    assert f"fleet page off: cannot listen on 127.0.0.1:{web}: Address already in use" in out
