"""The trust variables (RECONCILER_REQUIRE_SIGNED, _ALLOWED_SIGNERS, _ALLOW_INSECURE_TRANSPORT) make
the policy stricter, never looser, and one that would not take effect is an error (issue 39 item
5, review M6 residual): a table of the pure rule, then every door that reads them: the config
(daemon, hooks, a root run), `reconcile` as any user, `reconcile pull`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.controller import trustvars
from reconciler.controller.config import ControllerConfig, load_config
from reconciler.controller.trustvars import INSECURE, REQUIRE, SIGNERS, TrustVars
from reconciler.errors import ConfigError
from tests import signing
from tests.conftest import ROOT, DesiredRepo

F = "/etc/reconciler/config.toml"
NOW = "an environment variable may make the trust policy stricter, never looser"
UNUSED = ("names a signers file, but nothing requires signed revisions, so it would verify nothing: set "
          "RECONCILER_REQUIRE_SIGNED=true (or pass --require-signed), or unset it")


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    for key in ControllerConfig.model_fields:
        monkeypatch.delenv(f"RECONCILER_{key.upper()}", raising=False)


def test_reading_the_variables():
    assert trustvars.read({REQUIRE: "Yes", SIGNERS: "/s", INSECURE: "0"}) == (TrustVars(True, "/s", False), [])
    assert trustvars.read({REQUIRE: "", SIGNERS: ""}) == (TrustVars(), [])
    got, bad = trustvars.read({REQUIRE: "sure", INSECURE: "maybe"})
    assert got == TrustVars() and [(p.file, p.key, p.message) for p in bad] == [
        ("environment", REQUIRE, "expected true or false"), ("environment", INSECURE, "expected true or false")]


SIGNED_FILE = TrustVars(True, "/etc/reconciler/allowed_signers", False)
PLAIN_FILE = TrustVars(False, None, False)


@pytest.mark.parametrize(("env", "flags", "file", "expected"), [
    # nothing said, or only stricter things: no problem
    (TrustVars(), TrustVars(), None, []),
    (TrustVars(True), TrustVars(), None, []),
    (TrustVars(True), TrustVars(), PLAIN_FILE, []),
    (TrustVars(True, "/s"), TrustVars(), PLAIN_FILE, []),
    (TrustVars(False), TrustVars(), PLAIN_FILE, []),                      # says what the file says
    (TrustVars(None, None, False), TrustVars(), SIGNED_FILE, []),
    (TrustVars(None, None, True), TrustVars(), None, []),                 # no file: as the flag
    (TrustVars(None, None, True), TrustVars(), TrustVars(False, None, True), []),
    (TrustVars(True, "/etc/reconciler/allowed_signers"), TrustVars(), SIGNED_FILE, []),
    (TrustVars(None, "/etc/reconciler/allowed_signers"), TrustVars(), TrustVars(True), []),   # the default file
    (TrustVars(None, "/s"), TrustVars(True), None, []),
    (TrustVars(None, "/s"), TrustVars(True, "/s"), None, []),
    # looser than the file or the flags: refused
    (TrustVars(False), TrustVars(), SIGNED_FILE,
     [(REQUIRE, f"asks for unsigned revisions, but {F} requires signed ones: {NOW} (unset it)")]),
    (TrustVars(False), TrustVars(True), None,
     [(REQUIRE, f"asks for unsigned revisions, but --require-signed requires signed ones: {NOW} (unset it)")]),
    (TrustVars(False), TrustVars(True, "/s"), None,
     [(REQUIRE, f"asks for unsigned revisions, but --allowed-signers requires signed ones: {NOW} (unset it)")]),
    (TrustVars(None, None, True), TrustVars(), PLAIN_FILE,
     [(INSECURE, f"allows fetching over http:// and git://, but {F} does not: {NOW} (set allow_insecure_transport = "
                 f"true in the file if that is meant, or unset it)")]),
    # who may deploy: not changed by the environment, and not set where nothing verifies
    (TrustVars(None, "/home/u/mine"), TrustVars(), SIGNED_FILE,
     [(SIGNERS, f"names another signers file than the /etc/reconciler/allowed_signers that {F} requires: the "
                f"environment may not change who may deploy (unset it, or change allowed_signers in the file)")]),
    (TrustVars(True, "/home/u/mine"), TrustVars(), SIGNED_FILE,
     [(SIGNERS, f"names another signers file than the /etc/reconciler/allowed_signers that {F} requires: the "
                f"environment may not change who may deploy (unset it, or change allowed_signers in the file)")]),
    (TrustVars(None, "/s"), TrustVars(), None, [(SIGNERS, UNUSED)]),
    (TrustVars(None, "/s"), TrustVars(), PLAIN_FILE, [(SIGNERS, UNUSED)]),
    (TrustVars(False, "/s"), TrustVars(), None, [(SIGNERS, UNUSED)]),
    (TrustVars(True, "/s"), TrustVars(True, "/t"), None,
     [(SIGNERS, "names another signers file than --allowed-signers: choose one")]),
])
def test_the_rule(env, flags, file, expected):
    got = trustvars.problems(env, flags=flags, file=file, file_name=F)
    assert [(p.key, p.message) for p in got] == expected
    assert all(p.file == "environment" for p in got)


def test_what_a_file_says_defaults_included():
    assert trustvars.of_file({}) == TrustVars(False, None, False)
    assert trustvars.of_file({"require_signed": "yes", "allowed_signers": "/s", "allow_insecure_transport": True}) \
        == TrustVars(True, "/s", True)


# ---- the config: the daemon, the hooks, a root run -----------------------------------------------


def config(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text)
    return p


def test_the_config_refuses_a_variable_that_loosens_it(tmp_path, monkeypatch):
    p = config(tmp_path, 'require_signed = true\nallowed_signers = "/etc/reconciler/allowed_signers"\n')
    monkeypatch.setenv(REQUIRE, "false")
    monkeypatch.setenv(SIGNERS, str(tmp_path / "mine"))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert [(x.file, x.key) for x in e.value.problems] == [("environment", REQUIRE), ("environment", SIGNERS)]
    monkeypatch.delenv(REQUIRE)
    monkeypatch.delenv(SIGNERS)
    monkeypatch.setenv(INSECURE, "true")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert [(x.file, x.key) for x in e.value.problems] == [("environment", INSECURE)]


def test_the_config_takes_a_variable_that_tightens_it(tmp_path, monkeypatch):
    p = config(tmp_path, "allow_insecure_transport = true\n")
    monkeypatch.setenv(REQUIRE, "true")
    monkeypatch.setenv(SIGNERS, str(tmp_path / "signers"))
    monkeypatch.setenv(INSECURE, "false")
    policy = load_config(p).trust_policy()
    assert (policy.require_signed, policy.allowed_signers, policy.insecure_transport) == \
        (True, (str(tmp_path / "signers"),), False)
    # with no file at all, the variables are the whole config (a daemon set up by its unit's Environment=)
    monkeypatch.setenv(INSECURE, "true")
    assert load_config(tmp_path / "absent.toml").allow_insecure_transport is True


def test_a_signers_variable_nothing_requires_is_an_error_for_the_daemon_too(tmp_path, monkeypatch):
    monkeypatch.setenv(SIGNERS, str(tmp_path / "signers"))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "absent.toml")
    assert [(x.key, x.message) for x in e.value.problems] == [(SIGNERS, UNUSED)]


# ---- reconcile, as any user ------------------------------------------------------------------------

HOST = 'address = "127.0.0.9"\n[services.m]\nunit_file = "units/m.service"\n'


def reconcile(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in trustvars.NAMES}
    return subprocess.run([sys.executable, "-m", "reconciler", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**base, "NO_COLOR": "1", "COLUMNS": "400", **env})


@pytest.fixture
def unsigned(tmp_path: Path) -> tuple[DesiredRepo, Path]:
    r = DesiredRepo(tmp_path / "r")
    r.write("fleet.toml", "")
    r.write("units/m.service", "[Service]\nExecStart=/usr/bin/server\n")
    r.write("hosts/a.toml", HOST)
    signing.commit(r.path, "unsigned")
    return r, signing.allowed_signers(tmp_path / "allowed_signers", signing.keypair(tmp_path))


@pytest.mark.parametrize("json_out", [False, True])
def test_require_signed_in_the_environment_refuses_a_dry_run_of_an_unsigned_commit_with_no_config(
        unsigned, tmp_path, json_out):
    """The issue's case: it used to let the dry run through (exit 2 against a live host, 4 here)
    with no word of the variable."""
    r, signers = unsigned
    env = {"RECONCILER_CONFIG": str(tmp_path / "absent.toml"), REQUIRE: "true", SIGNERS: str(signers)}
    res = reconcile("--repo", str(r.path), "--dry-run", *(["--json"] if json_out else []), env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    if json_out:
        assert json.loads(res.stdout)["reason"] == "Unsigned"
    else:
        assert "refused (Unsigned): commit" in res.stderr
    assert "127.0.0.9" not in res.stdout + res.stderr
    # the default signers file when the variable names none (as --require-signed)
    res = reconcile("--repo", str(r.path), "--dry-run", env={**env, SIGNERS: ""})
    assert res.returncode == 1 and "refused (Unsigned)" in res.stderr, res.stderr


def test_a_signers_variable_alone_is_an_error_not_a_silent_pass(unsigned, tmp_path):
    r, signers = unsigned
    res = reconcile("--repo", str(r.path), "--dry-run", env={"RECONCILER_CONFIG": str(tmp_path / "absent.toml"),
                                                             SIGNERS: str(signers)})
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.strip() == f"error: environment: {SIGNERS}: {UNUSED}"


def test_as_root_a_variable_cannot_loosen_the_controllers_config(unsigned, tmp_path):
    r, signers = unsigned
    cfg = config(tmp_path, f'require_signed = true\nallowed_signers = "{signers}"\n')
    env = {"RECONCILER_CONFIG": str(cfg), REQUIRE: "false"}
    res = reconcile("--repo", str(r.path), "--dry-run", env=env)
    assert res.returncode == 1
    assert res.stderr.strip() == (f"error: environment: {REQUIRE}: asks for unsigned revisions, but {cfg} (a run as "
                                  f"root) requires signed ones: {NOW} (unset it)")
    res = reconcile("--repo", str(r.path), "--dry-run", "--json", env={"RECONCILER_CONFIG": str(cfg),
                                                                       SIGNERS: str(tmp_path / "mine")})
    out = json.loads(res.stdout)
    assert res.returncode == 1 and out["error"] == "ConfigError" and \
        [p["key"] for p in out["problems"]] == [SIGNERS]
    # what the config asks is what happens (the variable says the same)
    res = reconcile("--repo", str(r.path), "--dry-run", env={"RECONCILER_CONFIG": str(cfg), REQUIRE: "true"})
    assert res.returncode == 1 and "refused (Unsigned)" in res.stderr, res.stderr


def test_the_trust_policy_function_reads_the_given_environment(tmp_path, monkeypatch):
    from reconciler.cli.run import trust_policy
    monkeypatch.setenv("RECONCILER_CONFIG", str(tmp_path / "absent.toml"))
    p = trust_policy(False, None, False, euid=1000, env={REQUIRE: "1", SIGNERS: str(tmp_path / "s")})
    assert (p.require_signed, p.allowed_signers) == (True, (str(tmp_path / "s"),))
    assert p.origin == f"{SIGNERS} and {REQUIRE}"
    assert trust_policy(False, None, False, euid=1000, env={INSECURE: "yes"}).insecure_transport is True
    assert trust_policy(False, None, False, euid=1000, env={}).require_signed is False


# ---- reconcile pull ---------------------------------------------------------------------------------


def pull(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return reconcile("pull", "--repo", "/nonexistent", "--host", "a", *args, env=env)


def test_pull_refuses_a_variable_that_contradicts_its_flags(tmp_path):
    res = pull("--allow-unsigned", env={REQUIRE: "true"})
    assert res.returncode == 1 and res.stderr.strip() == (
        f"error: environment: {REQUIRE}: requires signed revisions, but --allow-unsigned accepts unsigned ones: "
        f"choose one")
    res = pull("--allowed-signers", str(tmp_path / "a"), env={REQUIRE: "true", SIGNERS: str(tmp_path / "b")})
    assert res.returncode == 1 and res.stderr.strip() == \
        f"error: environment: {SIGNERS}: names another signers file than --allowed-signers: choose one"
    res = pull("--allowed-signers", str(tmp_path / "a"), env={REQUIRE: "false"})
    assert res.returncode == 1 and "asks for unsigned revisions, but --allowed-signers requires" in res.stderr
    res = pull("--allow-unsigned", env={SIGNERS: str(tmp_path / "a")})
    assert res.returncode == 1 and res.stderr.strip() == f"error: environment: {SIGNERS}: {UNUSED}"


def test_pull_takes_the_variables_as_its_flags(tmp_path):
    from reconciler.cli.pull import _trust
    t = _trust(None, False, False, env={REQUIRE: "true", SIGNERS: str(tmp_path / "s")})
    assert (t.require_signed, t.allowed_signers) == (True, (str(tmp_path / "s"),))
    res = pull(env={REQUIRE: "true"})                    # no file named anywhere: as with no flag at all
    assert res.returncode == 1 and "--allowed-signers FILE is required" in res.stderr
