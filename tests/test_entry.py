"""The plain run's own argument parser (reconciler/entry.py): the same options, environment
variables, defaults and values as the typer command it stands in for, and typer's for anything
else (issue 15: a run's start without typer)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command

from reconciler import cli, entry

from .test_cold_start import loaded

ENVS = ("RECONCILER_REPO", "RECONCILER_PATH", "RECONCILER_IDENTITY", "RECONCILER_AGE_IDENTITY",
        "RECONCILER_CACHE_DIR", "RECONCILER_STATE_DIR")


def test_the_table_is_the_typer_commands_options():
    cmd = get_command(cli.app)
    seen: set[str] = set()
    for p in cmd.params:
        if not p.opts[0].startswith("-") or p.name == "help":
            continue
        for opt in [*p.opts, *p.secondary_opts]:
            assert opt in entry.OPTIONS, f"{opt} is not in entry.OPTIONS"
            param, kind, env = entry.OPTIONS[opt]
            assert param == p.name, opt
            assert env == p.envvar, opt
            assert (kind == "flag") == bool(getattr(p, "is_flag", False)), opt
            assert (kind == "list") == p.multiple, opt
            seen.add(opt)
        assert entry.DEFAULTS[p.name] == (None if p.multiple else p.default), p.name
    assert seen == set(entry.OPTIONS)


def typer_kwargs(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, Any]:
    """What the typer command hands to converge() for these arguments."""
    got: dict[str, Any] = {}

    def capture(**kw: Any) -> None:
        got.update(kw)
        raise SystemExit(0)
    monkeypatch.setattr(cli, "converge", capture)
    with pytest.raises(SystemExit):
        cli.app(argv, standalone_mode=True)
    return got


@pytest.mark.parametrize("argv", [
    [],
    ["--repo", "/srv/desired", "--concurrency", "3"],
    ["--repo=/srv/desired", "--rev", "abc123", "--path", "fleet", "-n", "--json"],
    ["-i", "/k", "-H", "a", "--host", "b", "-l", "gpu=h200", "--label=zone=a", "--retry", "--allow-rewind"],
    ["--lock-wait", "0.5", "--age-identity", "/age", "--cache-dir", "/c", "--state-dir", "/s", "--notes"],
    ["--concurrency", "2", "--concurrency", "5", "--dry-run"],
])
def test_both_parsers_give_the_same_run(monkeypatch, argv):
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    want = typer_kwargs(monkeypatch, argv)
    assert entry.parse(argv, {}) == want


def test_environment_variables_and_an_empty_one_as_typer_reads_them(monkeypatch):
    env = {"RECONCILER_REPO": "/env/repo", "RECONCILER_IDENTITY": "/env/key", "RECONCILER_CACHE_DIR": "/env/c",
           "RECONCILER_PATH": "", "RECONCILER_STATE_DIR": "/env/s"}
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = ["--repo", "/given"]
    want = typer_kwargs(monkeypatch, argv)
    got = entry.parse(argv, env)
    assert got == want
    assert got is not None and got["repo"] == "/given" and got["identity"] == "/env/key"
    assert got["cache_dir"] == Path("/env/c") and got["path"] == ""


@pytest.mark.parametrize("argv", [
    ["status"], ["--help"], ["--repo", "x", "validate"], ["--bogus"], ["--concurrency", "0"], ["--concurrency", "x"],
    ["--lock-wait", "-1"], ["--repo"], ["-nH", "a"], ["--dry-run=yes"], ["--", "x"], ["--rev", "--json"],
])
def test_anything_else_goes_to_typer(argv):
    assert entry.parse(argv, {}) is None


def test_a_plain_run_never_imports_typer():
    mods = loaded("import sys\nsys.argv = ['reconcile', '--repo', '/nonexistent', '--concurrency', '3', '-n']\n"
                  "from reconciler.entry import main\ntry:\n    main()\nexcept SystemExit:\n    pass")
    assert "typer" not in mods and "click" not in mods
    # and anything else still reaches typer (here: its usage error)
    mods = loaded("import sys\nsys.argv = ['reconcile', '--concurrency', '0']\n"
                  "from reconciler.entry import main\ntry:\n    main()\nexcept SystemExit:\n    pass")
    assert "typer" in mods


@pytest.mark.parametrize("body,code,out,err", [
    # a run's own exit status, its output flushed, the atexit handlers run
    ("sys.argv = ['reconcile', '--repo', '/nonexistent', '-n']\nprint('before', end='')\nentry.console()",
     1, "beforeatexit ran\n", "not a git repository"),
    ("entry.leave(None)", 0, "atexit ran\n", ""),
    ("entry.leave(3)", 3, "atexit ran\n", ""),
    ("entry.leave('no such thing')", 1, "atexit ran\n", "no such thing"),
    # another thread still runs: the ordinary exit, which waits for it
    ("import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
     "entry.leave(5)", 5, "thread done\natexit ran\n", ""),
])
def test_leave_exits_with_the_status_after_the_handlers_and_flushed_output(body, code, out, err):
    import subprocess
    import sys
    prog = f"import atexit, sys\nfrom reconciler import entry\natexit.register(lambda: print('atexit ran'))\n{body}\n"
    res = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "RECONCILER_CACHE_DIR": "/nonexistent/cache"})
    assert (res.returncode, res.stdout) == (code, out), res.stderr
    assert err in res.stderr
