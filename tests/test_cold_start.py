"""Cold start (issue 15): a `reconcile` or hook process imports only what it uses.

Every run and every git push pays for what is imported before the first line of work: the SSH
stack (asyncssh and its crypto) only when connecting, the daemon's web and metrics stack only in
`reconcile watch`, pydantic and the loader only for a revision not loaded before (loadcache.py),
typer's arguments without pydantic (coercion.py). Measured in a fresh interpreter each time;
figures live in bench/compare.py, not here.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer import _coercion
from typer._click.exceptions import BadParameter
from typer.models import ArgumentInfo, OptionInfo

from reconciler import coercion, loadcache, source
from reconciler.errors import ConfigError

from .conftest import DesiredRepo

ROOT = Path(__file__).resolve().parent.parent

# What a run, the hooks or --help must not pay for at import.
HEAVY = ("asyncssh", "cryptography", "starlette", "uvicorn", "prometheus_client", "httpx", "apscheduler",
         "watchfiles", "pydantic", "pygit2", "tomlkit", "rich", "sqlite3", "pyrage")
OURS = ("reconciler.load", "reconciler.schema", "reconciler.fleet", "reconciler.reconcile", "reconciler.gate",
        "reconciler.preflight._rules", "reconciler.daemon", "reconciler.transport", "reconciler.probe")


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


# Appended to a probe: prints NO CHILD LEFT where the process has no child, waited for or not.
NO_CHILD = "import os\ntry:\n    os.waitpid(-1, os.WNOHANG)\nexcept ChildProcessError:\n    print('NO CHILD LEFT')\n"


def heavy(mods: set[str], names: tuple[str, ...] = HEAVY) -> list[str]:
    return sorted(n for n in names if n in mods)


def test_importing_the_cli_loads_no_ssh_web_schema_or_ui():
    mods = loaded("import reconciler.cli")
    assert heavy(mods) == []
    assert heavy(mods, OURS) == []


def test_a_run_imports_no_toml_parser_to_judge_secrets():
    # What every run does before it connects (clicore.converge: the secret warnings, the run's
    # modules) parses no TOML: the parser is imported where a secret-looking value is traced.
    mods = loaded("from reconciler import clicore\nclicore._run_imports()\n"
                  "from reconciler.preflight import secret_warnings  # noqa: F401")
    assert heavy(mods, ("tomllib", "tomlkit", "pydantic", "pygit2", "reconciler.load")) == []


def test_a_deploy_judges_plain_rules_without_a_toml_parser_or_packaging():
    # The rule pack comes compiled from the load (reconciler/loadcache.py): judging it against a
    # plain server version parses no TOML and compiles none of packaging's specifiers.
    mods = loaded("from reconciler import clicore\nclicore._run_imports()\nclicore._deploy_imports()\n"
                  "from reconciler.preflight._compiled import Rule\n"
                  "assert Rule(id='r', server='sglang', message='', fix='', source='',\n"
                  "            versions='>=0.5.10,<0.5.14').covers('0.5.12')")
    assert heavy(mods, ("tomllib", "importlib.resources", "packaging.specifiers", "packaging.version")) == []


def test_the_hooks_entry_point_is_lighter_still():
    mods = loaded("import reconciler.hooks")
    assert heavy(mods) == []
    assert "typer" not in mods
    assert heavy(mods, OURS) == []


def test_help_and_argument_parsing_need_no_pydantic():
    # --help lays out with rich; it needs nothing of the loader, the schema or the SSH stack.
    mods = loaded("import sys\nsys.argv = ['reconcile', '--help']\nfrom reconciler.cli import app\n"
                  "try:\n    app()\nexcept SystemExit:\n    pass")
    assert heavy(mods, ("asyncssh", "pydantic", "pygit2", "tomlkit", "starlette", "httpx")) == []
    # Parsing every option of a run (the callback then fails at once: no such repo) loads no pydantic.
    mods = loaded("import sys\nsys.argv = ['reconcile', '--repo', '/nonexistent', '--concurrency', '3', "
                  "'--lock-wait', '0.5', '-H', 'a', '--cache-dir', '/tmp/x', '--dry-run']\n"
                  "from reconciler.cli import app\ntry:\n    app()\nexcept SystemExit:\n    pass")
    assert "pydantic" not in mods


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


def test_a_revision_loaded_before_is_read_back_without_the_loader(tmp_path):
    repo = small_repo(tmp_path / "desired")
    first = repo.commit()
    repo.write("README", "a commit that leaves fleet/ as it is")
    second = repo.commit()
    cache = tmp_path / "cache"
    snap = source.snapshot(source.open_repo(str(repo.path)), first, "fleet")
    state = loadcache.load(snap, cache)
    assert state.revision == first and state.hosts["h1"].services["s"].env == {"A": "1"}
    entries = list((cache / "desired").glob("*.pickle"))
    assert len(entries) == 1 and entries[0].stat().st_mode & 0o777 == 0o600
    assert (cache / "desired").stat().st_mode & 0o777 == 0o700

    # A fresh process reads it back without the loader, tomlkit or pydantic; the next commit,
    # which leaves fleet/ as it is, hits the same entry (content-addressed) with its own revision.
    code = (f"from pathlib import Path\nfrom reconciler import loadcache, source\n"
            f"snap = source.snapshot(source.open_repo({str(repo.path)!r}), {second!r}, 'fleet')\n"
            f"state = loadcache.load(snap, Path({str(cache)!r}))\n"
            f"assert state.revision == {second!r}, state.revision\n"
            f"assert state.hosts['h1'].services['s'].env == {{'A': '1'}}\n"
            f"import sys\n"
            f"assert 'reconciler.preflight._rules' not in sys.modules    # a run that starts nothing\n"
            f"rules = loadcache.rules(snap)       # what pre-flight asks for: the kept rule pack\n"
            f"print('RULES', ' '.join(r.id for r in rules.rules), len(rules.models))")
    mods = loaded(code)
    assert heavy(mods, ("pydantic", "tomlkit", "reconciler.load", "reconciler.schema")) == []
    assert len(list((cache / "desired").glob("*.pickle"))) == 1
    from reconciler.preflight import load_rules
    fresh = load_rules(snap)
    kept = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                          timeout=60).stdout
    assert f"RULES {' '.join(r.id for r in fresh.rules)} {len(fresh.models)}" in kept and fresh.rules

    # What the cache gives back is what a load from scratch gives.
    from reconciler.load import load_desired
    assert loadcache.load(snap, cache) == load_desired(snap)


def test_a_changed_revision_or_a_foreign_entry_loads_afresh(tmp_path):
    repo = small_repo(tmp_path / "desired")
    one = repo.commit()
    write_host(repo, "2")
    two = repo.commit()
    cache = tmp_path / "cache"
    r = source.open_repo(str(repo.path))
    assert loadcache.load(source.snapshot(r, one, "fleet"), cache).hosts["h1"].services["s"].env == {"A": "1"}
    assert loadcache.load(source.snapshot(r, two, "fleet"), cache).hosts["h1"].services["s"].env == {"A": "2"}
    # An entry that someone else could have written is never unpickled: loaded afresh instead.
    for p in (cache / "desired").glob("*.pickle"):
        p.write_bytes(b"not a pickle")
        p.chmod(0o666)
    assert loadcache.load(source.snapshot(r, one, "fleet"), cache).hosts["h1"].services["s"].env == {"A": "1"}


def test_a_bad_repo_rule_file_fails_the_load_and_is_never_cached(tmp_path):
    repo = small_repo(tmp_path / "desired")
    repo.write("fleet/rules/site.toml", "[[rule]]\nid = 'Not An Id'\n")
    rev = repo.commit()
    cache = tmp_path / "cache"
    snap = source.snapshot(source.open_repo(str(repo.path)), rev, "fleet")
    with pytest.raises(ConfigError) as e:
        loadcache.load(snap, cache)
    assert any(p.file == "rules/site.toml" for p in e.value.problems)
    assert not list((cache / "desired").glob("*.pickle"))


# ---- typer's coercion without pydantic: the same values and messages as typer's own -------------

def _coerce(build, annotation, info, value):
    param = SimpleNamespace(multiple=isinstance(value, tuple), nargs=1, name="p", human_readable_name="--p")
    rt = build(_coercion.resolve_type_descriptor(annotation, info))
    try:
        return "ok", rt.coerce(value, param=param, ctx=None)
    except BadParameter as e:
        return "bad", e.message


@pytest.mark.parametrize("annotation,info,value", [
    (str, OptionInfo(), "x"), (str, OptionInfo(), ""), (str | None, OptionInfo(), None),
    (int, OptionInfo(min=1), "3"), (int, OptionInfo(min=1), "0"), (int, OptionInfo(min=1), "x"),
    (int, OptionInfo(min=1), "2.5"), (int, OptionInfo(), 50), (int | None, OptionInfo(min=1), None),
    (float, OptionInfo(min=0), "0.5"), (float, OptionInfo(min=0), "-1"), (float, OptionInfo(min=0), "1e"),
    (float, OptionInfo(min=0), 30.0), (float, OptionInfo(max=10), "11"),
    (Path, OptionInfo(), "/tmp/x"), (Path | None, OptionInfo(), None), (Path, ArgumentInfo(), "rel/p"),
    (list[str] | None, OptionInfo(), ("a", "b")), (list[str] | None, OptionInfo(), None),
    (bool, OptionInfo(), "true"), (bool, OptionInfo(), "no"),
])
def test_plain_coercion_matches_typer(annotation, info, value):
    ours = _coerce(coercion.plain_builder(_coercion.build_runtime_param), annotation, info, value)
    theirs = _coerce(_coercion.build_runtime_param, annotation, info, value)
    assert ours == theirs
    assert coercion.converter(annotation, info, lambda *a, **k: a[0]) is not None


def test_plain_coercion_leaves_other_types_to_typer():
    assert coercion.converter(int, OptionInfo(min=1, clamp=True)) is None
    assert coercion.converter(list[int], OptionInfo()) is None
    assert coercion.converter(dict, OptionInfo()) is None


def test_a_run_written_to_a_pipe_never_imports_rich(tmp_path):
    # h1's address answers nothing (nothing listens on 127.0.0.5:22 here): the run reports it
    # Unreachable in the result table, written as plain text; rich is for terminals only.
    repo = small_repo(tmp_path / "desired")
    repo.commit()
    code = ("import sys\nfrom reconciler import entry\n"
            f"sys.argv = ['reconcile', '--repo', {str(repo.path)!r}, '--path', 'fleet', '--dry-run']\n"
            "try:\n    entry.main()\nexcept SystemExit as e:\n    print('EXIT', e.code)")
    env = {"RECONCILER_CACHE_DIR": str(tmp_path / "cache"), "RECONCILER_STATE_DIR": str(tmp_path / "state"),
           "COLUMNS": "120"}
    mods = loaded(code, env)
    assert "rich" not in mods and "reconciler.report" in mods
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

    from reconciler.report import escape_markup, strip_markup
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

    from reconciler.clicore import run_async

    formatted: list[str] = []

    class Result:
        def __repr__(self) -> str:
            formatted.append("repr")
            return "Result()"

    async def run() -> Result:
        await asyncio.sleep(0)
        return Result()

    got = run_async(run())
    assert isinstance(got, Result) and formatted == []
    asyncio.run(run())              # what run_async avoids
    assert formatted


def test_a_new_revision_is_parsed_without_tomlkit_which_still_words_a_syntax_error(tmp_path):
    """The standard library parses every file of a new revision (tomlkit takes ten times as
    long, and as long again to import); tomlkit is imported only to word a file that does not
    parse, with its line, column and key."""
    repo = small_repo(tmp_path / "desired")
    rev = repo.commit()
    code = (f"from reconciler import load, source\n"
            f"state = load.load_desired(source.snapshot(source.open_repo({str(repo.path)!r}), {rev!r}, 'fleet'))\n"
            f"assert state.hosts['h1'].services['s'].env == {{'A': '1'}}\n")
    mods = loaded(code)
    assert "reconciler.load" in mods and heavy(mods, ("tomlkit",)) == []
    from reconciler.load import MemorySnapshot, load_desired
    with pytest.raises(ConfigError) as e:
        load_desired(MemorySnapshot({"fleet.toml": "concurrency = 1\nconcurrency = 2\n"}))
    said = [(p.file, p.message) for p in e.value.problems]
    assert ("fleet.toml", 'TOML syntax error at line 2, column 0: Key "concurrency" already exists.') in said, said


def test_a_new_commit_loads_in_a_child_beside_the_runs_imports(tmp_path):
    repo = small_repo(tmp_path / "desired")
    good = repo.commit()
    cache = tmp_path / "cache"
    # A fresh process, as a run: the commit was never loaded. The child loads and keeps it while
    # `meanwhile` runs here; this process reads the kept load and never imports the loader.
    code = (f"import os, sys\nfrom pathlib import Path\nfrom reconciler import clicore\n"
            f"ran = []\n"
            f"def meanwhile():\n    ran.append(os.getpid())\n"
            f"snap, state = clicore._load({str(repo.path)!r}, None, 'fleet', Path({str(cache)!r}), meanwhile)\n"
            f"assert ran == [os.getpid()], ran\n"
            f"assert state.revision == {good!r} and state.hosts['h1'].services['s'].env == {{'A': '1'}}\n"
            + NO_CHILD)
    mods = loaded(code)
    assert heavy(mods, ("pygit2", "pydantic", "reconciler.load", "reconciler.schema")) == []
    assert len(list((cache / "desired").glob("*.pickle"))) == 1
    assert "NO CHILD LEFT" in printed(code)
    from reconciler.load import load_desired
    snap = source.snapshot(source.open_repo(str(repo.path)), good, "fleet")
    assert loadcache.load(snap, cache) == load_desired(snap)

    # A bad commit: the child keeps nothing, and this process loads it itself, reporting its
    # problems as a run without the child does (meanwhile ran once all the same).
    repo.write("fleet/hosts/h1.toml", 'address = "127.0.0.5"\n[services.s]\nunit_file = 5\n')
    repo.commit()
    bad = (f"import os\nfrom pathlib import Path\nfrom reconciler import clicore\nfrom reconciler.errors import "
           f"ConfigError\nran = []\n"
           f"try:\n    clicore._load({str(repo.path)!r}, None, 'fleet', Path({str(cache)!r}), lambda: ran.append(1))\n"
           f"except ConfigError as e:\n    print('RAN', len(ran), [(p.file, p.key) for p in e.problems])\n")
    out = printed(bad)
    assert "RAN 1 [('hosts/h1.toml', 'services.s.unit_file')]" in out, out
    assert len(list((cache / "desired").glob("*.pickle"))) == 1

    # With a thread running (which a fork would not carry), nothing forks: meanwhile runs, and
    # this process loads the commit itself.
    write_host(repo, "2")
    two = repo.commit()
    threaded = (f"import os, sys, threading\nfrom pathlib import Path\nfrom reconciler import clicore\n"
                f"stop = threading.Event()\nthreading.Thread(target=stop.wait, daemon=True).start()\n"
                f"ran = []\n"
                f"snap, state = clicore._load({str(repo.path)!r}, None, 'fleet', Path({str(cache)!r}), "
                f"lambda: ran.append(1))\n"
                f"assert ran == [1] and state.revision == {two!r}, (ran, state.revision)\nstop.set()\n")
    assert "reconciler.load" in loaded(threaded)

    # meanwhile fails (an import error, Ctrl-C): it propagates, and the child is not left behind.
    write_host(repo, "3")
    repo.commit()
    fails = (f"import os\nfrom pathlib import Path\nfrom reconciler import clicore\n"
             f"def meanwhile():\n    raise KeyboardInterrupt\n"
             f"try:\n    clicore._load({str(repo.path)!r}, None, 'fleet', Path({str(cache)!r}), meanwhile)\n"
             f"except KeyboardInterrupt:\n    pass\n" + NO_CHILD)
    assert "NO CHILD LEFT" in printed(fails)


def test_spare_work_fills_only_a_wait_for_the_loading_child(tmp_path):
    repo = small_repo(tmp_path / "desired")
    cache = tmp_path / "cache"
    exited = ("import os, time\n"
              "def child_exited():    # every child of this process a zombie: exited, not yet reaped\n"
              "    kids = [k for t in os.listdir('/proc/self/task')\n"
              "            for k in open(f'/proc/self/task/{t}/children').read().split()]\n"
              "    return all(open(f'/proc/{k}/stat').read().rsplit(')', 1)[1].split()[0] == 'Z' for k in kids)\n"
              "def wait_child():\n    while not child_exited():\n        time.sleep(0.01)\n")

    def spared(meanwhile: str) -> str:
        write_host(repo, meanwhile)
        repo.commit()            # a commit not loaded before: its load goes to a child
        code = (f"{exited}from pathlib import Path\nfrom reconciler import clicore\nspared = []\n"
                f"snap, state = clicore._load({str(repo.path)!r}, None, 'fleet', Path({str(cache)!r}), "
                f"{meanwhile}, lambda: spared.append(1))\n"
                f"print('SPARED', len(spared), state.hosts['h1'].services['s'].env['A'])\n")
        return printed(code)

    # meanwhile done at once: the child is still loading (importing pygit2 and pydantic), and
    # this process does the spare work rather than wait for it idle.
    assert "SPARED 1 lambda: None" in spared("lambda: None")
    # meanwhile outlasted the child: nothing to fill, the spare work is left to the run.
    assert "SPARED 0 wait_child" in spared("wait_child")


def test_the_rewind_check_of_a_new_commit_asks_no_git_where_its_load_noted_the_ancestors(tmp_path, monkeypatch):
    repo = small_repo(tmp_path / "desired")
    applied = repo.commit()                     # what the host runs
    write_host(repo, "2")
    middle = repo.commit()
    write_host(repo, "3")
    new = repo.commit()                         # what the run deploys: never loaded before
    cache = tmp_path / "cache"
    # A fresh process, as a run: the child loads the new commit and notes its ancestors; the
    # rewind check over the host's applied revision is then answered without pygit2.
    code = (f"from pathlib import Path\nfrom reconciler import clicore\n"
            f"snap, state = clicore._load({str(repo.path)!r}, None, 'fleet', Path({str(cache)!r}), lambda: None)\n"
            f"check = clicore._descends(snap, Path({str(cache)!r}))\n"
            f"print('DESCENDS', check({new!r}, {applied!r}), check({new!r}, {middle!r}))\n")
    assert "DESCENDS True True" in printed(code)
    assert heavy(loaded(code), ("pygit2", "pydantic")) == []
    note = cache / "desired" / f"{new}.ancestors"
    assert note.read_text().split() == [middle, applied] and note.stat().st_mode & 0o777 == 0o600

    # What the note does not say is asked of git, with git's answers: a revision that is not an
    # ancestor (a rewind), one that is not in the repository at all.
    later = (f"from pathlib import Path\nfrom reconciler import clicore, source\n"
             f"snap = source.deferred_snapshot({str(repo.path)!r}, None, 'fleet')\n"
             f"check = clicore._descends(snap, Path({str(cache)!r}))\n"
             f"print('ASKED', check({applied!r}, {new!r}), check({new!r}, {'f' * 40!r}))\n")
    assert "ASKED False None" in printed(later)
    assert "pygit2" in loaded(later)

    # A note someone else could have written is not believed; nor a note of a commit that
    # does not list the applied revision (it lists only the newest ANCESTORS): git answers.
    note.chmod(0o666)
    assert not loadcache.descends_known(new, applied, cache)
    note.chmod(0o600)
    assert loadcache.descends_known(new, applied, cache)
    assert not loadcache.descends_known(new, new, cache) and not loadcache.descends_known(new, "HEAD", cache)
    monkeypatch.setattr(loadcache, "ANCESTORS", 1)
    write_host(repo, "4")
    newest = repo.commit()
    loadcache.load(source.snapshot(source.open_repo(str(repo.path)), newest, "fleet"), cache)
    assert (cache / "desired" / f"{newest}.ancestors").read_text().split() == [new]
    assert not loadcache.descends_known(newest, applied, cache)
    snap = source.snapshot(source.open_repo(str(repo.path)), newest, "fleet")
    from reconciler import clicore
    assert clicore._descends(snap, cache)(newest, applied) is True


def test_the_loading_child_builds_the_schema_without_pydantics_plugin_scan(tmp_path):
    repo = small_repo(tmp_path / "desired")
    rev = repo.commit()
    # What the forked child runs before loading: pydantic then never imports importlib.metadata
    # nor scans entry points, and the load is the same.
    code = (f"import sys\nfrom reconciler import loadcache, source\nloadcache._without_pydantic_plugins()\n"
            f"from reconciler.load import load_desired\n"
            f"state = load_desired(source.snapshot(source.open_repo({str(repo.path)!r}), {rev!r}, 'fleet'))\n"
            f"print('ENV', state.hosts['h1'].services['s'].env)\n")
    assert "ENV {'A': '1'}" in printed(code)
    mods = loaded(code)
    assert "pydantic" in mods and "importlib.metadata" not in mods


def test_early_connections_serve_only_the_same_host_reached_the_same_way(monkeypatch):
    import asyncio

    from reconciler import reconcile
    from reconciler.errors import HostKeyError
    from reconciler.spec import HostSpec, SSHSpec

    opened: list[tuple[str, SSHSpec]] = []
    closed: list[str] = []

    class Conn:
        def __init__(self, name: str):
            self.name = name

        async def close(self) -> None:
            closed.append(self.name)

    async def connect(name, spec, *, identity=None, connect_timeout=10.0):
        opened.append((name, spec))
        await asyncio.sleep(0.01)
        if spec.address == "127.0.0.9":
            raise HostKeyError(name, "host key of 127.0.0.9:22 is unknown or has changed")
        return Conn(name)

    monkeypatch.setattr(reconcile.SSHTransport, "connect", connect)
    a, b, c, gone = (HostSpec(n, SSHSpec(f"127.0.0.{i}")) for n, i in (("a", 5), ("b", 6), ("c", 9), ("gone", 7)))

    async def run() -> list[object]:
        early = reconcile.EarlyConnections()
        early.start([a, b, c, gone])
        conn = reconcile.ssh_connector(early=early)
        got: list[object] = [await conn(a)]
        # b's commit changed its port: a connection of its own, with the new settings
        got.append(await conn(HostSpec("b", SSHSpec("127.0.0.6", port=2222))))
        try:
            await conn(c)              # the early connect's failure is this connect's, not a second try
        except HostKeyError as e:
            got.append(e)
        await early.close()            # b's early one and gone's were not taken
        return got

    got = asyncio.run(run())
    assert [x.name if isinstance(x, Conn) else type(x).__name__ for x in got] == ["a", "b", "HostKeyError"]
    assert [(n, s.port) for n, s in opened] == [("a", 22), ("b", 22), ("c", 22), ("gone", 22), ("b", 2222)]
    assert sorted(closed) == ["b", "gone"]


def test_the_state_a_repo_loaded_last_is_read_back_without_git_or_the_loader(tmp_path):
    repo = small_repo(tmp_path / "desired")
    rev = repo.commit()
    cache = tmp_path / "cache"
    assert loadcache.last_loaded(str(repo.path), "fleet", cache) is None
    from reconciler import clicore
    clicore._load(str(repo.path), None, "fleet", cache)     # a run's load notes it
    # A fresh process: what this repo (and --path) loaded last, without pygit2 or pydantic.
    code = (f"from pathlib import Path\nfrom reconciler import loadcache\n"
            f"last = loadcache.last_loaded({str(repo.path)!r}, 'fleet', Path({str(cache)!r}))\n"
            f"print('LAST', last.revision, sorted(last.hosts), last.hosts['h1'].ssh.address)\n")
    assert f"LAST {rev} ['h1'] 127.0.0.5" in printed(code)
    assert heavy(loaded(code), ("pygit2", "pydantic", "reconciler.load")) == []
    # another --path of the same repo has its own; a pointer someone else could have written is not read
    assert loadcache.last_loaded(str(repo.path), "", cache) is None
    pointer = next((cache / "desired").glob("last-*"))
    pointer.chmod(0o666)
    assert loadcache.last_loaded(str(repo.path), "fleet", cache) is None
    pointer.chmod(0o600)
    pointer.write_text("HEAD")
    assert loadcache.last_loaded(str(repo.path), "fleet", cache) is None
