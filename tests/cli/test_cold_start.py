"""A `reconcile` or hook process imports only what it uses (no start-up tricks: nothing patched,
nothing forked, nothing run from a cache; the standard way, imports where they are used).

The SSH stack (asyncssh and its crypto) loads only when a run connects, the daemon's web and
metrics stack only in `reconcile watch`, rich only on a terminal, tomlkit only to word a TOML
syntax error. Measured in a fresh interpreter each time; figures live in bench/compare.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.errors import ConfigError
from tests.conftest import DesiredRepo

ROOT = Path(__file__).resolve().parents[2]

# What --help, parsing the arguments or the hooks must not pay for at import.
HEAVY = ("asyncssh", "cryptography", "starlette", "uvicorn", "prometheus_client", "httpx", "apscheduler",
         "watchfiles", "pydantic", "pygit2", "tomlkit", "rich", "sqlite3", "pyrage", "typer")
OURS = ("reconciler.desired.load", "reconciler.desired.schema", "reconciler.loop.fleet", "reconciler.loop.host_run",
        "reconciler.loop.checks", "reconciler.loop.preflight", "reconciler.loop.gpu_gate",
        "reconciler.preflight._rules", "reconciler.controller.daemon", "reconciler.host.transport",
        "reconciler.host.probe")


def loaded(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules (and their packages) in sys.modules after `code` ran in a fresh interpreter."""
    probe = (f"{code}\nimport json, sys\n"
             "print('@@' + json.dumps(sorted(sys.modules)), file=sys.stderr)")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, **(env or {})})
    line = next(x for x in res.stderr.splitlines() if x.startswith("@@"))
    return set(json.loads(line[2:]))


def printed(code: str) -> str:
    """What `code` prints in a fresh interpreter (it must exit 0)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          check=True).stdout


def heavy(mods: set[str], names: tuple[str, ...] = HEAVY) -> list[str]:
    return sorted(n for n in names if n in mods)


def test_importing_the_cli_loads_no_ssh_web_schema_or_ui():
    mods = loaded("import reconciler.cli")
    assert heavy(mods) == []
    assert heavy(mods, OURS) == []


def test_the_hooks_entry_point_is_lighter_still():
    mods = loaded("import reconciler.controller.hooks")
    assert heavy(mods) == []
    assert "click" not in mods
    assert heavy(mods, OURS) == []


def test_help_and_argument_parsing_need_no_pydantic():
    # --help needs nothing of the loader, the schema, the SSH stack or rich.
    mods = loaded("import sys\nsys.argv = ['reconcile', '--help']\nfrom reconciler.cli import app\n"
                  "try:\n    app()\nexcept SystemExit:\n    pass")
    assert heavy(mods) == []
    # Parsing every option of a run (it then fails at once: no such repo) loads no pydantic.
    mods = loaded("import sys\nsys.argv = ['reconcile', '--repo', '/nonexistent', '--concurrency', '3', "
                  "'--lock-wait', '0.5', '-H', 'a', '--cache-dir', '/tmp/x', '--dry-run']\n"
                  "from reconciler.cli import app\ntry:\n    app()\nexcept SystemExit:\n    pass")
    assert "pydantic" not in mods


def test_nothing_in_the_package_patches_the_runtime():
    """No start-up tricks (issue 33): no sys.modules surgery, no find_library, no module's exec
    replaced, no fork to hide an import."""
    import re
    pattern = re.compile(r"sys\.modules\[|find_library|dataclasses\.exec|os\.fork")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "reconciler").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICAdCaxAZ4iUdq6+pd5a/yu2sIc3kEhzg+RQQqCtivEF"


def write_host(repo: DesiredRepo, env: str) -> None:
    repo.write("fleet/hosts/h1.toml", f'address = "127.0.0.5"\nssh = {{ host_key = "{KEY}" }}\n'
                                      f'[services.s]\nunit_file = "units/s.service"\nenv = {{ A = "{env}" }}\n')


def small_repo(path: Path, env: str = "1") -> DesiredRepo:
    """A desired state under fleet/ (the --path), one host, one service."""
    repo = DesiredRepo(path)
    repo.write("fleet/fleet.toml", '[ssh]\nuser = "root"\n')
    repo.write("fleet/units/s.service", "[Service]\nExecStart=/bin/true\n")
    write_host(repo, env)
    return repo


def test_a_run_written_to_a_pipe_never_imports_rich(tmp_path):
    # h1's address answers nothing (nothing listens on 127.0.0.5:22 here): the run reports it
    # Unreachable in the result table, written as plain text; rich is for terminals only.
    repo = small_repo(tmp_path / "desired")
    repo.commit()
    code = ("import sys\nfrom reconciler import cli\n"
            f"sys.argv = ['reconcile', '--repo', {str(repo.path)!r}, '--path', 'fleet', '--dry-run']\n"
            "try:\n    cli.main()\nexcept SystemExit as e:\n    print('EXIT', e.code)")
    env = {"RECONCILER_CACHE_DIR": str(tmp_path / "cache"), "RECONCILER_STATE_DIR": str(tmp_path / "state"),
           "COLUMNS": "120"}
    mods = loaded(code, env)
    assert "rich" not in mods and "reconciler.loop.report" in mods
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, **env}).stdout
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("revision "))
    assert lines[head].endswith("(dry run: nothing changed)")
    assert lines[head + 1].split() == ["host", "address", "result", "detail", "time"]
    assert set(lines[head + 2].replace(" ", "")) == {"-"}
    row = lines[head + 3].split()
    assert row[:3] == ["h1", "127.0.0.5", "failed"] and row[3] == "Unreachable:" and row[-1].endswith("s")
    assert "EXIT 4" in out and "[Errno 111]" in out       # text in brackets as it is; no markup left
    assert not any(tag in out for tag in ("[/]", "[bold", "[red", "[green", "[yellow"))


@pytest.mark.parametrize("text", ["plain", "[bold]x[/]", "a [b] c", "path\\", "x\\[y]", "\\\\[bold]z", "[/]",
                                  "list[0]", "a[b=c]d", "[@click]x", "ends\\\\", "[", "]", "\\[ ] a]/b[]"])
def test_plain_markup_matches_rich(text):
    # The plain console writes what rich would (its markup rules, without the import).
    from rich.markup import escape, render

    from reconciler.loop.report import escape_markup, strip_markup
    assert escape_markup(text) == escape(text)
    for markup in (escape(text), f"[bold]{escape(text)}[/]"):
        assert strip_markup(markup) == render(markup, emoji=False).plain
    with contextlib.suppress(Exception):       # not all texts are valid markup for rich
        assert strip_markup(text) == render(text, emoji=False).plain


def test_the_run_never_formats_its_result_on_the_way_out() -> None:
    """asyncio.run puts SIGINT's default handler back at the end, and the signal module formats
    the handler it replaces, which holds the main task and so the run's result: a whole fleet's
    result printed with repr, twice, for nothing. run_async keeps the result out of the task."""
    import asyncio

    from reconciler.cli.output import run_async

    formatted: list[str] = []

    class Result:
        def __repr__(self) -> str:
            formatted.append("repr")
            return "Result()"

    async def run() -> Result:
        await asyncio.sleep(0)
        return Result()

    # asyncio.run swaps SIGINT's handler only when it is Python's default: what a CLI process
    # has, but not always a test worker (an earlier test or xdist may have set another)
    import signal
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        got = run_async(run())
        assert isinstance(got, Result) and formatted == []
        asyncio.run(run())              # what run_async avoids
        assert formatted
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_new_revision_is_parsed_without_tomlkit_which_still_words_a_syntax_error(tmp_path):
    """The standard library parses every file of a new revision (tomlkit takes ten times as
    long, and as long again to import); tomlkit is imported only to word a file that does not
    parse, with its line, column and key."""
    repo = small_repo(tmp_path / "desired")
    rev = repo.commit()
    code = (f"from reconciler.desired import load, source\n"
            f"state = load.load_desired(source.snapshot(source.open_repo({str(repo.path)!r}), {rev!r}, 'fleet'))\n"
            f"assert state.hosts['h1'].services['s'].env == {{'A': '1'}}\n")
    mods = loaded(code)
    assert "reconciler.desired.load" in mods and heavy(mods, ("tomlkit",)) == []
    from reconciler.desired.load import MemorySnapshot, load_desired
    with pytest.raises(ConfigError) as e:
        load_desired(MemorySnapshot({"fleet.toml": "concurrency = 1\nconcurrency = 2\n"}))
    said = [(p.file, p.message) for p in e.value.problems]
    assert ("fleet.toml", 'TOML syntax error at line 2, column 0: Key "concurrency" already exists.') in said, said


def test_a_run_imports_no_pydantic_and_a_tree_loaded_before_no_loader(tmp_path):
    """What a run imports to plan and apply (the fleet run, the pre-flight checks and their
    rule pack, the records) and a tree, new or read back from the cache, load no pydantic: the
    loader's and the rule pack's tables are tables.py's. A tree loaded before skips the loader
    itself, and a run that reads no rule file the rule schema (the checks' types only in
    annotations)."""
    repo = small_repo(tmp_path / "desired")
    rev = repo.commit()
    cache_dir = tmp_path / "cache"
    load = (f"from reconciler.desired import cache, source\n"
            f"snap = source.snapshot(source.open_repo({str(repo.path)!r}), {rev!r}, 'fleet')\n"
            f"state = cache.load_desired(snap, __import__('pathlib').Path({str(cache_dir)!r}))\n")
    miss = loaded(load)                                        # a miss: the loader, then kept
    assert "reconciler.desired.load" in miss and heavy(miss, ("pydantic",)) == []
    rules = loaded("from reconciler.preflight import load_rules\nassert load_rules().rules\n")
    assert "reconciler.preflight._schema" in rules and heavy(rules, ("pydantic",)) == []
    mods = loaded("import reconciler.loop.fleet, reconciler.loop.checks, reconciler.host.versions\n"
                  "import reconciler.preflight, reconciler.plan.records\n" + load
                  + "assert state.hosts['h1'].services['s'].env == {'A': '1'}\n")
    assert "reconciler.preflight._rules" in mods and "msgspec" in mods
    assert heavy(mods, ("pydantic", "reconciler.preflight._schema", "reconciler.desired.load")) == []
